package relay

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/liveness"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// ErrNameTaken rejects a join whose agent name is held by another peer.
var ErrNameTaken = errors.New("agent name is taken by another peer")

// ErrBadName rejects a join without a usable agent name.
var ErrBadName = errors.New("agent name is empty or too long")

// maxNameLen bounds agent names: they appear in headers, logs and metrics.
const maxNameLen = 128

// Registry is the relay's table of joined agents. It binds each agent name
// to the first peer ID that joined with it, for as long as that peer stays
// joined, and feeds the scheduler: the scheduler's endpoint ID is the agent
// name. It implements transport.JoinHandler; all methods are safe for
// concurrent use and do not block on I/O.
type Registry struct {
	sched *scheduler.Scheduler
	log   zerolog.Logger
	// index, if set, hears of registrations that end and of agents whose
	// prefix index entries were dropped while they stayed joined (prefix.go).
	index *indexService
	// onRelays, if set, is called with the relays a joining or updating
	// agent names (package peering): with mu held on a join, so that they are
	// known before the agent is routable; without on an update.
	onRelays func([]string)
	// onJoined, if set, is called (without mu held) once an agent has
	// joined (agentusage.go: the ledger's claim of its name).
	onJoined func(name string, p peer.ID)
	// ops, if set, holds the operator's settings that win over what agents
	// declare, and the names reserved for provider endpoints (operator.go).
	ops *operator
	// prefillLimit is every agent's scheduler.Endpoint.PrefillLimit, in
	// blocks; 0 for none.
	prefillLimit int
	// forget, if set, is called (without mu held) when a registration
	// ended, with the peer and, when no agent holds it any more, the name:
	// state kept by peer or name elsewhere (metric series, traffic counts,
	// the peerstore) goes with them.
	forget func(p peer.ID, name string)

	mu     sync.Mutex        // guards the following fields
	byName map[string]*entry // agent name -> entry
	byPeer map[peer.ID]*entry
	// pending holds peers connected to the relay's host that have not
	// joined (yet), with when their first connection opened: see Admitted.
	pending map[peer.ID]time.Time
	// members is gossip's view of every member, joined or not (gossip.go).
	members map[peer.ID]*gossipPeer
	// leftAt holds when recent registrations ended (see GossipAdmitted).
	leftAt map[peer.ID]time.Time
	// banned holds peers cut off for forged gossip, until when (forgery.go).
	banned map[peer.ID]time.Time
}

// AdmitGrace is how long a peer may stay connected to the relay without
// joining; it is then disconnected (see Relay). It grants nothing: circuit
// reservations and circuits are for joined peers only (Registry.Admitted),
// and agents ask for their reservation once joined.
const AdmitGrace = 15 * time.Second

// entry is one joined agent.
type entry struct {
	name   string
	peer   peer.ID
	host   string // peer.String(), the upstream URL's host, encoded once
	info   transport.JoinInfo
	health scheduler.Health
	dead   bool // removed from routing by SetDead; the join still holds the name
	// unresponsive is set by the request path's liveness checks (an
	// unacknowledged request, a silent probe) and cleared by the next
	// answer: it makes the agent suspect whatever gossip says.
	unresponsive bool
	// joinedAt is when the registration was accepted: gossip news about
	// the peer from before it is stale (gossip.go).
	joinedAt time.Time
}

// AgentInfo describes a joined agent, for status and tests.
type AgentInfo struct {
	Name     string
	Peer     peer.ID
	Engine   string // the engine's kind, as the agent reports it
	Models   []string
	Weight   float64
	Capacity int
	Draining bool // the agent's own flag, from its join or updates
	// Health is the health the scheduler routes on (see Registry.health):
	// gossip's report with the join's and the operator's drain and the
	// request path's liveness verdict.
	Health scheduler.Health
	Dead   bool
}

var (
	_ transport.JoinHandler = (*Registry)(nil)
	_ liveness.Registry     = (*Registry)(nil)
)

func newRegistry(s *scheduler.Scheduler, log zerolog.Logger) *Registry {
	return &Registry{
		sched:   s,
		log:     log,
		byName:  make(map[string]*entry),
		byPeer:  make(map[peer.ID]*entry),
		pending: make(map[peer.ID]time.Time),
		members: make(map[peer.ID]*gossipPeer),
		leftAt:  make(map[peer.ID]time.Time),
		banned:  make(map[peer.ID]time.Time),
	}
}

// Admitted reports whether peer p may use the relay's circuit relay service:
// it holds a registration. There is no grace for a peer that is still
// joining, or a peer without the token could hold a reservation and open
// circuits for the grace of every connection it makes. It never blocks on
// I/O; the NAT options call it for every reservation and circuit (both ends).
func (g *Registry) Admitted(p peer.ID) bool { return g.IsJoined(p) }

// IsJoined reports whether peer p holds a registration (gossip's Admit).
func (g *Registry) IsJoined(p peer.ID) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, ok := g.byPeer[p]
	return ok
}

// connected records a new connection from p (network notifier: no I/O).
func (g *Registry) connected(p peer.ID, now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.byPeer[p]; ok {
		return
	}
	if _, ok := g.pending[p]; !ok {
		g.pending[p] = now
	}
}

// disconnected forgets a pending peer whose last connection closed.
func (g *Registry) disconnected(p peer.ID) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.pending, p)
}

// overdue returns the peers connected for AdmitGrace or longer without
// joining, and forgets them.
func (g *Registry) overdue(now time.Time) []peer.ID {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []peer.ID
	for p, since := range g.pending {
		if now.Sub(since) >= AdmitGrace {
			out = append(out, p)
			delete(g.pending, p)
		}
	}
	return out
}

// Joined admits peer p as agent info.Name. It fails with ErrNameTaken when
// another peer holds the name and ErrBadName for an unusable name. A peer
// joining again replaces its previous registration (reconnects).
func (g *Registry) Joined(p peer.ID, info transport.JoinInfo) error {
	if info.Name == "" || len(info.Name) > maxNameLen {
		return ErrBadName
	}
	if g.ops.isReserved(info.Name) {
		return fmt.Errorf("%w: %q is a provider endpoint", ErrNameTaken, info.Name)
	}
	g.mu.Lock()
	if g.isBannedLocked(p, time.Now()) {
		g.mu.Unlock()
		return ErrBanned
	}
	if e, ok := g.byName[info.Name]; ok && e.peer != p {
		g.mu.Unlock()
		g.log.Warn().Str("agent", info.Name).Stringer("peer", p).Stringer("owner", e.peer).Msg("join rejected: name taken")
		return fmt.Errorf("%w: %q", ErrNameTaken, info.Name)
	}
	var oldName string
	if old, ok := g.byPeer[p]; ok && old.name != info.Name {
		// The same peer now joins under another name: drop the old one.
		delete(g.byName, old.name)
		oldName = old.name
	}
	e := &entry{name: info.Name, peer: p, host: p.String(), info: cloneInfo(info), joinedAt: time.Now()}
	if prev, ok := g.byName[info.Name]; ok {
		e.health = prev.health
	}
	delete(g.pending, p)
	// Gossip may already know the peer (a reconnect): its load still
	// holds; a dead or suspect verdict does not, the join proves liveness.
	e.health = g.gossipHealthLocked(p, e.health)
	g.byName[info.Name] = e
	g.byPeer[p] = e
	if oldName != "" {
		g.withdrawLocked(oldName)
	}
	// The agent's other relays are learned before it is routable, so that
	// a request it could serve first waits for their session bindings
	// (package peering; it takes its own lock and never the registry's). A peer
	// relay still has to prove the join secret.
	if g.onRelays != nil && len(info.Relays) > 0 {
		g.onRelays(info.Relays)
	}
	g.publishLocked(e, true)
	g.mu.Unlock()

	if oldName != "" && g.forget != nil {
		g.forget("", oldName)
	}
	g.log.Info().Str("agent", info.Name).Stringer("peer", p).Strs("models", info.Models).
		Int("capacity", info.Capacity).Bool("draining", info.Draining).Msg("agent joined")
	if g.onJoined != nil {
		g.onJoined(info.Name, p)
	}
	return nil
}

// Updated applies a joined agent's new models, weight, capacity or draining
// flag. Updates from peers that hold no name, or that try to rename, are
// ignored (a new name needs a new join).
func (g *Registry) Updated(p peer.ID, info transport.JoinInfo) {
	g.mu.Lock()
	e, ok := g.byPeer[p]
	if !ok || (info.Name != "" && info.Name != e.name) {
		g.mu.Unlock()
		g.log.Warn().Stringer("peer", p).Str("agent", info.Name).Msg("update ignored: not joined under that name")
		return
	}
	info.Name = e.name
	e.info = cloneInfo(info)
	relays := info.Relays
	g.publishLocked(e, true)
	g.mu.Unlock()

	g.log.Info().Str("agent", info.Name).Strs("models", info.Models).Int("capacity", info.Capacity).
		Bool("draining", info.Draining).Msg("agent updated")
	if g.onRelays != nil && len(relays) > 0 {
		g.onRelays(relays)
	}
}

// Left removes the agent that peer p joined as and frees its name.
func (g *Registry) Left(p peer.ID) {
	g.mu.Lock()
	e, ok := g.byPeer[p]
	freed := false
	if ok {
		delete(g.byPeer, p)
		g.leftAt[p] = time.Now()
		if g.byName[e.name] == e {
			delete(g.byName, e.name)
			g.withdrawLocked(e.name)
			freed = true
		}
	}
	g.mu.Unlock()
	if !ok {
		return
	}
	g.log.Info().Str("agent", e.name).Stringer("peer", p).Msg("agent left")
	if g.index != nil {
		g.index.left(p)
	}
	if g.forget != nil {
		name := ""
		if freed {
			name = e.name
		}
		g.forget(p, name)
	}
}

// SetHealth records health news about a joined agent (from gossip or the
// agent's reports). The draining flag from the join is kept: an agent that
// said it drains stays draining. Unknown names are ignored.
func (g *Registry) SetHealth(name string, h scheduler.Health) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if e, ok := g.byName[name]; ok {
		e.health = h
		g.publishLocked(e, false)
	}
}

// SetDead takes a joined agent out of routing (dead = true; its sessions'
// affinity is dropped) or puts it back (dead = false), while it keeps its
// name. Failure detection calls it; unknown names are ignored.
func (g *Registry) SetDead(name string, dead bool) {
	g.mu.Lock()
	e, ok := g.byName[name]
	changed := ok && e.dead != dead
	if changed {
		e.dead = dead
		g.publishLocked(e, true)
	}
	g.mu.Unlock()
	if !changed {
		return
	}
	g.log.Info().Str("agent", name).Bool("dead", dead).Msg("agent liveness changed")
	if !dead && g.index != nil {
		// Remove dropped its prefix index entries: ask for them again.
		g.index.resync(e.peer)
	}
}

// sweep forgets registrations that ended more than leaveGrace ago and bans
// that ran out: what departed peers left behind.
func (g *Registry) sweep(now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for p, at := range g.leftAt {
		if now.Sub(at) >= leaveGrace {
			delete(g.leftAt, p)
		}
	}
	for p, until := range g.banned {
		if !now.Before(until) {
			delete(g.banned, p)
		}
	}
}

// Peer returns the peer ID that holds agent name.
func (g *Registry) Peer(name string) (peer.ID, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e, ok := g.byName[name]
	if !ok {
		return "", false
	}
	return e.peer, true
}

// upstream returns the URL host that reaches agent name (its peer ID in
// text form) and the peer itself.
func (g *Registry) upstream(name string) (string, peer.ID, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e, ok := g.byName[name]
	if !ok {
		return "", "", false
	}
	return e.host, e.peer, true
}

// registration returns the agent name peer p joined as and when.
func (g *Registry) registration(p peer.ID) (string, time.Time, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e, ok := g.byPeer[p]
	if !ok {
		return "", time.Time{}, false
	}
	return e.name, e.joinedAt, true
}

// Name returns the agent name peer p joined as.
func (g *Registry) Name(p peer.ID) (string, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e, ok := g.byPeer[p]
	if !ok {
		return "", false
	}
	return e.name, true
}

// Agents lists the joined agents, sorted by name.
func (g *Registry) Agents() []AgentInfo {
	g.mu.Lock()
	out := make([]AgentInfo, 0, len(g.byName))
	for _, e := range g.byName {
		out = append(out, AgentInfo{
			Name: e.name, Peer: e.peer, Engine: e.info.Engine, Models: slices.Clone(e.info.Models), Weight: e.info.Weight,
			Capacity: e.info.Capacity, Draining: e.info.Draining, Health: g.health(e), Dead: e.dead,
		})
	}
	g.mu.Unlock()
	slices.SortFunc(out, func(a, b AgentInfo) int {
		switch {
		case a.Name < b.Name:
			return -1
		case a.Name > b.Name:
			return 1
		}
		return 0
	})
	return out
}

// Registered returns the joined agents, in no order, for the request
// path's liveness checks (package liveness).
func (g *Registry) Registered() []liveness.Agent {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]liveness.Agent, 0, len(g.byName))
	for _, e := range g.byName {
		out = append(out, liveness.Agent{Name: e.name, Peer: e.peer})
	}
	return out
}

// Holds reports whether agent name is registered to peer p.
func (g *Registry) Holds(name string, p peer.ID) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	e, ok := g.byName[name]
	return ok && e.peer == p
}

// routable counts the joined agents the scheduler routes to in the
// ordinary course (scheduler.Scheduler.Routable: serving a model, neither
// dead, disabled, draining nor suspect). It reads the scheduler's own
// state, which the registry alone writes: the gauge, /healthz and the
// admin API agree with the router the moment it changes its mind.
func (g *Registry) routable() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for name := range g.byName {
		if g.sched.Routable(name) {
			n++
		}
	}
	return n
}

// serving reports whether a joined agent that is neither dead nor draining
// lists a model, suspect or not: when none does, as while agents rejoin a
// restarted relay, a model the scheduler does not know may yet come.
func (g *Registry) serving() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, e := range g.byName {
		if !e.dead && !e.info.Draining && !e.health.Draining && len(e.info.Models) > 0 {
			return true
		}
	}
	return false
}

// The registry is the one writer of agent state to the scheduler: every
// source of news about an agent (its join and updates, gossip, the request
// path's liveness checks, the operator) changes the agent's entry, and the
// entry is published here, under mu, so that the scheduler sees the changes
// in the order they took effect and always the whole of them (an operator's
// drain survives a liveness verdict, and the other way round).

// publishLocked hands the scheduler agent e as it stands: out of routing
// while dead, else its endpoint (when upsert: models, weight, capacity, the
// operator's settings) and the health it routes on (health). Callers hold
// g.mu.
func (g *Registry) publishLocked(e *entry, upsert bool) {
	if e.dead {
		g.sched.Remove(e.name)
		return
	}
	if upsert {
		g.sched.Upsert(g.endpoint(e))
	}
	g.sched.SetHealth(e.name, g.health(e))
}

// withdrawLocked takes agent name out of the scheduler: its registration
// ended or moved to another name. Callers hold g.mu.
func (g *Registry) withdrawLocked(name string) {
	g.sched.Remove(name)
}

// endpoint is the scheduler's view of agent e, with the operator's
// settings applied. Called with g.mu held.
func (g *Registry) endpoint(e *entry) scheduler.Endpoint {
	ep := scheduler.Endpoint{
		ID:       e.name,
		Models:   slices.Clone(e.info.Models),
		Weight:   e.info.Weight,
		Capacity: e.info.Capacity,

		PrefillLimit: g.prefillLimit,
	}
	st := g.ops.agent(e.name, ep.Weight)
	ep.Weight, ep.Priority, ep.Disabled = st.weight, st.priority, st.disabled
	return ep
}

// health is the health the scheduler sees for agent e: gossip's (or the
// agent's) report, made draining by the join's flag or the operator's
// drain, and suspect by a liveness failure in the request path. Called with
// g.mu held.
func (g *Registry) health(e *entry) scheduler.Health {
	h := e.health
	h.Draining = h.Draining || e.info.Draining
	h.Suspect = h.Suspect || e.unresponsive
	if g.ops != nil && g.ops.agent(e.name, 0).draining {
		h.Draining = true
	}
	return h
}

// SetUnresponsive marks agent name (registered to p) suspect because of a
// liveness failure in the request path (package liveness), or clears the
// mark.
func (g *Registry) SetUnresponsive(name string, p peer.ID, on bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if e, ok := g.byName[name]; ok && e.peer == p && e.unresponsive != on {
		e.unresponsive = on
		g.publishLocked(e, false)
	}
}

// reapply hands every agent's endpoint and health to the scheduler again,
// after the operator's settings changed.
func (g *Registry) reapply() {
	g.mu.Lock()
	for _, e := range g.byName {
		g.publishLocked(e, true)
	}
	g.mu.Unlock()
}

func cloneInfo(info transport.JoinInfo) transport.JoinInfo {
	info.Models = slices.Clone(info.Models)
	info.APIs, info.UnknownAPIs = slices.Clone(info.APIs), slices.Clone(info.UnknownAPIs)
	info.Relays = slices.Clone(info.Relays)
	return info
}

// withIndex runs f with the name of agent p, under the registry's lock, if
// p is joined and not dead: prefix index updates then cannot outlive the
// registration (Left and SetDead remove the entries under the same lock).
func (g *Registry) withIndex(p peer.ID, f func(name string)) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e, ok := g.byPeer[p]
	if !ok || e.dead || g.byName[e.name] != e {
		return
	}
	f(e.name)
}
