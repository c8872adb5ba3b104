package relay

// Peer relays: several relays serve one fleet and share session bindings.
//
// Relays learn each other from the agents that joined them (every agent's
// join info lists all its relays) and from PeersConfig.Relays. A relay
// keeps one outbound transport.SessionsProtocol stream to every peer relay it knows:
// both sides prove the join secret (transport.Handshake, mutual), then the
// dialer sends the bindings it holds and, from then
// on, batches of binding updates (every local new binding or move, and a
// refresh of a busy session every TTL/10). Its peer does the same the other
// way, so each stream carries one direction. A peer relay, once it has
// proved the secret, is admitted to gossip and joined, so that relays and
// agents form one memberlist cluster: a hard failure one relay sees (an
// agent dead or gone) reaches the others. Breakers and latency averages
// stay per relay: they measure the relay's own path.
//
// Received bindings go through scheduler.BindingTable (the order that makes
// every relay agree; see there) and, when they win, into the scheduler with
// Bind. A binding to an agent this relay does not know yet (an agent that
// has not rejoined after a restart) stays in the table and is installed
// when a request of the session arrives (installBinding).
//
// With a ledger, a relay also sends the peers the operator named
// (PeersConfig.Relays, and only those: a learned peer proved nothing but
// the join secret) what each client with a budget spent through it today
// and this month, every SpentInterval when it changed (encodeSpent), and
// checks budgets against its own count plus its peers' last reports.
//
// Frames are transport.Framing's (at most maxPeerFrame). The handshake is
// transport.Handshake's, mutual, the reader accepting and the dialer
// initiating with no payload; then bindings frames (encodeBindings; a
// table ends with an empty one) and spending frames (transport.SessionsProtocol
// only, not transport.SessionsProtocolV2), dialer -> reader only.

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/peerstore"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Defaults for the zero values of PeersConfig.
const (
	DefaultPeerFlushInterval = 10 * time.Millisecond // batching delay of binding updates
	DefaultPeerMaxPending    = 1 << 16               // updates queued per peer before a resync
	DefaultPeerForget        = 5 * time.Minute       // a learned peer unreachable this long is dropped
	DefaultPeerSpentInterval = time.Second           // how often budgeted clients' spending is sent
)

// PeersConfig configures how the relay shares session bindings with peer
// relays. The zero value shares them with the peers learned from agents.
type PeersConfig struct {
	// Disabled keeps the relay to itself: no bindings shared, agents'
	// relay lists ignored.
	Disabled bool
	// Relays are peer relays to connect to from the start (--peer-relay),
	// kept for as long as the relay runs. Empty means only those learned
	// from agents.
	Relays []peer.AddrInfo
	// FlushInterval is how long binding updates wait to be sent in one
	// batch. Zero means DefaultPeerFlushInterval (10 ms).
	FlushInterval time.Duration
	// MaxPending bounds the updates queued for one peer; past it the queue
	// is dropped and the peer is sent every live binding again. Zero means
	// DefaultPeerMaxPending.
	MaxPending int
	// Forget is how long a peer learned from agents may stay unreachable
	// before the relay stops dialing it. Zero means DefaultPeerForget.
	Forget time.Duration
	// SpentInterval is how often the relay tells its configured peers
	// (Relays) what its clients with a budget spent, so that a budget
	// holds across relays. Zero means DefaultPeerSpentInterval (1 s).
	SpentInterval time.Duration
}

func (c PeersConfig) populate() PeersConfig {
	if c.FlushInterval <= 0 {
		c.FlushInterval = DefaultPeerFlushInterval
	}
	if c.MaxPending <= 0 {
		c.MaxPending = DefaultPeerMaxPending
	}
	if c.Forget <= 0 {
		c.Forget = DefaultPeerForget
	}
	if c.SpentInterval <= 0 {
		c.SpentInterval = DefaultPeerSpentInterval
	}
	return c
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

// PeerStats counts the relay's binding traffic with peer relays.
type PeerStats struct {
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

// peerManager is the relay's side of binding sharing.
type peerManager struct {
	r     *Relay
	cfg   PeersConfig
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
	links   map[peer.ID]*peerLink
	started bool // links learned before start wait for it
	closed  bool // stop was called: no new goroutines

	sent, recv, bytesSent, bytesRecv, bound, refused, resyncs, spentRecv atomic.Uint64
}

// peerLink is one peer relay and the updates queued for it.
type peerLink struct {
	id     peer.ID
	seed   atomic.Bool // configured (PeersConfig.Relays): never forgotten, shares spending
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

func newPeerManager(r *Relay) *peerManager {
	sc := r.sched.Config()
	pm := &peerManager{
		r:   r,
		cfg: r.cfg.Peers.populate(),
		hs: &transport.Handshake{
			Framing: transport.Framing{Version: peerVersion, MaxFrame: maxPeerFrame},
			Secret:  r.cfg.Token, Label: peerProofLabel, Mutual: true,
		},
		table: scheduler.NewBindingTable(sc.SessionTTL, sc.MaxSessions),
		links: make(map[peer.ID]*peerLink),
	}
	pm.ctx, pm.cancel = context.WithCancel(context.Background())
	_, _ = crand.Read(pm.boot[:])
	return pm
}

// start registers the protocol handler and dials the configured peers.
func (pm *peerManager) start() {
	// The configured peers first, so that a link an agent named before
	// the start is a seed by the time its first session begins.
	for _, ai := range pm.cfg.Relays {
		pm.learn(ai.ID, ai.Addrs, true)
	}
	pm.mu.Lock()
	pm.started = true
	pm.awaitEnds.Store(time.Now().Add(restartWindow).UnixNano())
	for _, l := range pm.links {
		pm.wg.Add(1)
		go pm.run(l)
	}
	pm.mu.Unlock()
	pm.r.host.SetStreamHandler(transport.SessionsProtocol, pm.handle)
	pm.r.host.SetStreamHandler(transport.SessionsProtocolV2, pm.handle)
}

// stop removes the handler and ends every link; wait waits for them.
func (pm *peerManager) stop() {
	pm.r.host.RemoveStreamHandler(transport.SessionsProtocol)
	pm.r.host.RemoveStreamHandler(transport.SessionsProtocolV2)
	pm.mu.Lock()
	pm.closed = true
	pm.mu.Unlock()
	pm.cancel()
}

func (pm *peerManager) wait() { pm.wg.Wait() }

// hint learns peer relays from an agent's join info (multiaddrs with
// /p2p/<ID>); our own address and bad ones are skipped.
func (pm *peerManager) hint(addrs []string) {
	for _, s := range addrs {
		ai, err := peer.AddrInfoFromString(s)
		if err != nil || ai.ID == pm.r.host.ID() {
			continue
		}
		pm.learn(ai.ID, ai.Addrs, false)
	}
}

// learn adds (or completes) a peer relay and starts its link.
func (pm *peerManager) learn(id peer.ID, addrs []ma.Multiaddr, seed bool) *peerLink {
	if id == pm.r.host.ID() {
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
	l = &peerLink{id: id, addrs: addrs, wake: make(chan struct{}, 1), kick: make(chan struct{}, 1),
		learned: time.Now(), synced: make(chan struct{}), pending: make(map[string]scheduler.Binding)}
	l.seed.Store(seed)
	pm.links[id] = l
	pm.r.log.Info().Stringer("peer_relay", id).Bool("configured", seed).Msg("peer relay learned")
	if pm.started {
		pm.wg.Add(1)
		go pm.run(l)
	}
	return l
}

// known reports whether p is a peer relay we know (not disconnected by the
// admission sweep).
func (pm *peerManager) known(p peer.ID) bool {
	pm.mu.Lock()
	defer pm.mu.Unlock()
	_, ok := pm.links[p]
	return ok
}

// admitted reports whether p is a peer relay that proved the secret (gossip
// admission).
func (pm *peerManager) admitted(p peer.ID) bool {
	pm.mu.Lock()
	l := pm.links[p]
	pm.mu.Unlock()
	return l != nil && l.authed.Load()
}

// local records a local success of session key on agent ep and queues the
// binding for every peer when it is news.
func (pm *peerManager) local(key, ep string) {
	if key == "" || len(key) > maxPeerKey || len(ep) > maxPeerEndpoint {
		return
	}
	b, share := pm.table.Local(key, ep, pm.r.cfg.Clock.Now())
	if !share {
		return
	}
	pm.mu.Lock()
	for _, l := range pm.links {
		l.queue(b, pm.cfg.MaxPending)
	}
	pm.mu.Unlock()
}

// install binds session key in the scheduler as the peers agreed, before
// its request is scheduled. A relay that has just started may not hold
// the binding yet: then install waits (until ctx ends, at most
// peerSyncWait after a peer was learned) for the tables of the peer
// relays it has learned and not heard in full from.
func (pm *peerManager) install(ctx context.Context, key string) {
	if key == "" || pm.bind(key) || !pm.await(ctx) {
		return
	}
	pm.bind(key)
}

// bind installs the agreed binding of session key in the scheduler and
// reports whether there was one.
func (pm *peerManager) bind(key string) bool {
	if !pm.any.Load() {
		return false
	}
	b, ok := pm.table.Lookup(key, pm.r.cfg.Clock.Now())
	if ok {
		pm.r.sched.Bind(key, b.Endpoint, time.Unix(0, b.Last))
	}
	return ok
}

// unsynced returns, in the first restartWindow after the start, the links
// whose peer has not sent its whole table yet and was learned less than
// peerSyncWait ago, and when the last of those waits ends.
func (pm *peerManager) unsynced() (links []*peerLink, until time.Time) {
	if time.Now().UnixNano() >= pm.awaitEnds.Load() {
		return nil, time.Time{}
	}
	pm.mu.Lock()
	defer pm.mu.Unlock()
	for _, l := range pm.links {
		end := l.learned.Add(cmp.Or(pm.r.cfg.peerSyncWait, peerSyncWait))
		if !l.isSynced() && time.Now().Before(end) {
			links = append(links, l)
			if end.After(until) {
				until = end
			}
		}
	}
	return links, until
}

// pending reports whether a request of a session with no binding should
// wait for a peer's table before it is placed.
func (pm *peerManager) pending() bool {
	links, _ := pm.unsynced()
	return len(links) > 0
}

// await waits for the tables of the unsynced links and reports whether it
// waited at all.
func (pm *peerManager) await(ctx context.Context) bool {
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

func (l *peerLink) isSynced() bool {
	select {
	case <-l.synced:
		return true
	default:
		return false
	}
}

func (l *peerLink) queue(b scheduler.Binding, limit int) {
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
func (l *peerLink) take() (batch []scheduler.Binding, snapshot bool) {
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
func (pm *peerManager) run(l *peerLink) {
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
			pm.r.log.Info().Stringer("peer_relay", l.id).Msg("peer relay unreachable for long; forgotten until an agent names it again")
			return
		}
		pm.r.log.Debug().Err(err).Stringer("peer_relay", l.id).Dur("retry_in", backoff).Msg("peer relay stream ended")
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
func (pm *peerManager) session(l *peerLink) error {
	h := pm.r.host
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
	pm.r.log.Info().Stringer("peer_relay", l.id).Msg("sharing sessions with peer relay")
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
	if l.seed.Load() && pm.r.cfg.Ledger != nil && s.Protocol() == transport.SessionsProtocol {
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
func (pm *peerManager) joinGossip(p peer.ID) {
	rg := pm.r.gossip
	if rg == nil {
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
		if _, err := rg.g.Join(p); err != nil && pm.ctx.Err() == nil {
			pm.r.log.Debug().Err(err).Stringer("peer_relay", p).Msg("joining a peer relay's gossip")
		}
	}()
}

// send writes bindings in frames of about peerBatchBytes and flushes.
func (pm *peerManager) send(s network.Stream, bw *bufio.Writer, bs []scheduler.Binding) error {
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
func (pm *peerManager) sendSnapshot(s network.Stream, bw *bufio.Writer) error {
	if d := time.Duration(pm.snapshotDelay.Load()); d > 0 {
		select {
		case <-time.After(d):
		case <-pm.ctx.Done():
			return pm.ctx.Err()
		}
	}
	if err := pm.send(s, bw, pm.table.Live(pm.r.cfg.Clock.Now(), 0)); err != nil {
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

func (ss *spentSender) send(pm *peerManager, s network.Stream, bw *bufio.Writer) error {
	all := pm.r.cfg.Ledger.AppendSpent(ss.buf[:0], pm.r.cfg.Clock.Now())
	keep := all[:0]
	for _, cs := range all {
		if c := pm.r.clients.byName(cs.Client); c != nil && !c.Budget.Unlimited() && len(cs.Client) <= maxPeerClient {
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
func (pm *peerManager) recvSpent(l *peerLink, body []byte) error {
	spent, err := decodeSpent(body)
	if err != nil {
		return err
	}
	led := pm.r.cfg.Ledger
	if led == nil || !l.seed.Load() {
		return nil
	}
	keep := spent[:0]
	for _, cs := range spent {
		if c := pm.r.clients.byName(cs.Client); c != nil && !c.Budget.Unlimited() {
			keep = append(keep, cs)
		}
	}
	led.MergePeer(l.id.String(), keep)
	pm.spentRecv.Add(uint64(len(keep)))
	return nil
}

// handle serves a peer relay's inbound stream: authenticate, then apply its
// bindings until the stream ends.
func (pm *peerManager) handle(s network.Stream) {
	defer s.Reset()
	p := s.Conn().RemotePeer()
	cw := &countingWriter{w: s, n: &pm.bytesSent}
	cr := bufio.NewReader(&countingReader{r: s, n: &pm.bytesRecv})
	_ = s.SetDeadline(time.Now().Add(peerIOTimeout))
	self := pm.r.host.ID()
	hello, err := pm.hs.Accept(cr, cw, self, p)
	if err == nil {
		err = pm.hs.Welcome(cw, hello, self, p)
	} else if errors.Is(err, transport.ErrBadProof) {
		_ = pm.hs.Reject(cw, "invalid peer relay proof (another join secret?)")
	}
	if err != nil {
		pm.refused.Add(1)
		pm.r.log.Warn().Err(err).Stringer("peer", p).Msg("peer relay refused")
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
		pm.r.log.Info().Stringer("peer_relay", p).Msg("peer relay reconnected on a new connection; resending bindings")
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
				pm.r.log.Warn().Err(err).Stringer("peer_relay", p).Msg("bad spending frame")
				return
			}
			continue
		}
		if typ != msgPeerBindings {
			return
		}
		bs, err := decodeBindings(body)
		if err != nil {
			pm.r.log.Warn().Err(err).Stringer("peer_relay", p).Msg("bad bindings frame")
			return
		}
		pm.recv.Add(uint64(len(bs)))
		now := pm.r.cfg.Clock.Now()
		for _, b := range bs {
			if pm.table.Merge(b, now) && pm.r.sched.Bind(b.Key, b.Endpoint, time.Unix(0, b.Last)) {
				pm.bound.Add(1)
			}
		}
		if len(bs) == 0 {
			// The end of the peer's table: requests waiting for it go on.
			l.syncOnce.Do(func() { close(l.synced) })
			pm.r.queue.wake()
		}
	}
}

// stats returns the counters.
func (pm *peerManager) stats() PeerStats {
	st := PeerStats{
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

// PeerStats returns the binding traffic with peer relays (zero when
// sharing is off).
func (r *Relay) PeerStats() PeerStats {
	if r.peers == nil {
		return PeerStats{}
	}
	return r.peers.stats()
}

// PeerRelays returns the peer relays with an authenticated stream out.
func (r *Relay) PeerRelays() []peer.ID {
	if r.peers == nil {
		return nil
	}
	r.peers.mu.Lock()
	defer r.peers.mu.Unlock()
	var out []peer.ID
	for id, l := range r.peers.links {
		if l.up.Load() {
			out = append(out, id)
		}
	}
	return out
}

// encodeBindings encodes the longest prefix of bs that fits about limit
// bytes (at least one binding) and returns it with the number encoded:
//
//	count uvarint, then per binding: key (uvarint length, bytes),
//	endpoint (uvarint length, bytes), gen uvarint, since varint (Unix ns),
//	last - since uvarint
func encodeBindings(bs []scheduler.Binding, limit int) ([]byte, int) {
	n := 0
	size := 0
	for n < len(bs) && (n == 0 || size+len(bs[n].Key)+len(bs[n].Endpoint)+32 <= limit) {
		size += len(bs[n].Key) + len(bs[n].Endpoint) + 32
		n++
	}
	buf := make([]byte, 0, size+binary.MaxVarintLen64)
	buf = binary.AppendUvarint(buf, uint64(n))
	for _, b := range bs[:n] {
		buf = binary.AppendUvarint(buf, uint64(len(b.Key)))
		buf = append(buf, b.Key...)
		buf = binary.AppendUvarint(buf, uint64(len(b.Endpoint)))
		buf = append(buf, b.Endpoint...)
		buf = binary.AppendUvarint(buf, uint64(b.Gen))
		buf = binary.AppendVarint(buf, b.Since)
		buf = binary.AppendUvarint(buf, uint64(max(b.Last-b.Since, 0)))
	}
	return buf, n
}

// encodeSpent encodes a prefix of cs (at least one entry, when any) of
// about limit bytes as a spending frame's body, and returns how many it
// took: a count, then per client its name, day, month, day's and month's
// tokens and month's cost.
func encodeSpent(cs []ledger.ClientSpent, limit int) ([]byte, int) {
	n, size := 0, 0
	for n < len(cs) && (n == 0 || size+len(cs[n].Client)+48 <= limit) {
		size += len(cs[n].Client) + 48
		n++
	}
	buf := make([]byte, 0, size+binary.MaxVarintLen64)
	buf = binary.AppendUvarint(buf, uint64(n))
	for _, c := range cs[:n] {
		buf = binary.AppendUvarint(buf, uint64(len(c.Client)))
		buf = append(buf, c.Client...)
		buf = binary.AppendVarint(buf, c.Day)
		buf = binary.AppendVarint(buf, int64(c.Month))
		buf = binary.AppendUvarint(buf, uint64(max(c.DayTokens, 0)))
		buf = binary.AppendUvarint(buf, uint64(max(c.MonthTokens, 0)))
		buf = binary.AppendUvarint(buf, uint64(max(c.MonthCost, 0)))
	}
	return buf, n
}

// maxPeerSpent bounds each count in a spending report, so that sums of
// reports cannot overflow.
const maxPeerSpent = 1 << 50

// decodeSpent decodes encodeSpent's format, checking every bound.
func decodeSpent(buf []byte) ([]ledger.ClientSpent, error) {
	count, k := binary.Uvarint(buf)
	if k <= 0 || count > uint64(len(buf)) {
		return nil, errPeerFrame
	}
	buf = buf[k:]
	out := make([]ledger.ClientSpent, 0, count)
	for range count {
		n, k := binary.Uvarint(buf)
		if k <= 0 || n == 0 || n > maxPeerClient || n > uint64(len(buf)-k) {
			return nil, errPeerFrame
		}
		c := ledger.ClientSpent{Client: string(buf[k : k+int(n)])}
		buf = buf[k+int(n):]
		var vals [5]int64
		for i := range vals {
			var v int64
			if i < 2 {
				v, k = binary.Varint(buf)
			} else {
				var u uint64
				u, k = binary.Uvarint(buf)
				if u > maxPeerSpent {
					return nil, errPeerFrame
				}
				v = int64(u)
			}
			if k <= 0 || v < 0 || v > maxPeerSpent {
				return nil, errPeerFrame
			}
			vals[i] = v
			buf = buf[k:]
		}
		if vals[1] > 1<<31-1 {
			return nil, errPeerFrame
		}
		c.Day, c.Month = vals[0], int32(vals[1])
		c.DayTokens, c.MonthTokens, c.MonthCost = vals[2], vals[3], ledger.Money(vals[4])
		out = append(out, c)
	}
	if len(buf) != 0 {
		return nil, errPeerFrame
	}
	return out, nil
}

// decodeBindings decodes encodeBindings' format, checking every bound.
func decodeBindings(buf []byte) ([]scheduler.Binding, error) {
	count, k := binary.Uvarint(buf)
	if k <= 0 || count > uint64(len(buf)) {
		return nil, errPeerFrame
	}
	buf = buf[k:]
	str := func(limit int) (string, bool) {
		n, k := binary.Uvarint(buf)
		if k <= 0 || n == 0 || n > uint64(limit) || n > uint64(len(buf)-k) {
			return "", false
		}
		s := string(buf[k : k+int(n)])
		buf = buf[k+int(n):]
		return s, true
	}
	out := make([]scheduler.Binding, 0, count)
	for range count {
		var b scheduler.Binding
		var ok bool
		if b.Key, ok = str(maxPeerKey); !ok {
			return nil, errPeerFrame
		}
		if b.Endpoint, ok = str(maxPeerEndpoint); !ok {
			return nil, errPeerFrame
		}
		gen, k := binary.Uvarint(buf)
		if k <= 0 || gen == 0 || gen > 1<<32-1 {
			return nil, errPeerFrame
		}
		buf = buf[k:]
		since, k := binary.Varint(buf)
		if k <= 0 {
			return nil, errPeerFrame
		}
		buf = buf[k:]
		d, k := binary.Uvarint(buf)
		if k <= 0 || d > 1<<62 || since > 1<<62 || since < 0 {
			return nil, errPeerFrame
		}
		buf = buf[k:]
		b.Gen, b.Since, b.Last = uint32(gen), since, since+int64(d)
		out = append(out, b)
	}
	if len(buf) != 0 {
		return nil, errPeerFrame
	}
	return out, nil
}

type countingWriter struct {
	w io.Writer
	n *atomic.Uint64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n.Add(uint64(n))
	return n, err
}

type countingReader struct {
	r io.Reader
	n *atomic.Uint64
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n.Add(uint64(n))
	return n, err
}

// peerCollector exports the binding traffic at scrape time.
type peerCollector struct{ pm *peerManager }

var (
	descPeerRelays = prometheus.NewDesc("computeflux_peer_relays",
		"Peer relays this relay shares session bindings with.", nil, nil)
	descPeerBindings = prometheus.NewDesc("computeflux_peer_bindings_total",
		"Session binding updates exchanged with peer relays, by direction.", []string{"direction"}, nil)
	descPeerBytes = prometheus.NewDesc("computeflux_peer_bytes_total",
		"Bytes of the sessions protocol with peer relays, by direction.", []string{"direction"}, nil)
	descPeerSessions = prometheus.NewDesc("computeflux_peer_sessions",
		"Session bindings held in the shared binding table.", nil, nil)
	descPeerResyncs = prometheus.NewDesc("computeflux_peer_resyncs_total",
		"Peer relays that came back as a new process while our stream to them looked alive, and were sent every binding again.", nil, nil)
)

// Describe implements prometheus.Collector.
func (c peerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPeerRelays, descPeerBindings, descPeerBytes, descPeerSessions, descPeerResyncs} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c peerCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.pm.stats()
	ch <- prometheus.MustNewConstMetric(descPeerRelays, prometheus.GaugeValue, float64(st.Peers))
	ch <- prometheus.MustNewConstMetric(descPeerBindings, prometheus.CounterValue, float64(st.BindingsSent), "sent")
	ch <- prometheus.MustNewConstMetric(descPeerBindings, prometheus.CounterValue, float64(st.BindingsReceived), "received")
	ch <- prometheus.MustNewConstMetric(descPeerBytes, prometheus.CounterValue, float64(st.BytesSent), "sent")
	ch <- prometheus.MustNewConstMetric(descPeerBytes, prometheus.CounterValue, float64(st.BytesReceived), "received")
	ch <- prometheus.MustNewConstMetric(descPeerSessions, prometheus.GaugeValue, float64(st.Sessions))
	ch <- prometheus.MustNewConstMetric(descPeerResyncs, prometheus.CounterValue, float64(st.Resyncs))
}

// peerAdmitted reports whether p is a peer relay admitted to gossip.
func (r *Relay) peerAdmitted(p peer.ID) bool { return r.peers != nil && r.peers.admitted(p) }

// installBinding brings the session's binding agreed with the peer relays
// into the scheduler before the request is scheduled (a no-op without
// peers or a session key).
func (r *Relay) installBinding(ctx context.Context, session string) {
	if r.peers != nil {
		r.peers.install(ctx, session)
	}
}

// bindingPending reports whether a request of session, which has no
// binding yet, should wait for a peer relay's table (a relay that has
// just started; see peerManager.install).
func (r *Relay) bindingPending(session string) bool {
	if r.peers == nil || session == "" || time.Now().UnixNano() >= r.peers.awaitEnds.Load() {
		return false
	}
	// Bound now, for a request that waited for its agent to rejoin.
	return !r.peers.bind(session) && r.peers.pending()
}

// shareBinding records a success of session on agent ep for the peer
// relays.
func (r *Relay) shareBinding(session, ep string) {
	if r.peers != nil && session != "" {
		r.peers.local(session, ep)
	}
}

// warmUpQuiet is how long without a new agent join ends the warm-up.
const warmUpQuiet = 250 * time.Millisecond

// warmUp waits (up to cfg.WarmUp, or until ctx ends) until agents have
// rejoined: one routable, and none joining for warmUpQuiet.
func (r *Relay) warmUp(ctx context.Context) {
	if r.cfg.WarmUp <= 0 {
		return
	}
	start := time.Now()
	deadline := start.Add(r.cfg.WarmUp)
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	last, lastChange := -1, start
	for time.Now().Before(deadline) {
		n := r.reg.routable()
		if n != last {
			last, lastChange = n, time.Now()
		}
		if n > 0 && time.Since(lastChange) >= warmUpQuiet {
			break
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
	r.log.Info().Int("agents", last).Dur("took", time.Since(start)).Msg("warm-up over; accepting clients")
}
