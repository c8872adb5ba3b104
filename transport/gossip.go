package transport

import (
	"bytes"
	"errors"
	"fmt"
	"log"
	"reflect"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"
)

// Gossip presets accepted in GossipConfig.Preset.
const (
	// GossipPresetHome suits members on home links and relayed paths: the
	// default. See gossipPreset for every number.
	GossipPresetHome = "home"
	// GossipPresetWAN is memberlist's DefaultWANConfig.
	GossipPresetWAN = "wan"
	// GossipPresetLAN is memberlist's DefaultLANConfig.
	GossipPresetLAN = "lan"
	// GossipPresetLocal is memberlist's DefaultLocalConfig (loopback tests).
	GossipPresetLocal = "local"
)

// gossipPreset returns the memberlist configuration a preset names. The
// transport-independent parts only; NewGossip fills in the rest.
func gossipPreset(name string) (*memberlist.Config, error) {
	switch name {
	case "", GossipPresetHome:
		c := memberlist.DefaultWANConfig()
		// Probe one member every 2 s (LAN 1 s, WAN 5 s): home uplinks and
		// relayed paths add latency, but routing should learn of a dead agent
		// within seconds, not the WAN preset's half minute.
		c.ProbeInterval = 2 * time.Second
		// Wait 1 s for a direct ack (LAN 500 ms, WAN 3 s): a relayed round
		// trip between two homes is a few hundred milliseconds; bufferbloat
		// spikes are absorbed by suspicion, not by the probe timeout.
		c.ProbeTimeout = time.Second
		// Ask 3 members for indirect probes when the direct one fails (the
		// default): they take other paths (a direct hole-punched link
		// instead of the relay's circuit).
		c.IndirectChecks = 3
		// Suspicion lasts SuspicionMult * max(1, log10(n)) * ProbeInterval at
		// least: 4 * 1 * 2 s = 8 s below 10 members (WAN 6 * 5 s = 30 s), and
		// up to SuspicionMaxTimeoutMult times that (32 s) while no other
		// member confirms it. A suspected member has that long to refute.
		c.SuspicionMult = 4
		c.SuspicionMaxTimeoutMult = 4
		// Gossip every 300 ms to 3 members (LAN 200 ms / 3, WAN 500 ms / 4).
		c.GossipInterval = 300 * time.Millisecond
		c.GossipNodes = 3
		// Keep gossiping to a dead member for 30 s so it learns it was declared
		// dead and refutes quickly when it comes back (LAN 30 s, WAN 60 s).
		c.GossipToTheDeadTime = 30 * time.Second
		// Full state sync every 30 s (LAN 30 s, WAN 60 s): repairs anything
		// lost, costs one stream per member and period.
		c.PushPullInterval = 30 * time.Second
		// A stream (push/pull) may take 10 s, dial included (LAN 10 s, WAN 30 s).
		c.TCPTimeout = 10 * time.Second
		// Retransmit each broadcast RetransmitMult * log10(n+1) times (default 4).
		c.RetransmitMult = 4
		return c, nil
	case GossipPresetWAN:
		return memberlist.DefaultWANConfig(), nil
	case GossipPresetLAN:
		return memberlist.DefaultLANConfig(), nil
	case GossipPresetLocal:
		return memberlist.DefaultLocalConfig(), nil
	default:
		return nil, fmt.Errorf("transport: unknown gossip preset %q", name)
	}
}

// GossipEventType is the kind of a GossipEvent.
type GossipEventType int

// Gossip events.
const (
	// GossipAlive: a member joined, or a suspect member refuted suspicion.
	GossipAlive GossipEventType = iota + 1
	// GossipSuspect: a member failed a probe and is suspected; avoid it.
	GossipSuspect
	// GossipDead: a member was declared dead (failed without leaving).
	GossipDead
	// GossipLeft: a member left gracefully.
	GossipLeft
	// GossipUpdated: a member published new metadata.
	GossipUpdated
)

// String returns "alive", "suspect", "dead", "left" or "updated".
func (t GossipEventType) String() string {
	switch t {
	case GossipAlive:
		return "alive"
	case GossipSuspect:
		return "suspect"
	case GossipDead:
		return "dead"
	case GossipLeft:
		return "left"
	case GossipUpdated:
		return "updated"
	default:
		return fmt.Sprintf("GossipEventType(%d)", int(t))
	}
}

// GossipEvent is a change of another member's state or metadata.
type GossipEvent struct {
	Type GossipEventType
	Peer peer.ID
	// Meta is the member's latest metadata; MetaErr is set when it did not
	// decode (a newer or broken encoding).
	Meta    NodeMeta
	MetaErr error
	// At is when the change was recorded.
	At time.Time
}

// GossipMember is a snapshot of another member that is alive or suspect.
type GossipMember struct {
	Peer    peer.ID
	Suspect bool
	Meta    NodeMeta
	MetaErr error
	// Since is when the member last changed state.
	Since time.Time
}

// GossipConfig configures NewGossip. Only Host and Admit are required.
type GossipConfig struct {
	// Host carries the gossip; its peer ID is our memberlist node name.
	Host host.Host
	// Logger receives our logs and memberlist's. The zero value discards.
	Logger zerolog.Logger
	// Preset names the memberlist timings: GossipPresetHome when empty.
	Preset string
	// Tune, when set, edits the memberlist configuration after the preset
	// (timings only: the transport, delegates, name and logger are ours and
	// are set again afterwards).
	Tune func(*memberlist.Config)
	// Admit says which peers may gossip with us (see GossipTransportConfig).
	// The relay admits its joined agents; an agent admits its relays.
	// Required.
	Admit func(peer.ID) bool
	// AdmitMembers also admits peers that are currently members (learned
	// from admitted peers). Agents set it so they can probe each other.
	AdmitMembers bool
	// Trusted are the members whose word about other members counts: an
	// agent trusts its relay, a relay its peer relays. Every other member
	// is believed only about itself (its alive and metadata, its leave);
	// what it says about others is dropped before memberlist sees it, and a
	// claim no honest member makes gets it cut off (see gossipGuard). Nil
	// trusts nobody: members then learn of each other only first-hand.
	Trusted []peer.ID
	// OnForged, if set, hears of a member caught sending forged gossip,
	// with the reason; Gossip has already logged it and stopped admitting
	// it. Called from the transport: it must not block.
	OnForged func(p peer.ID, reason string)
	// Resolve returns addresses for an unconnected peer; nil = the peerstore.
	// Agents return /p2p/<relay>/p2p-circuit/p2p/<peer> addresses.
	Resolve func(peer.ID) []ma.Multiaddr
	// MetaSource returns our current metadata; Seq is filled in by Gossip.
	// Nil means empty metadata. Called from one goroutine, once per
	// MetaInterval.
	MetaSource func() NodeMeta
	// MetaInterval is how often MetaSource is read; a significant change
	// is published at once, others after MetaRefresh. Zero means 1 s.
	MetaInterval time.Duration
	// MetaRefresh is how long a small load change may wait before it is
	// published. Zero means 10 s.
	MetaRefresh time.Duration
	// OnEvent receives every GossipEvent in order, from one goroutine. It
	// may take a little time but should not block: events queue behind it.
	// Nil discards events (Members still works).
	OnEvent func(GossipEvent)
}

func (c *GossipConfig) populate() {
	if c.Preset == "" {
		c.Preset = GossipPresetHome
	}
	if c.MetaInterval == 0 {
		c.MetaInterval = time.Second
	}
	if c.MetaRefresh == 0 {
		c.MetaRefresh = 10 * time.Second
	}
	if c.MetaSource == nil {
		c.MetaSource = func() NodeMeta { return NodeMeta{} }
	}
	if c.OnEvent == nil {
		c.OnEvent = func(GossipEvent) {}
	}
}

func (c *GossipConfig) validate() error {
	if c.Host == nil {
		return errors.New("transport: gossip needs a host")
	}
	if c.Admit == nil {
		return errors.New("transport: gossip needs an Admit hook")
	}
	if c.MetaInterval < 0 || c.MetaRefresh < 0 {
		return errors.New("transport: gossip meta intervals must not be negative")
	}
	_, err := gossipPreset(c.Preset)
	return err
}

// Gossip is a memberlist member whose transport is libp2p: every relay and
// agent runs one. Memberlist reports joins, updates and departures; it has no
// hook for suspicion, so Gossip reads memberlist's suspect, alive and dead
// broadcasts as they cross the transport and keeps its own view (see
// gossipObserver). All methods are safe for concurrent use.
type Gossip struct {
	cfg  GossipConfig
	log  zerolog.Logger
	self peer.ID
	ml   *memberlist.Memberlist
	tr   *GossipTransport
	mlc  *memberlist.Config

	// suspicion timings, copied before the transport starts observing
	suspicionMult, suspicionMaxMult int
	probeInterval                   time.Duration

	guard *gossipGuard
	// sweepEvery is how often sweep runs, and queueSlack what it leaves in
	// memberlist's broadcast queue beyond one message per member:
	// gossipSweepEvery and gossipQueueSlack (tests lower them).
	sweepEvery, queueSlack atomic.Int64

	mu        sync.Mutex            // guards the following fields
	banned    map[peer.ID]time.Time // caught forging: not admitted until then
	members   map[peer.ID]*gossipEntry
	incarn    map[peer.ID]uint32    // latest incarnation seen in an alive message
	leftSeen  map[peer.ID]time.Time // a dead message sent by the member itself
	queue     []GossipEvent
	metaBytes []byte
	published NodeMeta
	pubAt     time.Time

	wake     chan struct{} // events queued
	metaNow  chan struct{} // UpdateMeta called
	done     chan struct{}
	wg       sync.WaitGroup
	stopOnce sync.Once
}

type gossipEntry struct {
	suspect      bool
	suspectUntil time.Time
	meta         NodeMeta
	metaErr      error
	since        time.Time
}

// NewGossip starts a memberlist member on cfg.Host. It is alone until Join.
func NewGossip(cfg GossipConfig) (*Gossip, error) {
	cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	g := &Gossip{
		cfg:      cfg,
		log:      cfg.Logger.With().Str("component", "gossip").Logger(),
		self:     cfg.Host.ID(),
		members:  make(map[peer.ID]*gossipEntry),
		incarn:   make(map[peer.ID]uint32),
		leftSeen: make(map[peer.ID]time.Time),
		banned:   make(map[peer.ID]time.Time),
		wake:     make(chan struct{}, 1),
		metaNow:  make(chan struct{}, 1),
		done:     make(chan struct{}),
	}
	mlc, _ := gossipPreset(cfg.Preset)
	if cfg.Tune != nil {
		cfg.Tune(mlc)
	}
	g.suspicionMult, g.suspicionMaxMult, g.probeInterval = mlc.SuspicionMult, mlc.SuspicionMaxTimeoutMult, mlc.ProbeInterval
	g.guard = newGossipGuard(g.self, cfg.Trusted)
	g.sweepEvery.Store(int64(gossipSweepEvery))
	g.queueSlack.Store(gossipQueueSlack)
	admit := func(p peer.ID) bool {
		if g.isBanned(p) {
			return false
		}
		return cfg.Admit(p) || (cfg.AdmitMembers && g.Known(p))
	}
	tr, err := NewGossipTransport(GossipTransportConfig{
		Host:     cfg.Host,
		Admit:    admit,
		Resolve:  cfg.Resolve,
		Logger:   cfg.Logger,
		observe:  g.observe,
		guard:    g.guard,
		onForged: g.forgedBy,
	})
	if err != nil {
		return nil, err
	}
	g.tr = tr

	mlc.Name = g.self.String()
	mlc.Transport = tr
	mlc.Delegate = gossipDelegate{g}
	mlc.Events = gossipDelegate{g}
	mlc.Alive = gossipDelegate{g}
	mlc.Logger = log.New(memberlistLogWriter{cfg.Logger.With().Str("component", "memberlist").Logger()}, "", 0)
	mlc.LogOutput = nil
	// Packets and streams ride the same libp2p connection: a stream
	// fallback after a failed packet probe adds nothing but delay.
	mlc.DisableTcpPings = true
	// Node names are peer IDs; every address we handle carries one.
	mlc.RequireNodeNames = true
	g.mlc = mlc

	first := cfg.MetaSource()
	first.Seq = 1
	b, err := EncodeMeta(first, memberlist.MetaMaxSize)
	if err != nil {
		tr.Shutdown()
		return nil, fmt.Errorf("transport: gossip metadata: %w", err)
	}
	g.metaBytes, g.published, g.pubAt = b, first, time.Now()

	ml, err := memberlist.Create(mlc)
	if err != nil {
		tr.Shutdown()
		return nil, fmt.Errorf("transport: memberlist: %w", err)
	}
	g.ml = ml
	g.wg.Add(2)
	go g.dispatch()
	go g.metaLoop()
	return g, nil
}

// gossipBan is how long a member caught forging is not admitted. It holds
// what admits it (a relay's join secret; an agent's relay's word), so it
// can come back under a new peer ID anyway; the ban ends so that the bans
// of departed forgers do not pile up.
const gossipBan = time.Hour

// isBanned reports whether p was caught forging and is still cut off.
func (g *Gossip) isBanned(p peer.ID) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	until, ok := g.banned[p]
	return ok && time.Now().Before(until)
}

// forgedBy cuts off a member caught forging: it is no longer admitted (its
// packet stream was reset by the transport), and OnForged is told.
func (g *Gossip) forgedBy(p peer.ID, reason string) {
	now := time.Now()
	g.mu.Lock()
	until, again := g.banned[p]
	again = again && now.Before(until)
	g.banned[p] = now.Add(gossipBan)
	g.mu.Unlock()
	if again {
		return
	}
	g.log.Warn().Stringer("peer", p).Str("reason", reason).Msg("member sent forged gossip; cut off")
	if g.cfg.OnForged != nil {
		g.cfg.OnForged(p, reason)
	}
}

// Banned returns the members cut off for forged gossip.
func (g *Gossip) Banned() []peer.ID {
	now := time.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]peer.ID, 0, len(g.banned))
	for p, until := range g.banned {
		if now.Before(until) {
			out = append(out, p)
		}
	}
	return out
}

// Self returns our peer ID (our memberlist node name).
func (g *Gossip) Self() peer.ID { return g.self }

// Join contacts the given members (typically our relay) and merges their view
// of the cluster; it returns how many answered. It blocks up to the preset's
// stream timeout per peer.
func (g *Gossip) Join(peers ...peer.ID) (int, error) {
	addrs := make([]string, 0, len(peers))
	for _, p := range peers {
		addrs = append(addrs, p.String()+"/"+gossipAddrString(p))
	}
	n, err := g.ml.Join(addrs)
	if err != nil {
		return n, fmt.Errorf("transport: gossip join: %w", err)
	}
	return n, nil
}

// Leave announces our departure and waits up to timeout for it to spread.
// The others report GossipLeft. Shutdown must still be called.
func (g *Gossip) Leave(timeout time.Duration) error {
	if err := g.ml.Leave(timeout); err != nil {
		return fmt.Errorf("transport: gossip leave: %w", err)
	}
	return nil
}

// Shutdown stops memberlist without leaving (the others will detect us dead),
// the transport and our goroutines. Safe to call more than once.
func (g *Gossip) Shutdown() error {
	var err error
	g.stopOnce.Do(func() {
		err = g.ml.Shutdown()
		close(g.done)
		g.wg.Wait()
		g.tr.Shutdown()
	})
	return err
}

// Members returns the other members that are alive or suspect.
func (g *Gossip) Members() []GossipMember {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]GossipMember, 0, len(g.members))
	for p, e := range g.members {
		out = append(out, GossipMember{Peer: p, Suspect: e.suspect, Meta: e.meta, MetaErr: e.metaErr, Since: e.since})
	}
	return out
}

// Known reports whether p is another member that is alive or suspect.
func (g *Gossip) Known(p peer.ID) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, ok := g.members[p]
	return ok
}

// NumMembers returns memberlist's count of live members, ourselves included.
func (g *Gossip) NumMembers() int { return g.ml.NumMembers() }

// UpdateMeta reads MetaSource now instead of at the next interval, e.g. when
// draining starts. It does not block.
func (g *Gossip) UpdateMeta() {
	select {
	case g.metaNow <- struct{}{}:
	default:
	}
}

// Stats returns the transport's counters.
func (g *Gossip) Stats() GossipStats { return g.tr.Stats() }

// MemberlistConfig returns the memberlist configuration in use (read only).
func (g *Gossip) MemberlistConfig() *memberlist.Config { return g.mlc }

func (g *Gossip) metaLoop() {
	defer g.wg.Done()
	tick := time.NewTicker(g.cfg.MetaInterval)
	defer tick.Stop()
	for {
		select {
		case <-g.done:
			return
		case <-tick.C:
		case <-g.metaNow:
		}
		next := g.cfg.MetaSource()
		g.mu.Lock()
		prev, at := g.published, g.pubAt
		g.mu.Unlock()
		if !metaSignificant(prev, next) && (metaEqual(prev, next) || time.Since(at) < g.cfg.MetaRefresh) {
			continue
		}
		next.Seq = prev.Seq + 1
		b, err := EncodeMeta(next, memberlist.MetaMaxSize)
		if err != nil {
			g.log.Error().Err(err).Msg("encode gossip metadata")
			continue
		}
		g.mu.Lock()
		g.metaBytes, g.published, g.pubAt = b, next, time.Now()
		g.mu.Unlock()
		// UpdateNode waits until the broadcast has been retransmitted enough,
		// without watching for shutdown: bound the wait by our interval. A
		// timeout only means the news is still spreading.
		if err := g.ml.UpdateNode(g.cfg.MetaInterval); err != nil {
			g.log.Debug().Err(err).Msg("publish gossip metadata")
		}
	}
}

// record queues an event; callers hold g.mu.
func (g *Gossip) record(ev GossipEvent) {
	g.queue = append(g.queue, ev)
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// dispatch delivers queued events and expires stale suspicion.
func (g *Gossip) dispatch() {
	defer g.wg.Done()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	swept := time.Now()
	for {
		select {
		case <-g.done:
			return
		case <-g.wake:
		case now := <-tick.C:
			g.expireSuspicion(now)
			if now.Sub(swept) >= time.Duration(g.sweepEvery.Load()) {
				swept = now
				g.sweep(now)
			}
		}
		g.mu.Lock()
		q := g.queue
		g.queue = nil
		g.mu.Unlock()
		for _, ev := range q {
			g.cfg.OnEvent(ev)
		}
	}
}

// gossipSweepEvery is how often Gossip forgets what it keeps about peers
// that are not members (sweep).
const gossipSweepEvery = 30 * time.Second

// sweep forgets what Gossip, its guard and its transport keep about peers
// that are no longer members: a departed member's state goes at its
// NotifyLeave (forget); this catches what was recorded about peers that
// never became members, or after they left, and bans that ended.
func (g *Gossip) sweep(now time.Time) {
	g.mu.Lock()
	members := make(map[peer.ID]bool, len(g.members))
	for p := range g.members {
		members[p] = true
	}
	for p := range g.incarn {
		if !members[p] {
			delete(g.incarn, p)
		}
	}
	for p := range g.leftSeen {
		if !members[p] {
			delete(g.leftSeen, p)
		}
	}
	for p, until := range g.banned {
		if !now.Before(until) {
			delete(g.banned, p)
		}
	}
	g.mu.Unlock()
	keep := func(p peer.ID) bool { return members[p] || p == g.self }
	g.guard.keepOnly(keep)
	g.tr.keepOnly(keep)
	if q := broadcastQueue(g.ml); q != nil {
		q.Prune(len(members) + int(g.queueSlack.Load()))
	}
}

// gossipQueueSlack is how many broadcasts beyond one per member memberlist
// may keep queued (see sweep).
const gossipQueueSlack = 64

// broadcastQueue returns memberlist's queue of broadcasts about members,
// or nil if this memberlist keeps it otherwise (a test checks that it does
// not). Memberlist keeps a member's last alive or dead message there until
// it has been sent to enough members: under churn faster than gossip
// drains it, or with no member left to send to, the messages of departed
// members pile up, one per departure, and memberlist offers no bound. sweep
// prunes it (memberlist's own Prune, oldest and most sent first) to one
// message per member and some slack: a member that misses the news of an
// old departure learns it from its own probes or the next push/pull.
func broadcastQueue(ml *memberlist.Memberlist) *memberlist.TransmitLimitedQueue {
	f := reflect.ValueOf(ml).Elem().FieldByName("broadcasts")
	if !f.IsValid() || f.Type() != reflect.TypeFor[*memberlist.TransmitLimitedQueue]() || f.IsNil() {
		return nil
	}
	return (*memberlist.TransmitLimitedQueue)(unsafe.Pointer(f.Pointer()))
}

// forget drops what Gossip's guard and transport keep about p, a member
// that left (Gossip's own tables drop it in NotifyLeave).
func (g *Gossip) forget(p peer.ID) {
	g.guard.forget(p)
	g.tr.forget(p)
}

// expireSuspicion clears suspicion that memberlist must have resolved by
// now: it either declared the member dead (NotifyLeave) or saw a refutation
// we did not observe (e.g. learned in a push/pull).
func (g *Gossip) expireSuspicion(now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for p, e := range g.members {
		if e.suspect && now.After(e.suspectUntil) {
			e.suspect, e.since = false, now
			g.record(GossipEvent{Type: GossipAlive, Peer: p, Meta: e.meta, MetaErr: e.metaErr, At: now})
		}
	}
}

func (g *Gossip) nodePeer(n *memberlist.Node) (peer.ID, bool) {
	p, err := peer.Decode(n.Name)
	if err != nil || p == g.self {
		return "", false
	}
	return p, true
}

// gossipDelegate implements memberlist's Delegate, EventDelegate and
// AliveDelegate. Memberlist calls them with its locks held: they only record
// state under g.mu and return.
type gossipDelegate struct{ g *Gossip }

func (d gossipDelegate) NodeMeta(limit int) []byte {
	d.g.mu.Lock()
	defer d.g.mu.Unlock()
	if len(d.g.metaBytes) > limit {
		return nil
	}
	return bytes.Clone(d.g.metaBytes)
}

func (d gossipDelegate) NotifyMsg([]byte)                           {}
func (d gossipDelegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (d gossipDelegate) LocalState(join bool) []byte                { return nil }
func (d gossipDelegate) MergeRemoteState(buf []byte, join bool)     {}

// NotifyAlive rejects members whose name is not a peer ID and, unless
// AdmitMembers is set, members we do not admit: an admitted peer cannot
// smuggle an outsider into our view.
func (d gossipDelegate) NotifyAlive(n *memberlist.Node) error {
	p, err := peer.Decode(n.Name)
	if err != nil {
		return fmt.Errorf("member name %q is not a peer ID", n.Name)
	}
	if p == d.g.self || d.g.cfg.AdmitMembers || d.g.cfg.Admit(p) {
		return nil
	}
	return fmt.Errorf("member %s not admitted", p)
}

func (d gossipDelegate) NotifyJoin(n *memberlist.Node) {
	p, ok := d.g.nodePeer(n)
	if !ok {
		return
	}
	meta, merr := DecodeMeta(n.Meta)
	now := time.Now()
	d.g.mu.Lock()
	defer d.g.mu.Unlock()
	d.g.members[p] = &gossipEntry{meta: meta, metaErr: merr, since: now}
	delete(d.g.leftSeen, p)
	d.g.record(GossipEvent{Type: GossipAlive, Peer: p, Meta: meta, MetaErr: merr, At: now})
}

func (d gossipDelegate) NotifyUpdate(n *memberlist.Node) {
	p, ok := d.g.nodePeer(n)
	if !ok {
		return
	}
	meta, merr := DecodeMeta(n.Meta)
	now := time.Now()
	d.g.mu.Lock()
	defer d.g.mu.Unlock()
	e := d.g.members[p]
	if e == nil {
		e = &gossipEntry{since: now}
		d.g.members[p] = e
	}
	e.meta, e.metaErr = meta, merr
	d.g.record(GossipEvent{Type: GossipUpdated, Peer: p, Meta: meta, MetaErr: merr, At: now})
}

func (d gossipDelegate) NotifyLeave(n *memberlist.Node) {
	p, ok := d.g.nodePeer(n)
	if !ok {
		return
	}
	now := time.Now()
	d.g.mu.Lock()
	defer d.g.mu.Unlock()
	typ := GossipDead
	if at, ok := d.g.leftSeen[p]; ok && now.Sub(at) < time.Minute {
		typ = GossipLeft
	}
	ev := GossipEvent{Type: typ, Peer: p, At: now}
	if e := d.g.members[p]; e != nil {
		ev.Meta, ev.MetaErr = e.meta, e.metaErr
	}
	delete(d.g.members, p)
	delete(d.g.leftSeen, p)
	delete(d.g.incarn, p)
	d.g.record(ev)
	// Memberlist holds its lock: the guard's and the transport's are
	// taken after it, never before.
	d.g.forget(p)
}

// memberlistLogWriter turns memberlist's "[LEVEL] memberlist: text" lines
// into zerolog events at the matching level.
type memberlistLogWriter struct{ log zerolog.Logger }

func (w memberlistLogWriter) Write(b []byte) (int, error) {
	line := string(bytes.TrimRight(b, "\n"))
	lvl := zerolog.InfoLevel
	for prefix, l := range map[string]zerolog.Level{
		"[DEBUG] ": zerolog.DebugLevel, "[INFO] ": zerolog.InfoLevel,
		"[WARN] ": zerolog.WarnLevel, "[ERR] ": zerolog.ErrorLevel, "[ERROR] ": zerolog.ErrorLevel,
	} {
		if len(line) >= len(prefix) && line[:len(prefix)] == prefix {
			lvl, line = l, line[len(prefix):]
			break
		}
	}
	if len(line) > 11 && line[:11] == "memberlist:" {
		line = line[11:]
		if len(line) > 0 && line[0] == ' ' {
			line = line[1:]
		}
	}
	w.log.WithLevel(lvl).Msg(line)
	return len(b), nil
}
