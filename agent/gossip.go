package agent

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/transport"
)

// Defaults for the zero values of GossipConfig.
const (
	DefaultMetricsInterval    = 2 * time.Second
	DefaultGossipLeaveTimeout = 3 * time.Second
)

// GossipConfig configures the agent's membership gossip. The agent joins
// the gossip through its relay after every registration, learns the other
// members from it and probes them through the relay's circuit until hole
// punching gives a direct path. Its metadata carries its models, capacity,
// in-flight count, the engine's queue and KV-cache usage, and its draining
// flag. The zero value runs gossip with the home preset.
type GossipConfig struct {
	// Disabled keeps the agent out of gossip: the relay then knows it by its
	// join registration alone (no load, slower failure detection).
	Disabled bool
	// Preset names the memberlist timings (transport.GossipPreset*). Empty
	// means the home preset.
	Preset string
	// Tune edits the memberlist timings after the preset (nil: none).
	Tune func(*memberlist.Config)
	// MetricsInterval is how often the engine's /metrics is read for the
	// gossip metadata (models are still read every RefreshInterval). Zero
	// means DefaultMetricsInterval (2 s).
	MetricsInterval time.Duration
	// LeaveTimeout bounds the wait for our leave to spread when the agent
	// stops. Zero means DefaultGossipLeaveTimeout (3 s).
	LeaveTimeout time.Duration
}

// NAT returns the agent's NAT traversal machinery (path to a peer, hole
// punch counters), or nil before Run has built its host.
func (a *Agent) NAT() *transport.AgentNAT { return a.nat.Load() }

// Gossip returns the agent's gossip member, or nil when gossip is off or
// before Run has started it.
func (a *Agent) Gossip() *transport.Gossip {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.gossip
}

// gossipMeta is the agent's health as published in gossip.
func (a *Agent) gossipMeta() transport.NodeMeta { return a.gossipMetaAt(time.Now()) }

// gossipMetaAt is gossipMeta with the load figures aged at now.
func (a *Agent) gossipMetaAt(now time.Time) transport.NodeMeta {
	a.mu.Lock()
	models := slices.Clone(a.models)
	met, known := a.loadLocked(now)
	engineOK := a.engineOK
	a.mu.Unlock()
	return transport.NodeMeta{
		Role:         transport.NodeRoleAgent,
		Name:         a.cfg.Name,
		Models:       models,
		Capacity:     a.cfg.MaxConcurrency,
		InFlight:     a.InFlight(),
		Running:      met.Running,
		Waiting:      met.Waiting,
		KVCacheUsage: met.KVCacheUsage,
		Draining:     a.draining.Load(),
		Unavailable:  !engineOK,
		LoadUnknown:  !known,
		Panics:       a.Panics(),
	}
}

// startGossip starts the agent's gossip member on h and the goroutines
// that join it through the relay and keep the engine's metrics fresh; they
// stop with ctx (and wg).
func (a *Agent) startGossip(ctx context.Context, h host.Host, wg *sync.WaitGroup) error {
	gc := a.cfg.Gossip
	if gc.Disabled {
		return nil
	}
	g, err := transport.NewGossip(transport.GossipConfig{
		Host:   h,
		Logger: a.cfg.Logger,
		Preset: gc.Preset,
		Tune:   gc.Tune,
		// Our relay, and the members it told us about: other agents must be
		// able to probe us (indirect probes included).
		Admit:        a.isRelay,
		AdmitMembers: true,
		// Only our relays' word about other members counts; they are
		// believed about themselves alone.
		Trusted: relayIDs(a.relayInfos()),
		// Other agents sit behind NAT too: reach them through the relay's
		// circuit; libp2p moves the connection to a direct path when hole
		// punching succeeds, and later streams take it.
		Resolve:    a.circuitAddrs,
		MetaSource: a.gossipMeta,
		OnEvent: func(ev transport.GossipEvent) {
			if ev.Type == transport.GossipAlive && !a.isRelay(ev.Peer) {
				a.predial(ctx, h, ev.Peer, wg)
			}
		},
	})
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.gossip = g
	a.mu.Unlock()
	interval := gc.MetricsInterval
	if interval <= 0 {
		interval = DefaultMetricsInterval
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		a.gossipJoinLoop(ctx, g)
	}()
	go func() {
		defer wg.Done()
		a.metricsLoop(ctx, interval)
	}()
	return nil
}

// predialLimit bounds the circuit dials to new members in flight.
const predialLimit = 8

// predial opens a connection to a new member through the relay's circuit
// in the background, so that the first probe does not pay for the dial
// (circuit hop, handshake) and time out: an agent would otherwise be
// suspected by every member that meets it. Called from gossip's event
// goroutine, it never blocks; gossip is shut down before wg is waited for,
// so no Add races the Wait.
func (a *Agent) predial(ctx context.Context, h host.Host, p peer.ID, wg *sync.WaitGroup) {
	if c := h.Network().Connectedness(p); c == network.Connected || c == network.Limited {
		return
	}
	select {
	case a.dialSem <- struct{}{}:
	default:
		return // enough dials in flight; the transport dials on demand
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer func() { <-a.dialSem }()
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		dctx = network.WithAllowLimitedConn(dctx, "gossip")
		if err := h.Connect(dctx, peer.AddrInfo{ID: p, Addrs: a.circuitAddrs(p)}); err != nil {
			a.log.Debug().Err(err).Stringer("peer", p).Msg("dial a new member through the relay")
		}
	}()
}

// gossipRejoin asks the gossip loop to join through the relay.
func (a *Agent) gossipRejoin() {
	select {
	case a.rejoin <- struct{}{}:
	default:
	}
}

// gossipJoinLoop joins the gossip through the relay whenever asked (after
// each registration), retrying with a growing pause (capped at 30 s) until
// it succeeds: the relay admits us to gossip once the registration is in,
// which is before Join returns, but its gossip may be busy or restarting,
// and until we are in, the relay knows us by the registration alone.
func (a *Agent) gossipJoinLoop(ctx context.Context, g *transport.Gossip) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.rejoin:
		}
		a.waitReservation(ctx, 5*time.Second)
		pause := 250 * time.Millisecond
		for attempt := 1; ; attempt++ {
			start := time.Now()
			n, err := g.Join(a.gossipSeeds()...)
			if err == nil && n > 0 {
				a.log.Info().Int("members", g.NumMembers()).Dur("took", time.Since(start)).Int("attempt", attempt).Msg("joined the gossip")
				break
			}
			if ctx.Err() != nil {
				return
			}
			if attempt == 5 {
				a.log.Warn().Err(err).Msg("cannot join the relay's gossip yet; the relay routes on the registration alone meanwhile; retrying")
			}
			select {
			case <-ctx.Done():
				return
			case <-a.rejoin:
				// A new registration: start over with it.
				pause = 250 * time.Millisecond
			case <-time.After(pause):
				pause = min(2*pause, 30*time.Second)
			}
		}
	}
}

// waitReservation waits (up to limit) until the agent can be reached and
// punched through: it holds a reservation at the relay (other agents reach
// us through the relay's circuit; members that learn of us before cannot
// probe us and would suspect us for nothing) and has registered the
// hole-punch protocol (the member that receives our relayed connection
// starts the punch once, and gives up if we do not speak it yet).
func (a *Agent) waitReservation(ctx context.Context, limit time.Duration) {
	nat := a.NAT()
	if nat == nil {
		return
	}
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	if nat.WaitReady(wctx) != nil && ctx.Err() == nil {
		a.log.Warn().Dur("waited", limit).Bool("reservation", nat.Stats().Reservations > 0).Msg("not ready for hole punching yet; joining the gossip anyway (other agents may reach us only through the relay)")
	}
}

// metricsLoop reads the engine's /metrics every interval while the engine
// answers, so that gossip carries fresh load, and ages the figures when a
// read fails (load.go).
func (a *Agent) metricsLoop(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.scrapeOnce(ctx, time.Now())
	}
}

// scrapeOnce reads the engine's load once, if the engine answers, and
// records the read (or its failure) as made at now.
func (a *Agent) scrapeOnce(ctx context.Context, now time.Time) {
	a.mu.Lock()
	ok := a.engineOK
	a.mu.Unlock()
	if !ok {
		a.noteLoad(now, nil, errEngineDown)
		return
	}
	met, err := a.scrapeLoad(ctx, EngineInfo{}, false)
	switch {
	case ctx.Err() != nil:
	case err != nil:
		a.noteLoad(now, nil, err)
	default:
		a.noteLoad(now, &met, nil)
	}
}

// gossipNow publishes the agent's metadata now (its draining flag, its
// panics), not at the next interval.
func (a *Agent) gossipNow() {
	if g := a.Gossip(); g != nil {
		g.UpdateMeta()
	}
}

// gossipLeave announces our departure and waits (up to LeaveTimeout) for
// it to spread.
func (a *Agent) gossipLeave() {
	g := a.Gossip()
	if g == nil {
		return
	}
	timeout := a.cfg.Gossip.LeaveTimeout
	if timeout <= 0 {
		timeout = DefaultGossipLeaveTimeout
	}
	start := time.Now()
	defer func() {
		// memberlist panics on a leave after its shutdown; a member shut
		// down from outside (Gossip().Shutdown) has nothing left to leave.
		if v := recover(); v != nil {
			a.log.Debug().Interface("panic", v).Msg("gossip leave after shutdown")
		}
	}()
	if err := g.Leave(timeout); err != nil {
		a.log.Debug().Err(err).Msg("gossip leave")
		return
	}
	a.log.Info().Dur("took", time.Since(start)).Msg("left the gossip")
}

// stopGossip shuts the gossip member down (after gossipLeave on a clean
// stop).
func (a *Agent) stopGossip() {
	a.mu.Lock()
	g := a.gossip
	a.gossip = nil
	a.mu.Unlock()
	if g != nil {
		_ = g.Shutdown()
	}
}

// Host returns the agent's libp2p host while Run runs, else nil.
func (a *Agent) Host() host.Host {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.host
}

func relayIDs(infos []peer.AddrInfo) []peer.ID {
	out := make([]peer.ID, 0, len(infos))
	for _, ai := range infos {
		out = append(out, ai.ID)
	}
	return out
}
