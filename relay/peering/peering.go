// Package peering shares session bindings, and the spending of clients
// with a budget, between the relays that serve one fleet.
//
// Relays learn each other from the agents that joined them (every agent's
// join info lists all its relays, Manager.Hint) and from Settings.Relays.
// A relay keeps one outbound transport.SessionsProtocol stream to every
// peer relay it knows: both sides prove the join secret
// (transport.Handshake, mutual), then the dialer sends the bindings it
// holds and, from then on, batches of binding updates (every local new
// binding or move, and a refresh of a busy session every TTL/10). Its
// peer does the same the other way, so each stream carries one direction.
// A peer relay, once it has proved the secret, is admitted to gossip
// (Manager.Admitted) and joined (Config.JoinGossip), so that relays and
// agents form one memberlist cluster: a hard failure one relay sees (an
// agent dead or gone) reaches the others. Breakers and latency averages
// stay per relay: they measure the relay's own path.
//
// Received bindings go through scheduler.BindingTable (the order that makes
// every relay agree; see there) and, when they win, into the scheduler
// with Config.Bind. A binding to an agent this relay does not know yet (an
// agent that has not rejoined after a restart) stays in the table and is
// installed when a request of the session arrives (Manager.Install).
//
// With a ledger, a relay also sends the peers the operator named
// (Settings.Relays, and only those: a learned peer proved nothing but
// the join secret) what each client with a budget spent through it today
// and this month, every SpentInterval when it changed (encodeSpent), and
// checks budgets against its own count plus its peers' last reports.
//
// Frames are transport.Framing's (at most maxPeerFrame). The handshake is
// transport.Handshake's, mutual, the reader accepting and the dialer
// initiating with its boot ID as the payload; then bindings frames
// (encodeBindings; a table ends with an empty one) and spending frames
// (transport.SessionsProtocol only, not transport.SessionsProtocolV2),
// dialer -> reader only.
//
// A Manager is built by New from a Config of what it needs of the relay
// (the libp2p host, the clock, the ledger, the scheduler's Bind and a few
// hooks), not from the relay itself.
package peering

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/peerstore"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Defaults for the zero values of Settings.
const (
	DefaultFlushInterval = 10 * time.Millisecond // batching delay of binding updates
	DefaultMaxPending    = 1 << 16               // updates queued per peer before a resync
	DefaultForget        = 5 * time.Minute       // a learned peer unreachable this long is dropped
	DefaultSpentInterval = time.Second           // how often budgeted clients' spending is sent
)

// Settings configures how the relay shares session bindings with peer
// relays. The zero value shares them with the peers learned from agents.
type Settings struct {
	// Disabled keeps the relay to itself: no bindings shared, agents'
	// relay lists ignored.
	Disabled bool
	// Relays are peer relays to connect to from the start (--peer-relay),
	// kept for as long as the relay runs. Empty means only those learned
	// from agents.
	Relays []peer.AddrInfo
	// FlushInterval is how long binding updates wait to be sent in one
	// batch. Zero means DefaultFlushInterval (10 ms).
	FlushInterval time.Duration
	// MaxPending bounds the updates queued for one peer; past it the queue
	// is dropped and the peer is sent every live binding again. Zero means
	// DefaultMaxPending.
	MaxPending int
	// Forget is how long a peer learned from agents may stay unreachable
	// before the relay stops dialing it. Zero means DefaultForget.
	Forget time.Duration
	// SpentInterval is how often the relay tells its configured peers
	// (Relays) what its clients with a budget spent, so that a budget
	// holds across relays. Zero means DefaultSpentInterval (1 s).
	SpentInterval time.Duration
}

func (c Settings) populate() Settings {
	if c.FlushInterval <= 0 {
		c.FlushInterval = DefaultFlushInterval
	}
	if c.MaxPending <= 0 {
		c.MaxPending = DefaultMaxPending
	}
	if c.Forget <= 0 {
		c.Forget = DefaultForget
	}
	if c.SpentInterval <= 0 {
		c.SpentInterval = DefaultSpentInterval
	}
	return c
}

// Config is what a Manager needs of the relay. Host, Clock and Bind are
// required; the funcs may be called concurrently and must not call back
// into the Manager.
type Config struct {
	Settings
	// Host is the relay's libp2p host: the sessions protocol's handlers
	// are set on it, and peer relays dialed from it.
	Host host.Host
	// Secret is the join secret both sides of a peer stream prove.
	Secret []byte
	// Clock gives the time of bindings and spending reports.
	Clock scheduler.Clock
	// Logger receives the peer relays' log lines.
	Logger zerolog.Logger
	// Ledger, if set, is the usage ledger whose spending is sent to the
	// configured peers and into which theirs is merged.
	Ledger *ledger.Ledger
	// SessionTTL and MaxSessions bound the binding table, as the
	// scheduler's session table is bounded.
	SessionTTL  time.Duration
	MaxSessions int
	// Bind installs a session's binding in the scheduler
	// (scheduler.Scheduler.Bind) and reports whether it took.
	Bind func(key, endpoint string, last time.Time) bool
	// Budgeted reports whether client has a budget here; only those
	// clients' spending is sent and applied. Nil means none has.
	Budgeted func(client string) bool
	// JoinGossip, if set, joins a peer relay's gossip (it may block until
	// the gossip shuts down).
	JoinGossip func(p peer.ID) error
	// Synced, if set, is called when a peer relay has sent its whole
	// table: requests waiting for it may go on.
	Synced func()
	// AwaitWindow is how long after Start requests of sessions with no
	// binding may wait for the peers' tables (Pending, Install).
	AwaitWindow time.Duration
	// SyncWait, if positive, replaces how long such a request waits for a
	// newly learned peer relay's table (2 s).
	SyncWait time.Duration
}

// Wire limits of the sessions protocol.
const (
	peerVersion     byte = 1
	maxPeerFrame         = 1 << 20
	peerBatchBytes       = 32 << 10 // a batch frame is cut at about this size
	maxPeerKey           = 1024     // longer session keys are not shared
	maxPeerEndpoint      = 256
	maxPeerLinks         = 64 // peer relays known at once
	peerIOTimeout        = 10 * time.Second
	// peerSyncWait bounds how long, after a relay's start, a request of
	// a session it holds no binding for waits for a newly learned peer
	// relay's bindings.
	peerSyncWait    = 2 * time.Second
	peerProofLabel  = "computeflux relay peer proof"
	msgPeerBindings = transport.FrameProtocol
	msgPeerSpent    = transport.FrameProtocol + 1 // transport.SessionsProtocol only, not V2
	maxPeerClient   = 256                         // longest client name in a spending report
)

// errPeerFrame reports a frame that violates the sessions protocol.
var errPeerFrame = errors.New("malformed sessions frame")

// Stats counts the relay's binding traffic with peer relays.
type Stats struct {
	// Peers is the number of peer relays with an authenticated stream out.
	Peers int
	// BindingsSent and BindingsReceived count binding updates.
	BindingsSent, BindingsReceived uint64
	// BytesSent and BytesReceived count the sessions protocol's bytes
	// (frames, handshakes included).
	BytesSent, BytesReceived uint64
	// Bound counts received bindings installed into the scheduler.
	Bound uint64
	// Sessions is the number of bindings the relay's binding table holds.
	Sessions int
	// Refused counts inbound peer streams that failed the handshake.
	Refused uint64
	// Resyncs counts peers that came back as a new process (a new boot
	// ID in their hello) while our stream to them looked alive, and were
	// sent every binding again.
	Resyncs uint64
	// SpentReceived counts client spending entries applied from peers'
	// reports.
	SpentReceived uint64
}

// Manager is the relay's side of binding sharing. Its methods are safe
// for concurrent use.
type Manager struct {
	cfg   Config
	log   zerolog.Logger
	host  host.Host
	hs    *transport.Handshake // the sessions protocol's framing and handshake
	table *scheduler.BindingTable
	any   atomic.Bool // a peer has been authenticated: installs are worth a lookup
	// awaitEnds (Unix ns) ends the time after the start in which requests
	// may wait for peers' tables.
	awaitEnds atomic.Int64
	// snapshotDelay (ns) holds back every table sent (tests only).
	snapshotDelay atomic.Int64
	// boot names this process in the hellos it sends, so that a peer
	// tells a restart from a second connection.
	boot [8]byte

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex // guards the following fields
	links   map[peer.ID]*link
	started bool // links learned before start wait for it
	closed  bool // stop was called: no new goroutines

	sent, recv, bytesSent, bytesRecv, bound, refused, resyncs, spentRecv atomic.Uint64
}

// link is one peer relay and the updates queued for it.
type link struct {
	id     peer.ID
	seed   atomic.Bool // configured (Settings.Relays): never forgotten, shares spending
	authed atomic.Bool // proved the secret (in either direction): admitted to gossip
	up     atomic.Bool // our stream to it is authenticated
	wake   chan struct{}
	kick   chan struct{} // ends a reconnect pause: the peer just reached us
	// learned is when the link was made; synced is closed once the peer
	// sent us its whole table (a snapshot ends with an empty frame).
	learned  time.Time
	synced   chan struct{}
	syncOnce sync.Once

	mu       sync.Mutex // guards the following fields
	addrs    []ma.Multiaddr
	conn     network.Conn // the connection our stream to the peer runs on, nil when down
	resynced time.Time    // when a restart of the peer last closed conn
	peerBoot []byte       // the boot ID in the peer's last hello
	pending  map[string]scheduler.Binding
	overflow bool // pending was dropped: send a snapshot
}

// New builds a Manager from cfg; Start starts it.
func New(cfg Config) *Manager {
	cfg.Settings = cfg.Settings.populate()
	pm := &Manager{
		cfg:  cfg,
		log:  cfg.Logger,
		host: cfg.Host,
		hs: &transport.Handshake{
			Framing: transport.Framing{Version: peerVersion, MaxFrame: maxPeerFrame},
			Secret:  cfg.Secret, Label: peerProofLabel, Mutual: true,
		},
		table: scheduler.NewBindingTable(cfg.SessionTTL, cfg.MaxSessions),
		links: make(map[peer.ID]*link),
	}
	pm.ctx, pm.cancel = context.WithCancel(context.Background())
	_, _ = crand.Read(pm.boot[:])
	return pm
}

// Start registers the protocol handlers and dials the configured peers.
func (pm *Manager) Start() {
	// The configured peers first, so that a link an agent named before
	// the start is a seed by the time its first session begins.
	for _, ai := range pm.cfg.Relays {
		pm.learn(ai.ID, ai.Addrs, true)
	}
	pm.mu.Lock()
	pm.started = true
	pm.awaitEnds.Store(time.Now().Add(pm.cfg.AwaitWindow).UnixNano())
	for _, l := range pm.links {
		pm.wg.Add(1)
		go pm.run(l)
	}
	pm.mu.Unlock()
	pm.host.SetStreamHandler(transport.SessionsProtocol, pm.handle)
	pm.host.SetStreamHandler(transport.SessionsProtocolV2, pm.handle)
}

// Stop removes the handlers and ends every link; Wait waits for them.
func (pm *Manager) Stop() {
	pm.host.RemoveStreamHandler(transport.SessionsProtocol)
	pm.host.RemoveStreamHandler(transport.SessionsProtocolV2)
	pm.mu.Lock()
	pm.closed = true
	pm.mu.Unlock()
	pm.cancel()
}

// Wait waits for the goroutines of the links (and of gossip joins) that
// Stop ended.
func (pm *Manager) Wait() { pm.wg.Wait() }

// SetSnapshotDelay holds back every table sent to a peer by d, so that a
// test sees what a slow table costs. Tests only.
func (pm *Manager) SetSnapshotDelay(d time.Duration) { pm.snapshotDelay.Store(int64(d)) }

// Hint learns peer relays from an agent's join info (multiaddrs with
// /p2p/<ID>); our own address and bad ones are skipped.
func (pm *Manager) Hint(addrs []string) {
	for _, s := range addrs {
		ai, err := peer.AddrInfoFromString(s)
		if err != nil || ai.ID == pm.host.ID() {
			continue
		}
		pm.learn(ai.ID, ai.Addrs, false)
	}
}

// learn adds (or completes) a peer relay and starts its link.
func (pm *Manager) learn(id peer.ID, addrs []ma.Multiaddr, seed bool) *link {
	if id == pm.host.ID() {
		return nil
	}
	pm.mu.Lock()
	defer pm.mu.Unlock()
	if pm.closed {
		return nil
	}
	l := pm.links[id]
	if l != nil {
		if seed {
			l.seed.Store(true) // learned from an agent first, configured too
		}
		l.mu.Lock()
		for _, a := range addrs {
			if len(l.addrs) < 16 && !slices.ContainsFunc(l.addrs, a.Equal) {
				l.addrs = append(l.addrs, a)
			}
		}
		l.mu.Unlock()
		return l
	}
	if len(pm.links) >= maxPeerLinks {
		return nil
	}
	l = &link{id: id, addrs: addrs, wake: make(chan struct{}, 1), kick: make(chan struct{}, 1),
		learned: time.Now(), synced: make(chan struct{}), pending: make(map[string]scheduler.Binding)}
	l.seed.Store(seed)
	pm.links[id] = l
	pm.log.Info().Stringer("peer_relay", id).Bool("configured", seed).Msg("peer relay learned")
	if pm.started {
		pm.wg.Add(1)
		go pm.run(l)
	}
	return l
}

// Known reports whether p is a peer relay we know (not disconnected by the
// admission sweep).
func (pm *Manager) Known(p peer.ID) bool {
	pm.mu.Lock()
	defer pm.mu.Unlock()
	_, ok := pm.links[p]
	return ok
}

// Admitted reports whether p is a peer relay that proved the secret (gossip
// admission).
func (pm *Manager) Admitted(p peer.ID) bool {
	pm.mu.Lock()
	l := pm.links[p]
	pm.mu.Unlock()
	return l != nil && l.authed.Load()
}

// Share records a local success of session key on agent ep and queues the
// binding for every peer when it is news.
func (pm *Manager) Share(key, ep string) {
	if key == "" || len(key) > maxPeerKey || len(ep) > maxPeerEndpoint {
		return
	}
	b, share := pm.table.Local(key, ep, pm.cfg.Clock.Now())
	if !share {
		return
	}
	pm.mu.Lock()
	for _, l := range pm.links {
		l.queue(b, pm.cfg.MaxPending)
	}
	pm.mu.Unlock()
}

// Install binds session key in the scheduler as the peers agreed, before
// its request is scheduled. A relay that has just started may not hold
// the binding yet: then Install waits (until ctx ends, at most
// peerSyncWait after a peer was learned) for the tables of the peer
// relays it has learned and not heard in full from.
func (pm *Manager) Install(ctx context.Context, key string) {
	if key == "" || pm.bind(key) || !pm.await(ctx) {
		return
	}
	pm.bind(key)
}

// bind installs the agreed binding of session key in the scheduler and
// reports whether there was one.
func (pm *Manager) bind(key string) bool {
	if !pm.any.Load() {
		return false
	}
	b, ok := pm.table.Lookup(key, pm.cfg.Clock.Now())
	if ok {
		pm.cfg.Bind(key, b.Endpoint, time.Unix(0, b.Last))
	}
	return ok
}

// unsynced returns, in the first AwaitWindow after the start, the links
// whose peer has not sent its whole table yet and was learned less than
// peerSyncWait ago, and when the last of those waits ends.
func (pm *Manager) unsynced() (links []*link, until time.Time) {
	if time.Now().UnixNano() >= pm.awaitEnds.Load() {
		return nil, time.Time{}
	}
	pm.mu.Lock()
	defer pm.mu.Unlock()
	for _, l := range pm.links {
		end := l.learned.Add(cmp.Or(pm.cfg.SyncWait, peerSyncWait))
		if !l.isSynced() && time.Now().Before(end) {
			links = append(links, l)
			if end.After(until) {
				until = end
			}
		}
	}
	return links, until
}

// Pending reports whether a request of session, which has no binding
// yet, should wait for a peer relay's table before it is placed (a relay
// that has just started; see Install).
func (pm *Manager) Pending(session string) bool {
	if session == "" || time.Now().UnixNano() >= pm.awaitEnds.Load() {
		return false
	}
	// Bound now, for a request that waited for its agent to rejoin.
	if pm.bind(session) {
		return false
	}
	links, _ := pm.unsynced()
	return len(links) > 0
}

// await waits for the tables of the unsynced links and reports whether it
// waited at all.
func (pm *Manager) await(ctx context.Context) bool {
	links, until := pm.unsynced()
	if len(links) == 0 {
		return false
	}
	timer := time.NewTimer(time.Until(until))
	defer timer.Stop()
	for _, l := range links {
		select {
		case <-l.synced:
		case <-timer.C:
			return true
		case <-ctx.Done():
			return true
		}
	}
	return true
}

func (l *link) isSynced() bool {
	select {
	case <-l.synced:
		return true
	default:
		return false
	}
}

func (l *link) queue(b scheduler.Binding, limit int) {
	l.mu.Lock()
	if !l.overflow {
		if _, ok := l.pending[b.Key]; !ok && len(l.pending) >= limit {
			// The peer is far behind: drop the queue and resend the table.
			clear(l.pending)
			l.overflow = true
		} else {
			l.pending[b.Key] = b
		}
	}
	l.mu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// take returns the queued updates, or snapshot = true when the peer must
// be sent the whole table instead.
func (l *link) take() (batch []scheduler.Binding, snapshot bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.overflow {
		l.overflow = false
		clear(l.pending)
		return nil, true
	}
	batch = make([]scheduler.Binding, 0, len(l.pending))
	for _, b := range l.pending {
		batch = append(batch, b)
	}
	clear(l.pending)
	return batch, false
}

// run keeps an authenticated stream to l, reconnecting with backoff, until
// the relay closes or l is forgotten.
func (pm *Manager) run(l *link) {
	defer pm.wg.Done()
	backoff, lastUp := 250*time.Millisecond, time.Now()
	for {
		err := pm.session(l)
		if l.up.Swap(false) {
			lastUp = time.Now()
			backoff = 250 * time.Millisecond
		}
		if pm.ctx.Err() != nil {
			return
		}
		if !l.seed.Load() && time.Since(lastUp) > pm.cfg.Forget {
			pm.mu.Lock()
			delete(pm.links, l.id)
			pm.mu.Unlock()
			pm.log.Info().Stringer("peer_relay", l.id).Msg("peer relay unreachable for long; forgotten until an agent names it again")
			return
		}
		pm.log.Debug().Err(err).Stringer("peer_relay", l.id).Dur("retry_in", backoff).Msg("peer relay stream ended")
		select {
		case <-pm.ctx.Done():
			return
		case <-l.kick:
			// The peer (restarted) reached us: it needs our bindings now.
			backoff = 250 * time.Millisecond
			continue
		case <-time.After(backoff/2 + rand.N(backoff/2+1)):
		}
		backoff = min(2*backoff, 30*time.Second)
	}
}

// session connects to l, authenticates, sends the live bindings and then
// batches until an error.
func (pm *Manager) session(l *link) error {
	h := pm.host
	l.mu.Lock()
	ai := peer.AddrInfo{ID: l.id, Addrs: append([]ma.Multiaddr(nil), l.addrs...)}
	l.mu.Unlock()
	cctx, cancel := context.WithTimeout(pm.ctx, peerIOTimeout)
	defer cancel()
	if len(ai.Addrs) > 0 {
		h.Peerstore().AddAddrs(ai.ID, ai.Addrs, peerstore.TempAddrTTL)
	}
	if err := h.Connect(network.WithForceDirectDial(cctx, "computeflux peer relay"), ai); err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	s, err := h.NewStream(cctx, l.id, transport.SessionsProtocol, transport.SessionsProtocolV2)
	if err != nil {
		return fmt.Errorf("open stream: %w", err)
	}
	l.mu.Lock()
	l.conn = s.Conn()
	l.mu.Unlock()
	gone := make(chan struct{})
	defer func() {
		_ = s.Reset()
		<-gone
		l.mu.Lock()
		l.conn = nil
		l.mu.Unlock()
	}()
	cw := &countingWriter{w: s, n: &pm.bytesSent}
	cr := bufio.NewReader(&countingReader{r: s, n: &pm.bytesRecv})
	_ = s.SetDeadline(time.Now().Add(peerIOTimeout))
	if err := pm.hs.Initiate(cr, cw, h.ID(), l.id, pm.boot[:]); err != nil {
		close(gone)
		if errors.Is(err, transport.ErrBadProof) {
			return errors.New("handshake: the peer relay does not hold our join secret")
		}
		return fmt.Errorf("handshake: %w", err)
	}
	_ = s.SetDeadline(time.Time{})
	// The peer sends nothing more: a read returns when the stream or its
	// connection dies, which an idle writer would otherwise notice only at
	// its next write.
	go func() {
		defer close(gone)
		_, _ = io.Copy(io.Discard, cr)
	}()
	l.authed.Store(true)
	l.up.Store(true)
	pm.any.Store(true)
	pm.log.Info().Stringer("peer_relay", l.id).Msg("sharing sessions with peer relay")
	pm.joinGossip(l.id)
	// Everything queued before now is in the snapshot.
	l.take()
	bw := bufio.NewWriterSize(cw, peerBatchBytes+4096)
	if err := pm.sendSnapshot(s, bw); err != nil {
		return err
	}
	// Spending goes only to the peers the operator named (Relays): a
	// relay learned from an agent's join info proved only the join
	// secret, which every contributor holds.
	var spentTick <-chan time.Time
	var spent spentSender
	if l.seed.Load() && pm.cfg.Ledger != nil && s.Protocol() == transport.SessionsProtocol {
		t := time.NewTicker(pm.cfg.SpentInterval)
		defer t.Stop()
		spentTick = t.C
		if err := spent.send(pm, s, bw); err != nil {
			return err
		}
	}
	for {
		select {
		case <-pm.ctx.Done():
			_ = s.Close()
			return nil
		case <-gone:
			return errors.New("stream closed by the peer")
		case <-spentTick:
			if err := spent.send(pm, s, bw); err != nil {
				return err
			}
			continue
		case <-l.wake:
		}
		// Let a burst gather into one frame.
		select {
		case <-pm.ctx.Done():
		case <-time.After(pm.cfg.FlushInterval):
		}
		batch, snapshot := l.take()
		var err error
		if snapshot {
			err = pm.sendSnapshot(s, bw)
		} else {
			err = pm.send(s, bw, batch)
		}
		if err != nil {
			return err
		}
	}
}

// joinGossip joins the peer's gossip in the background so that relays and
// agents form one cluster.
func (pm *Manager) joinGossip(p peer.ID) {
	join := pm.cfg.JoinGossip
	if join == nil {
		return
	}
	pm.mu.Lock()
	defer pm.mu.Unlock()
	if pm.closed {
		return
	}
	pm.wg.Add(1)
	go func() {
		defer pm.wg.Done()
		if err := join(p); err != nil && pm.ctx.Err() == nil {
			pm.log.Debug().Err(err).Stringer("peer_relay", p).Msg("joining a peer relay's gossip")
		}
	}()
}

// send writes bindings in frames of about peerBatchBytes and flushes.
func (pm *Manager) send(s network.Stream, bw *bufio.Writer, bs []scheduler.Binding) error {
	for len(bs) > 0 {
		body, n := encodeBindings(bs, peerBatchBytes)
		_ = s.SetWriteDeadline(time.Now().Add(peerIOTimeout))
		if err := pm.hs.WriteFrame(bw, msgPeerBindings, body); err != nil {
			return err
		}
		pm.sent.Add(uint64(n))
		bs = bs[n:]
	}
	_ = s.SetWriteDeadline(time.Now().Add(peerIOTimeout))
	return bw.Flush()
}

// sendSnapshot sends every live binding, then an empty frame: the end of
// the table, which a peer that has just started waits for.
func (pm *Manager) sendSnapshot(s network.Stream, bw *bufio.Writer) error {
	if d := time.Duration(pm.snapshotDelay.Load()); d > 0 {
		select {
		case <-time.After(d):
		case <-pm.ctx.Done():
			return pm.ctx.Err()
		}
	}
	if err := pm.send(s, bw, pm.table.Live(pm.cfg.Clock.Now(), 0)); err != nil {
		return err
	}
	body, _ := encodeBindings(nil, peerBatchBytes)
	_ = s.SetWriteDeadline(time.Now().Add(peerIOTimeout))
	if err := pm.hs.WriteFrame(bw, msgPeerBindings, body); err != nil {
		return err
	}
	return bw.Flush()
}

// spentSender sends a relay's spending report to one peer: every client
// with a budget that spent anything this month, resent only when it
// changed.
type spentSender struct {
	buf  []ledger.ClientSpent
	last []byte
}

func (ss *spentSender) send(pm *Manager, s network.Stream, bw *bufio.Writer) error {
	all := pm.cfg.Ledger.AppendSpent(ss.buf[:0], pm.cfg.Clock.Now())
	keep := all[:0]
	for _, cs := range all {
		if pm.budgeted(cs.Client) && len(cs.Client) <= maxPeerClient {
			keep = append(keep, cs)
		}
	}
	ss.buf = all
	// Sorted, so that an unchanged report encodes the same.
	slices.SortFunc(keep, func(a, b ledger.ClientSpent) int { return strings.Compare(a.Client, b.Client) })
	var frames [][]byte
	for rest := keep; len(rest) > 0 || len(frames) == 0; {
		body, n := encodeSpent(rest, peerBatchBytes)
		frames = append(frames, body)
		rest = rest[n:]
	}
	whole := slices.Concat(frames...)
	if bytes.Equal(whole, ss.last) {
		return nil
	}
	ss.last = whole
	for _, body := range frames {
		_ = s.SetWriteDeadline(time.Now().Add(peerIOTimeout))
		if err := pm.hs.WriteFrame(bw, msgPeerSpent, body); err != nil {
			return err
		}
	}
	_ = s.SetWriteDeadline(time.Now().Add(peerIOTimeout))
	return bw.Flush()
}

// recvSpent applies a peer's spending report, if the peer is one the
// operator named (a learned peer could lie about any client's use) and
// only for the clients with a budget here.
func (pm *Manager) recvSpent(l *link, body []byte) error {
	spent, err := decodeSpent(body)
	if err != nil {
		return err
	}
	led := pm.cfg.Ledger
	if led == nil || !l.seed.Load() {
		return nil
	}
	keep := spent[:0]
	for _, cs := range spent {
		if pm.budgeted(cs.Client) {
			keep = append(keep, cs)
		}
	}
	led.MergePeer(l.id.String(), keep)
	pm.spentRecv.Add(uint64(len(keep)))
	return nil
}

// handle serves a peer relay's inbound stream: authenticate, then apply its
// bindings until the stream ends.
func (pm *Manager) handle(s network.Stream) {
	defer s.Reset()
	p := s.Conn().RemotePeer()
	cw := &countingWriter{w: s, n: &pm.bytesSent}
	cr := bufio.NewReader(&countingReader{r: s, n: &pm.bytesRecv})
	_ = s.SetDeadline(time.Now().Add(peerIOTimeout))
	self := pm.host.ID()
	hello, err := pm.hs.Accept(cr, cw, self, p)
	if err == nil {
		err = pm.hs.Welcome(cw, hello, self, p)
	} else if errors.Is(err, transport.ErrBadProof) {
		_ = pm.hs.Reject(cw, "invalid peer relay proof (another join secret?)")
	}
	if err != nil {
		pm.refused.Add(1)
		pm.log.Warn().Err(err).Stringer("peer", p).Msg("peer relay refused")
		return
	}
	_ = s.SetDeadline(time.Time{})
	// A relay that proved the secret is a peer: make sure our bindings
	// flow to it as well (over the connection it opened).
	l := pm.learn(p, []ma.Multiaddr{s.Conn().RemoteMultiaddr()}, false)
	if l == nil {
		return
	}
	l.authed.Store(true)
	pm.any.Store(true)
	// The peer names its process in its hello (a random boot ID). A new
	// one means it restarted: it holds none of what we sent, and a
	// SIGKILLed process sends no close, so our stream to it may look alive
	// for the whole QUIC idle timeout. Close that connection and send
	// every binding again on a fresh stream, at once. At most once a
	// second: a peer restarting in a loop does not make us resend the
	// table in one. (Two live connections, from relays dialing each other
	// at once, keep one boot ID and are left alone.)
	l.mu.Lock()
	restarted := len(hello.Payload) == len(pm.boot) && l.peerBoot != nil && !bytes.Equal(l.peerBoot, hello.Payload)
	if len(hello.Payload) == len(pm.boot) {
		l.peerBoot = bytes.Clone(hello.Payload)
	}
	stale := l.conn
	if !restarted || stale == s.Conn() || time.Since(l.resynced) < time.Second {
		stale = nil
	} else if stale != nil {
		l.resynced = time.Now()
	}
	l.mu.Unlock()
	if stale != nil {
		pm.resyncs.Add(1)
		pm.log.Info().Stringer("peer_relay", p).Msg("peer relay reconnected on a new connection; resending bindings")
		_ = stale.Close()
	}
	select {
	case l.kick <- struct{}{}:
	default:
	}
	for {
		typ, body, err := pm.hs.ReadFrame(cr)
		if err != nil {
			return
		}
		if typ == msgPeerSpent && s.Protocol() == transport.SessionsProtocol {
			if err := pm.recvSpent(l, body); err != nil {
				pm.log.Warn().Err(err).Stringer("peer_relay", p).Msg("bad spending frame")
				return
			}
			continue
		}
		if typ != msgPeerBindings {
			return
		}
		bs, err := decodeBindings(body)
		if err != nil {
			pm.log.Warn().Err(err).Stringer("peer_relay", p).Msg("bad bindings frame")
			return
		}
		pm.recv.Add(uint64(len(bs)))
		now := pm.cfg.Clock.Now()
		for _, b := range bs {
			if pm.table.Merge(b, now) && pm.cfg.Bind(b.Key, b.Endpoint, time.Unix(0, b.Last)) {
				pm.bound.Add(1)
			}
		}
		if len(bs) == 0 {
			// The end of the peer's table: requests waiting for it go on.
			l.syncOnce.Do(func() { close(l.synced) })
			if pm.cfg.Synced != nil {
				pm.cfg.Synced()
			}
		}
	}
}

// Stats returns the counters.
func (pm *Manager) Stats() Stats {
	st := Stats{
		BindingsSent: pm.sent.Load(), BindingsReceived: pm.recv.Load(),
		BytesSent: pm.bytesSent.Load(), BytesReceived: pm.bytesRecv.Load(),
		Bound: pm.bound.Load(), Sessions: pm.table.Len(), Refused: pm.refused.Load(), Resyncs: pm.resyncs.Load(),
		SpentReceived: pm.spentRecv.Load(),
	}
	pm.mu.Lock()
	for _, l := range pm.links {
		if l.up.Load() {
			st.Peers++
		}
	}
	pm.mu.Unlock()
	return st
}

// Up returns the peer relays with an authenticated stream out.
func (pm *Manager) Up() []peer.ID {
	pm.mu.Lock()
	defer pm.mu.Unlock()
	var out []peer.ID
	for id, l := range pm.links {
		if l.up.Load() {
			out = append(out, id)
		}
	}
	return out
}

// budgeted reports whether client has a budget here.
func (pm *Manager) budgeted(client string) bool {
	return pm.cfg.Budgeted != nil && pm.cfg.Budgeted(client)
}
