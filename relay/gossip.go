package relay

// Membership gossip on the relay, and how it is reconciled with the join
// registrations.
//
// The relay is a memberlist member (transport.Gossip over its libp2p host).
// It admits to gossip the agents holding a join registration, plus the other
// relays named in GossipConfig.Relays. Two sources then speak about an
// agent: its join stream (authenticated, carried on the connection the agent
// dialed; its end means the agent went away or the path broke) and gossip
// (SWIM failure detection with indirect probes through other members, and
// the agent's load in its metadata). The routing table follows both:
//
//	join stream   gossip            routing
//	open          never seen        routable (an agent without gossip, or
//	                                before its gossip join)
//	open          alive             routable; load, queue, KV usage and
//	                                draining from the metadata feed the score
//	open          suspect           avoided (scheduler.Health.Suspect): used
//	                                only when nothing else can serve
//	open          dead              out of routing (scheduler.Remove, which
//	                                drops its sessions' affinity); the name
//	                                stays held, and the agent is routable
//	                                again as soon as gossip sees it alive
//	                                (it refuted, e.g. a partition healed)
//	open          left              out of routing at once (graceful stop;
//	                                its join stream ends right after)
//	ended         any               removed at once (Registry.Left): the
//	                                relay has no way to reach it
//	none          alive             not routable: the relay holds no
//	                                registration, so it cannot name or reach
//	                                the agent; it is only counted
//
// A dead or suspect verdict recorded before the agent's current join is
// stale and ignored: a fresh join proves liveness. Models and capacity come
// from whichever source changed last: gossip metadata that carries a new
// model list or capacity updates the scheduler (Upsert), and a list that
// was truncated to its digest leaves the join registration's list in place.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// DefaultGossipLeaveTimeout bounds how long a stopping relay waits for its
// leave to spread.
const DefaultGossipLeaveTimeout = 3 * time.Second

// GossipConfig configures the relay's membership gossip. The zero value
// runs gossip with the home preset (transport.GossipPresetHome).
type GossipConfig struct {
	// Disabled turns gossip off: the routing table then follows the join
	// registrations alone.
	Disabled bool
	// Preset names the memberlist timings (transport.GossipPreset*). Empty
	// means the home preset.
	Preset string
	// Tune edits the memberlist timings after the preset (nil: none).
	Tune func(*memberlist.Config)
	// Relays are other relays to gossip with: admitted, and joined at
	// start (retried until one answers). Empty means none.
	Relays []peer.AddrInfo
	// LeaveTimeout bounds the wait for our leave to spread when the relay
	// stops. Zero means DefaultGossipLeaveTimeout.
	LeaveTimeout time.Duration
}

// gossipPeer is what gossip last said about one member.
type gossipPeer struct {
	suspect bool
	meta    transport.NodeMeta
	metaOK  bool
	// digest and capacity last seen in gossip for an agent: a change of
	// either is news, not a disagreement with the join registration.
	digest   [8]byte
	capacity int
	seen     bool
}

// healthFromMeta turns an agent's gossip metadata into scheduler health.
// The agent's own in-flight count covers requests from every relay and
// engines without metrics: it stands in for Running when larger. When the
// agent says its engine's load is unknown (no figures, or stale ones), the
// engine's figures are left at zero, which the scheduler reads as "no
// data": it goes by the in-flight counts alone, neither idle nor saturated
// on the word of an old scrape.
func healthFromMeta(m transport.NodeMeta, suspect bool) scheduler.Health {
	h := scheduler.Health{
		Suspect:  suspect,
		Draining: m.Draining || m.Unavailable,
		Running:  m.InFlight,
	}
	if !m.LoadUnknown {
		h.Running = max(m.Running, m.InFlight)
		h.Waiting = m.Waiting
		h.KVCacheUsage = m.KVCacheUsage
	}
	return h
}

// leaveGrace is how long a peer whose registration ended stays admitted to
// gossip: an agent that stops sends its gossip leave just before it closes
// its registration, and the two travel on different streams.
const leaveGrace = 10 * time.Second

// GossipAdmitted reports whether peer p may gossip with the relay: it holds
// a registration, or its registration ended less than leaveGrace ago.
func (g *Registry) GossipAdmitted(p peer.ID) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.byPeer[p]; ok {
		return true
	}
	at, ok := g.leftAt[p]
	if ok && time.Since(at) >= leaveGrace {
		delete(g.leftAt, p)
		ok = false
	}
	return ok
}

// gossipHealthLocked is the health of a peer that (re)joins: gossip's load
// if gossip knows it, else prev; never suspect. Callers hold g.mu.
func (g *Registry) gossipHealthLocked(p peer.ID, prev scheduler.Health) scheduler.Health {
	if m, ok := g.members[p]; ok && m.metaOK {
		return healthFromMeta(m.meta, false)
	}
	prev.Suspect = false
	return prev
}

// gossipEvent applies one gossip event to the routing table (see the table
// at the top of this file). Gossip delivers events from one goroutine.
func (g *Registry) gossipEvent(ev transport.GossipEvent) {
	g.mu.Lock()
	m := g.members[ev.Peer]
	switch ev.Type {
	case transport.GossipAlive, transport.GossipSuspect, transport.GossipUpdated:
		if m == nil {
			m = &gossipPeer{}
			g.members[ev.Peer] = m
		}
		if ev.Type != transport.GossipUpdated {
			m.suspect = ev.Type == transport.GossipSuspect
		}
		if ev.MetaErr == nil {
			m.meta, m.metaOK = ev.Meta, true
		}
	case transport.GossipDead, transport.GossipLeft:
		delete(g.members, ev.Peer)
	}
	e, ok := g.byPeer[ev.Peer]
	if !ok || g.byName[e.name] != e {
		g.mu.Unlock()
		g.log.Debug().Stringer("peer", ev.Peer).Stringer("event", ev.Type).Msg("gossip about a member without a join registration: not routable")
		return
	}
	if (ev.Type == transport.GossipDead || ev.Type == transport.GossipSuspect) && ev.At.Before(e.joinedAt) {
		g.mu.Unlock()
		return
	}
	wasDead := e.dead
	upsert := false
	switch ev.Type {
	case transport.GossipAlive, transport.GossipSuspect, transport.GossipUpdated:
		if m.metaOK && m.meta.Role == transport.NodeRoleAgent {
			upsert = g.gossipModelsLocked(e, m)
			e.health = healthFromMeta(m.meta, m.suspect)
		} else {
			e.health.Suspect = m.suspect
		}
		if e.dead {
			// Memberlist only reports alive members as suspect or updated:
			// the agent is back (it refuted, or the partition healed).
			e.dead, upsert = false, true
		}
		g.publishLocked(e, upsert)
	case transport.GossipDead, transport.GossipLeft:
		if ev.Type == transport.GossipLeft {
			e.health.Draining = true
		}
		if !e.dead {
			e.dead = true
			g.publishLocked(e, false)
		}
	}
	name, dead := e.name, e.dead
	g.mu.Unlock()

	if ev.Type != transport.GossipUpdated || wasDead != dead {
		g.log.Info().Str("agent", name).Stringer("peer", ev.Peer).Stringer("gossip", ev.Type).Bool("routable", !dead).Msg("agent membership changed")
	}
}

// gossipModelsLocked applies a model list or capacity that changed in
// gossip to e and reports whether the scheduler needs an Upsert. A list
// truncated to its digest is only compared: when it differs from the join
// registration's, the registration's list stays until the agent's join
// update brings the new one. Callers hold g.mu.
func (g *Registry) gossipModelsLocked(e *entry, m *gossipPeer) bool {
	meta := m.meta
	first := !m.seen
	digestChanged := first || meta.ModelsDigest != m.digest
	capChanged := first || meta.Capacity != m.capacity
	m.digest, m.capacity, m.seen = meta.ModelsDigest, meta.Capacity, true
	upsert := false
	if digestChanged && meta.ModelsDigest != transport.ModelsDigest(e.info.Models) {
		if meta.ModelsTruncated {
			g.log.Debug().Str("agent", e.name).Int("models", meta.ModelCount).
				Msg("gossip carries a model digest that differs from the join registration; keeping the registration's list")
		} else {
			e.info.Models = slices.Clone(meta.Models)
			upsert = true
		}
	}
	if capChanged && meta.Capacity != e.info.Capacity {
		e.info.Capacity = meta.Capacity
		upsert = true
	}
	return upsert
}

// gossipCounts returns the members gossip lists, by role and suspicion, and
// how many of the agents among them hold no join registration.
func (g *Registry) gossipCounts() (alive, suspect map[transport.NodeRole]int, unregistered int) {
	alive, suspect = map[transport.NodeRole]int{}, map[transport.NodeRole]int{}
	g.mu.Lock()
	defer g.mu.Unlock()
	for p, m := range g.members {
		role := m.meta.Role
		if m.suspect {
			suspect[role]++
		} else {
			alive[role]++
		}
		if _, ok := g.byPeer[p]; !ok && role == transport.NodeRoleAgent {
			unregistered++
		}
	}
	return alive, suspect, unregistered
}

// agentPanics returns, by agent name, the handler panics each agent alive
// in gossip reports having recovered.
func (g *Registry) agentPanics() map[string]uint64 {
	out := map[string]uint64{}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, m := range g.members {
		if m.metaOK && m.meta.Role == transport.NodeRoleAgent {
			out[m.meta.Name] += m.meta.Panics
		}
	}
	return out
}

// relayGossip is the relay's gossip member and its admission bookkeeping.
type relayGossip struct {
	r      *Relay
	g      *transport.Gossip
	relays map[peer.ID]bool // configured peer relays, admitted

	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	leaveOnce sync.Once
}

// startP2PAdmission watches the relay host's connections for peers that
// connect without joining and disconnects those that still have not joined
// after AdmitGrace. They get nothing meanwhile: no circuit reservation, no
// circuit, no gossip (Registry.Admitted, GossipAdmitted).
func (r *Relay) startP2PAdmission(relays map[peer.ID]bool) {
	nb := &network.NotifyBundle{
		ConnectedF: func(_ network.Network, c network.Conn) {
			if p := c.RemotePeer(); !relays[p] {
				r.reg.connected(p, time.Now())
			}
		},
		DisconnectedF: func(n network.Network, c network.Conn) {
			if p := c.RemotePeer(); n.Connectedness(p) != network.Connected && n.Connectedness(p) != network.Limited {
				r.reg.disconnected(p)
				r.forgetPeer(p)
			}
		},
	}
	r.host.Network().Notify(nb)
	r.bgWG.Add(1)
	go func() {
		defer r.bgWG.Done()
		defer r.host.Network().StopNotify(nb)
		t := time.NewTicker(AdmitGrace / 3)
		defer t.Stop()
		for {
			select {
			case <-r.bgCtx.Done():
				return
			case now := <-t.C:
				for _, p := range r.reg.overdue(now) {
					if r.reg.IsJoined(p) || relays[p] || r.peerKnown(p) {
						continue
					}
					r.log.Debug().Stringer("peer", p).Msg("disconnecting a peer that did not join")
					_ = r.host.Network().ClosePeer(p)
				}
			}
		}
	}()
}

// startGossip starts the relay's gossip member on its host.
func (r *Relay) startGossip() error {
	gc := r.cfg.Gossip
	rg := &relayGossip{r: r, relays: make(map[peer.ID]bool)}
	for _, ai := range gc.Relays {
		rg.relays[ai.ID] = true
	}
	g, err := transport.NewGossip(transport.GossipConfig{
		Host:   r.host,
		Logger: r.cfg.Logger,
		Preset: gc.Preset,
		Tune:   gc.Tune,
		Admit:  func(p peer.ID) bool { return rg.relays[p] || r.reg.GossipAdmitted(p) || r.peerAdmitted(p) },
		// Configured peer relays pass on what they heard; agents are
		// believed only about themselves, and one caught forging is cut
		// off. Session-sharing peers (peerAdmitted) prove only the join
		// secret, as agents do, so they too are believed only about
		// themselves.
		Trusted:  peerIDs(gc.Relays),
		OnForged: r.forged,
		MetaSource: func() transport.NodeMeta {
			return transport.NodeMeta{Role: transport.NodeRoleRelay, Draining: r.draining.Load()}
		},
		OnEvent: r.reg.gossipEvent,
	})
	if err != nil {
		return fmt.Errorf("relay: gossip: %w", err)
	}
	rg.g = g
	rg.ctx, rg.cancel = context.WithCancel(context.Background())
	r.gossip = rg
	if len(gc.Relays) > 0 {
		rg.wg.Add(1)
		go rg.joinRelays(gc.Relays)
	}
	mc := r.gossip.g.MemberlistConfig()
	r.log.Info().Str("preset", presetName(gc.Preset)).Dur("probe_interval", mc.ProbeInterval).
		Dur("probe_timeout", mc.ProbeTimeout).Int("suspicion_mult", mc.SuspicionMult).Msg("gossip started")
	return nil
}

func peerIDs(infos []peer.AddrInfo) []peer.ID {
	out := make([]peer.ID, 0, len(infos))
	for _, ai := range infos {
		out = append(out, ai.ID)
	}
	return out
}

func presetName(p string) string {
	if p == "" {
		return transport.GossipPresetHome
	}
	return p
}

// joinRelays connects to the configured relays and joins their gossip,
// retrying every few seconds until one answers or the relay closes.
func (rg *relayGossip) joinRelays(relays []peer.AddrInfo) {
	defer rg.wg.Done()
	h := rg.r.host
	for {
		ids := make([]peer.ID, 0, len(relays))
		for _, ai := range relays {
			ctx, cancel := context.WithTimeout(rg.ctx, 10*time.Second)
			err := h.Connect(ctx, ai)
			cancel()
			if err == nil {
				ids = append(ids, ai.ID)
			}
		}
		if len(ids) > 0 {
			if n, err := rg.g.Join(ids...); err == nil && n > 0 {
				rg.r.log.Info().Int("relays", n).Msg("joined the gossip of peer relays")
				return
			}
		}
		select {
		case <-rg.ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
}

// leave announces that the relay is going away (draining metadata, then a
// gossip leave), once.
func (rg *relayGossip) leave() {
	rg.leaveOnce.Do(func() {
		rg.g.UpdateMeta()
		timeout := rg.r.cfg.Gossip.LeaveTimeout
		if timeout == 0 {
			timeout = DefaultGossipLeaveTimeout
		}
		if err := rg.g.Leave(timeout); err != nil {
			rg.r.log.Debug().Err(err).Msg("gossip leave")
		}
	})
}

// shutdown stops gossip without leaving (after leave on a clean stop).
func (rg *relayGossip) shutdown() error {
	rg.cancel()
	rg.wg.Wait()
	return rg.g.Shutdown()
}

// Gossip returns the relay's gossip member, or nil when gossip is off (or
// NoP2P).
func (r *Relay) Gossip() *transport.Gossip {
	if r.gossip == nil {
		return nil
	}
	return r.gossip.g
}

// gossipCollector exports gossip's counters and membership at scrape time.
type gossipCollector struct{ r *Relay }

var (
	descGossipMembers = prometheus.NewDesc("computeflux_gossip_members",
		"Other gossip members the relay sees, by role and state (alive or suspect).", []string{"role", "state"}, nil)
	descGossipUnregistered = prometheus.NewDesc("computeflux_gossip_agents_unregistered",
		"Agents alive in gossip without a join registration at this relay (not routable here).", nil, nil)
	descGossipPackets = prometheus.NewDesc("computeflux_gossip_packets_total",
		"Gossip packets, by direction (sent, received, dropped).", []string{"direction"}, nil)
	descGossipBytes = prometheus.NewDesc("computeflux_gossip_bytes_total",
		"Gossip payload bytes on packets and streams, by direction.", []string{"direction"}, nil)
	descGossipStreams = prometheus.NewDesc("computeflux_gossip_streams_total",
		"Gossip streams, by direction (opened, accepted).", []string{"direction"}, nil)
	descGossipRejected = prometheus.NewDesc("computeflux_gossip_rejected_total",
		"Gossip streams, packets and dials refused because the peer was not admitted.", nil, nil)
	descAgentPanics = prometheus.NewDesc("computeflux_agent_panics_total",
		"Request handler panics an agent alive in gossip reports its servers recovered since it started.", []string{"agent"}, nil)
)

// Describe implements prometheus.Collector.
func (c gossipCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descGossipMembers, descGossipUnregistered, descGossipPackets,
		descGossipBytes, descGossipStreams, descGossipRejected, descAgentPanics} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c gossipCollector) Collect(ch chan<- prometheus.Metric) {
	alive, suspect, unreg := c.r.reg.gossipCounts()
	for _, role := range []transport.NodeRole{transport.NodeRoleAgent, transport.NodeRoleRelay, transport.NodeRoleUnknown} {
		ch <- prometheus.MustNewConstMetric(descGossipMembers, prometheus.GaugeValue, float64(alive[role]), role.String(), "alive")
		ch <- prometheus.MustNewConstMetric(descGossipMembers, prometheus.GaugeValue, float64(suspect[role]), role.String(), "suspect")
	}
	ch <- prometheus.MustNewConstMetric(descGossipUnregistered, prometheus.GaugeValue, float64(unreg))
	s := c.r.gossip.g.Stats()
	ch <- prometheus.MustNewConstMetric(descGossipPackets, prometheus.CounterValue, float64(s.PacketsSent), "sent")
	ch <- prometheus.MustNewConstMetric(descGossipPackets, prometheus.CounterValue, float64(s.PacketsReceived), "received")
	ch <- prometheus.MustNewConstMetric(descGossipPackets, prometheus.CounterValue, float64(s.PacketsDropped), "dropped")
	ch <- prometheus.MustNewConstMetric(descGossipBytes, prometheus.CounterValue, float64(s.BytesSent), "sent")
	ch <- prometheus.MustNewConstMetric(descGossipBytes, prometheus.CounterValue, float64(s.BytesReceived), "received")
	ch <- prometheus.MustNewConstMetric(descGossipStreams, prometheus.CounterValue, float64(s.StreamsOpened), "opened")
	ch <- prometheus.MustNewConstMetric(descGossipStreams, prometheus.CounterValue, float64(s.StreamsAccepted), "accepted")
	ch <- prometheus.MustNewConstMetric(descGossipRejected, prometheus.CounterValue, float64(s.Rejected))
	for name, n := range c.r.reg.agentPanics() {
		ch <- prometheus.MustNewConstMetric(descAgentPanics, prometheus.CounterValue, float64(n), name)
	}
}

// startDrain marks the relay as stopping and leaves the gossip (once).
func (r *Relay) startDrain() {
	r.draining.Store(true)
	if r.gossip != nil {
		r.gossip.leave()
	}
}
