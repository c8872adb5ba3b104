package transport

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/peerstore"
	"github.com/libp2p/go-libp2p/core/protocol"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"
)

// Limits of the packet side. A memberlist packet is at most its
// UDPBufferSize (1400 bytes in our presets); frames carry a 2-byte length.
const (
	gossipMaxPacket       = 65535
	gossipPacketQueue     = 64               // frames queued per peer before new ones are dropped
	gossipDialTimeout     = 10 * time.Second // opening a packet stream, dial included
	gossipWriteTimeout    = 5 * time.Second  // one frame write on an open stream
	gossipSenderIdle      = 2 * time.Minute  // a per-peer sender with nothing to send exits
	gossipDialFailBackoff = time.Second      // after a failed open, frames are dropped this long
)

// ErrGossipNotAdmitted is returned when memberlist addresses a peer that the
// Admit hook refuses.
var ErrGossipNotAdmitted = errors.New("transport: gossip peer not admitted")

// GossipTransportConfig configures NewGossipTransport.
type GossipTransportConfig struct {
	// Host carries the gossip. Required. The transport registers its stream
	// handlers on it and removes them on Shutdown; it never closes the host.
	Host host.Host
	// Admit says whether a peer may exchange gossip with us, in both
	// directions: streams from others are reset and counted, packets and
	// dials towards others fail. Required (fail closed): a nil Admit is an
	// error. It is called often and must be fast and safe for concurrent use.
	Admit func(peer.ID) bool
	// Resolve returns addresses for a peer we are not connected to (for
	// example /p2p/<relay>/p2p-circuit addresses); they are added to the
	// peerstore with a temporary TTL before dialing. Nil means the peerstore
	// alone.
	Resolve func(peer.ID) []ma.Multiaddr
	// Logger receives transport diagnostics. The zero value discards.
	Logger zerolog.Logger

	// streamPerPacket opens one short stream per packet instead of one
	// long-lived stream per peer (kept for the framing benchmark).
	streamPerPacket bool
	// observe sees every packet sent and every packet received after the
	// guard (Gossip uses it to surface suspicion, which memberlist does not
	// expose).
	observe func(b []byte)
	// guard, when set, filters what members say about each other (see
	// gossipGuard); onForged hears of a peer caught forging, whose packet
	// stream is then reset. Both are set by NewGossip.
	guard    *gossipGuard
	onForged func(p peer.ID, reason string)
}

// GossipStats are counters of a GossipTransport since it started.
type GossipStats struct {
	PacketsSent, PacketsReceived uint64
	// PacketsDropped counts packets lost to full queues, failed stream
	// opens or writes, and a full receive channel.
	PacketsDropped uint64
	// BytesSent and BytesReceived count memberlist payload bytes on
	// packets and streams (not libp2p framing).
	BytesSent, BytesReceived       uint64
	StreamsOpened, StreamsAccepted uint64
	// Rejected counts inbound gossip streams reset because the peer was not
	// admitted, plus outbound packets and dials refused for the same reason.
	Rejected uint64
	// Filtered counts received packets and push/pull exchanges from which
	// claims about other members were removed (see gossipGuard); Forged
	// counts those that proved their sender forges.
	Filtered, Forged uint64
}

type gossipCounters struct {
	packetsSent, packetsReceived, packetsDropped atomic.Uint64
	bytesSent, bytesReceived                     atomic.Uint64
	streamsOpened, streamsAccepted, rejected     atomic.Uint64
	filtered, forged                             atomic.Uint64
}

// GossipTransport is a memberlist.NodeAwareTransport over libp2p streams.
// Memberlist node names are peer IDs; the IP:port memberlist requires is
// derived from the peer ID (see GossipAddr) and is never dialed. Packets
// travel as length-prefixed frames on one long-lived GossipPacketProtocol
// stream per peer and direction, written by a per-peer goroutine behind a
// bounded queue, so memberlist never blocks on the network (a packet whose
// write finds the stream dead, reset by the peer or with its connection, is
// sent again once on a new stream, and a stream opened on a relay's circuit
// is replaced once a direct connection to its peer appears); streams are
// GossipStreamProtocol streams. Both run over limited (relayed) connections.
type GossipTransport struct {
	h        host.Host
	cfg      GossipTransportConfig
	log      zerolog.Logger
	self     peer.ID
	packetCh chan *memberlist.Packet
	streamCh chan net.Conn
	ctx      context.Context
	cancel   context.CancelFunc
	c        gossipCounters

	mu       sync.Mutex // guards the following fields
	closed   bool
	senders  map[peer.ID]*gossipSender
	byAddr   map[string]peer.ID // derived "ip:port" -> peer, for addresses without a name
	inbound  map[network.Stream]struct{}
	wg       sync.WaitGroup // senders and inbound handlers; Add only under mu while !closed
	shutdown sync.Once
	notifee  network.Notifiee // drops the senders of disconnected peers
}

var _ memberlist.NodeAwareTransport = (*GossipTransport)(nil)

// NewGossipTransport registers the gossip protocols on cfg.Host.
func NewGossipTransport(cfg GossipTransportConfig) (*GossipTransport, error) {
	if cfg.Host == nil {
		return nil, errors.New("transport: gossip transport needs a host")
	}
	if cfg.Admit == nil {
		return nil, errors.New("transport: gossip transport needs an Admit hook")
	}
	ctx, cancel := context.WithCancel(context.Background())
	t := &GossipTransport{
		h:        cfg.Host,
		cfg:      cfg,
		log:      cfg.Logger.With().Str("component", "gossip-transport").Logger(),
		self:     cfg.Host.ID(),
		packetCh: make(chan *memberlist.Packet, 256),
		streamCh: make(chan net.Conn),
		ctx:      ctx,
		cancel:   cancel,
		senders:  make(map[peer.ID]*gossipSender),
		byAddr:   make(map[string]peer.ID),
		inbound:  make(map[network.Stream]struct{}),
	}
	t.remember(t.self)
	// A sender's stream dies with its peer's last connection: the sender
	// goes then, rather than hold the closed connection until it idles
	// out (a new packet starts a new one).
	t.notifee = &network.NotifyBundle{DisconnectedF: func(n network.Network, c network.Conn) {
		if p := c.RemotePeer(); n.Connectedness(p) != network.Connected && n.Connectedness(p) != network.Limited {
			t.mu.Lock()
			t.dropSenderLocked(p)
			t.mu.Unlock()
		}
	}}
	t.h.Network().Notify(t.notifee)
	t.h.SetStreamHandler(GossipPacketProtocol, t.handlePacketStream)
	t.h.SetStreamHandler(GossipStreamProtocol, t.handleStream)
	return t, nil
}

// GossipAddr returns the IP and port that stand for p where memberlist
// requires them: an address in the IPv6 unique-local range fd00::/8 and a
// port in 1024..65535, both from a SHA-256 of the peer ID. They are never
// dialed; they only need to be stable and distinct per peer.
func GossipAddr(p peer.ID) (net.IP, int) {
	sum := sha256.Sum256(append([]byte("computeflux/gossip-addr\x00"), p...))
	ip := make(net.IP, net.IPv6len)
	ip[0] = 0xfd
	copy(ip[1:], sum[:15])
	port := 1024 + int(binary.BigEndian.Uint16(sum[15:17]))%(65536-1024)
	return ip, port
}

func gossipAddrString(p peer.ID) string {
	ip, port := GossipAddr(p)
	return net.JoinHostPort(ip.String(), strconv.Itoa(port))
}

// gossipNetAddr is the net.Addr of a peer on the gossip transport.
type gossipNetAddr struct {
	p peer.ID
	s string
}

func (a gossipNetAddr) Network() string { return "libp2p" }
func (a gossipNetAddr) String() string  { return a.s }

func (t *GossipTransport) remember(p peer.ID) gossipNetAddr {
	s := gossipAddrString(p)
	t.mu.Lock()
	t.byAddr[s] = p
	t.mu.Unlock()
	return gossipNetAddr{p: p, s: s}
}

// forget drops what the transport keeps for p, a member that left: its
// derived address and its sender (whose stream would otherwise hold p's
// closed connection until the sender idles out).
func (t *GossipTransport) forget(p peer.ID) {
	if p == t.self {
		return
	}
	a := gossipAddrString(p)
	t.mu.Lock()
	if t.byAddr[a] == p {
		delete(t.byAddr, a)
	}
	t.dropSenderLocked(p)
	t.mu.Unlock()
}

// dropSenderLocked ends p's sender, if any (t.mu held).
func (t *GossipTransport) dropSenderLocked(p peer.ID) {
	if s := t.senders[p]; s != nil {
		delete(t.senders, p)
		close(s.quit)
	}
}

// keepOnly drops the derived addresses of the peers keep rejects.
func (t *GossipTransport) keepOnly(keep func(peer.ID) bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for s, p := range t.byAddr {
		if p != t.self && !keep(p) {
			delete(t.byAddr, s)
		}
	}
}

// peerOf maps a memberlist address to a peer: by node name when memberlist
// has one, else through the derived addresses seen so far.
func (t *GossipTransport) peerOf(a memberlist.Address) (peer.ID, error) {
	if a.Name != "" {
		// Named: nothing to remember (the derived address of a peer that
		// sent us something is remembered as it arrives).
		p, err := peer.Decode(a.Name)
		if err != nil {
			return "", fmt.Errorf("transport: gossip node name %q is not a peer ID: %w", a.Name, err)
		}
		return p, nil
	}
	t.mu.Lock()
	p, ok := t.byAddr[a.Addr]
	t.mu.Unlock()
	if !ok {
		return "", fmt.Errorf("transport: gossip address %s has no known peer", a.Addr)
	}
	return p, nil
}

// Stats returns the transport's counters.
func (t *GossipTransport) Stats() GossipStats {
	return GossipStats{
		PacketsSent:     t.c.packetsSent.Load(),
		PacketsReceived: t.c.packetsReceived.Load(),
		PacketsDropped:  t.c.packetsDropped.Load(),
		BytesSent:       t.c.bytesSent.Load(),
		BytesReceived:   t.c.bytesReceived.Load(),
		StreamsOpened:   t.c.streamsOpened.Load(),
		StreamsAccepted: t.c.streamsAccepted.Load(),
		Rejected:        t.c.rejected.Load(),
		Filtered:        t.c.filtered.Load(),
		Forged:          t.c.forged.Load(),
	}
}

// FinalAdvertiseAddr ignores memberlist's bind settings and returns the
// address derived from our own peer ID.
func (t *GossipTransport) FinalAdvertiseAddr(string, int) (net.IP, int, error) {
	ip, port := GossipAddr(t.self)
	return ip, port, nil
}

// WriteTo sends a packet to a derived address seen before.
func (t *GossipTransport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress queues a packet for the peer named by addr and returns at
// once. A full queue drops the packet, as a congested UDP path would.
func (t *GossipTransport) WriteToAddress(b []byte, addr memberlist.Address) (time.Time, error) {
	now := time.Now()
	p, err := t.peerOf(addr)
	if err != nil {
		return now, err
	}
	if len(b) > gossipMaxPacket {
		return now, fmt.Errorf("transport: gossip packet of %d bytes exceeds %d", len(b), gossipMaxPacket)
	}
	if !t.cfg.Admit(p) {
		t.c.rejected.Add(1)
		return now, fmt.Errorf("%w: %s", ErrGossipNotAdmitted, p)
	}
	if t.cfg.observe != nil {
		t.cfg.observe(b)
	}
	if t.cfg.guard != nil {
		// Our own alive and leave also go to the trusted members first-hand:
		// they believe no one else about us.
		for q, msgs := range t.cfg.guard.outgoing(p, b) {
			if !t.cfg.Admit(q) {
				continue
			}
			for _, m := range msgs {
				_ = t.enqueue(q, m)
			}
		}
	}
	return now, t.enqueue(p, b)
}

// enqueue queues one packet for p.
func (t *GossipTransport) enqueue(p peer.ID, b []byte) error {
	frame := make([]byte, 2+len(b))
	binary.BigEndian.PutUint16(frame, uint16(len(b)))
	copy(frame[2:], b)

	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("transport: gossip: %w", net.ErrClosed)
	}
	s := t.senders[p]
	if s == nil {
		s = &gossipSender{t: t, p: p, queue: make(chan []byte, gossipPacketQueue), quit: make(chan struct{})}
		t.senders[p] = s
		t.wg.Add(1)
		go s.run()
	}
	select {
	case s.queue <- frame:
	default:
		t.c.packetsDropped.Add(1)
	}
	return nil
}

// gossipSender writes one peer's packets in order on a long-lived stream.
type gossipSender struct {
	t     *GossipTransport
	p     peer.ID
	queue chan []byte
	quit  chan struct{} // closed by forget: the peer left
}

func (s *gossipSender) run() {
	t := s.t
	defer t.wg.Done()
	var st network.Stream
	defer func() {
		if st != nil {
			st.Close()
		}
	}()
	var failedAt time.Time
	idle := time.NewTimer(gossipSenderIdle)
	defer idle.Stop()
	for {
		var frame []byte
		select {
		case <-t.ctx.Done():
			return
		case <-s.quit:
			return
		case frame = <-s.queue:
		case <-idle.C:
			t.mu.Lock()
			if len(s.queue) == 0 {
				if t.senders[s.p] == s {
					delete(t.senders, s.p)
				}
				t.mu.Unlock()
				return
			}
			t.mu.Unlock()
			idle.Reset(gossipSenderIdle)
			continue
		}
		idle.Reset(gossipSenderIdle)
		if st != nil && IsRelayedConn(st.Conn()) && PathTo(t.h, s.p) == PathDirect {
			// A hole punch (or a dial) gave the peer a direct connection
			// after this stream was opened on the circuit: new streams take
			// the direct one, so move there rather than keep the relay in
			// the path (and its circuit's data limit) for as long as the
			// sender lives.
			t.log.Debug().Str("peer", s.p.String()).Str("conn", st.Conn().ID()).Msg("gossip packet stream moves to the direct path")
			st.Close()
			st = nil
		}
		if st == nil && !failedAt.IsZero() && time.Since(failedAt) < gossipDialFailBackoff {
			t.c.packetsDropped.Add(1)
			continue
		}
		fresh := st == nil
		if fresh {
			if st = s.open(); st == nil {
				failedAt = time.Now()
				continue
			}
			failedAt = time.Time{}
		}
		err := s.write(st, frame)
		if err != nil && !fresh && !isTimeout(err) {
			// The stream died after its last frame: the peer reset it
			// (it did not admit us yet, say, because it had not heard of
			// us when it came) or its connection closed. The peer learns
			// nothing of a frame a write refuses, so resend it, once, on a
			// new stream, instead of losing a probe or its ack. A write
			// that timed out is not resent: its connection is stalled, and
			// a new stream would most likely ride the same one.
			t.log.Debug().Err(err).Str("peer", s.p.String()).Bool("relayed", IsRelayedConn(st.Conn())).
				Str("conn", st.Conn().ID()).Msg("gossip packet stream lost; resending on a new stream")
			st.Reset()
			if st = s.open(); st == nil {
				failedAt = time.Now()
				continue
			}
			err = s.write(st, frame)
		}
		if err != nil {
			t.c.packetsDropped.Add(1)
			t.log.Warn().Err(err).Str("peer", s.p.String()).Bool("relayed", IsRelayedConn(st.Conn())).
				Str("conn", st.Conn().ID()).Msg("gossip packet write failed; packet dropped")
			st.Reset()
			st = nil
			continue
		}
		t.c.packetsSent.Add(1)
		t.c.bytesSent.Add(uint64(len(frame) - 2))
		if t.cfg.streamPerPacket {
			st.Close()
			st = nil
		}
	}
}

// open opens the packet stream to the sender's peer, or counts the packet
// in hand as dropped and returns nil.
func (s *gossipSender) open() network.Stream {
	t := s.t
	began := time.Now()
	st, err := t.openStream(t.ctx, s.p, GossipPacketProtocol, gossipDialTimeout)
	if err != nil {
		t.c.packetsDropped.Add(1)
		t.log.Warn().Err(err).Str("peer", s.p.String()).Dur("took", time.Since(began)).Msg("gossip packet stream open failed; packet dropped")
		return nil
	}
	t.log.Debug().Str("peer", s.p.String()).Bool("relayed", IsRelayedConn(st.Conn())).
		Str("conn", st.Conn().ID()).Dur("took", time.Since(began)).Msg("gossip packet stream opened")
	return st
}

// isTimeout reports whether err is a deadline that passed.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// write writes one frame on st within gossipWriteTimeout.
func (s *gossipSender) write(st network.Stream, frame []byte) error {
	began := time.Now()
	_ = st.SetWriteDeadline(began.Add(gossipWriteTimeout))
	_, err := st.Write(frame)
	if d := time.Since(began); err == nil && d > 200*time.Millisecond {
		s.t.log.Debug().Str("peer", s.p.String()).Bool("relayed", IsRelayedConn(st.Conn())).Dur("took", d).Msg("gossip packet write slow")
	}
	return err
}

// openStream opens a gossip stream to p, over a relayed connection if that is
// all there is, dialing through Resolve's addresses when not connected.
func (t *GossipTransport) openStream(ctx context.Context, p peer.ID, proto protocol.ID, timeout time.Duration) (network.Stream, error) {
	if t.cfg.Resolve != nil {
		if c := t.h.Network().Connectedness(p); c != network.Connected && c != network.Limited {
			if addrs := t.cfg.Resolve(p); len(addrs) > 0 {
				t.h.Peerstore().AddAddrs(p, addrs, peerstore.TempAddrTTL)
			}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	ctx = network.WithAllowLimitedConn(ctx, "gossip")
	st, err := t.h.NewStream(ctx, p, proto)
	if err != nil {
		return nil, fmt.Errorf("transport: gossip stream to %s: %w", p, err)
	}
	t.c.streamsOpened.Add(1)
	return st, nil
}

// accept admits an inbound stream and tracks it so that Shutdown can reset
// it. It returns false after resetting the stream.
func (t *GossipTransport) accept(st network.Stream) bool {
	p := st.Conn().RemotePeer()
	if !t.cfg.Admit(p) {
		t.c.rejected.Add(1)
		t.log.Debug().Str("peer", p.String()).Str("protocol", string(st.Protocol())).Msg("gossip stream from a peer not admitted")
		st.Reset()
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		st.Reset()
		return false
	}
	t.inbound[st] = struct{}{}
	t.wg.Add(1)
	t.c.streamsAccepted.Add(1)
	return true
}

func (t *GossipTransport) release(st network.Stream) {
	t.mu.Lock()
	delete(t.inbound, st)
	t.mu.Unlock()
	t.wg.Done()
}

func (t *GossipTransport) handlePacketStream(st network.Stream) {
	if !t.accept(st) {
		return
	}
	defer t.release(st)
	remote := st.Conn().RemotePeer()
	from := t.remember(remote)
	r := bufio.NewReaderSize(st, 4096)
	var hdr [2]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			if errors.Is(err, io.EOF) {
				st.Close()
			} else {
				t.log.Debug().Err(err).Str("peer", from.p.String()).Bool("relayed", IsRelayedConn(st.Conn())).
					Str("conn", st.Conn().ID()).Msg("gossip packet stream from peer ended")
				st.Reset()
			}
			return
		}
		buf := make([]byte, binary.BigEndian.Uint16(hdr[:]))
		if _, err := io.ReadFull(r, buf); err != nil {
			st.Reset()
			return
		}
		now := time.Now()
		t.c.packetsReceived.Add(1)
		t.c.bytesReceived.Add(uint64(len(buf)))
		if t.cfg.guard != nil {
			out, forged := t.cfg.guard.filterPacket(remote, buf)
			if forged != "" {
				t.forged(remote, forged)
				st.Reset()
				return
			}
			if len(out) != len(buf) {
				t.c.filtered.Add(1)
			}
			if out == nil {
				continue
			}
			buf = out
		}
		if t.cfg.observe != nil {
			t.cfg.observe(buf)
		}
		select {
		case t.packetCh <- &memberlist.Packet{Buf: buf, From: from, Timestamp: now}:
		default:
			t.c.packetsDropped.Add(1)
		}
	}
}

// forged counts and reports a peer caught forging.
func (t *GossipTransport) forged(p peer.ID, reason string) {
	t.c.forged.Add(1)
	if t.cfg.onForged != nil {
		t.cfg.onForged(p, reason)
	}
}

func (t *GossipTransport) handleStream(st network.Stream) {
	if !t.accept(st) {
		return
	}
	c := t.newConn(st)
	select {
	case t.streamCh <- c:
		// memberlist owns the stream now; it closes the conn when done.
		t.release(st)
	case <-t.ctx.Done():
		t.release(st)
		st.Reset()
	}
}

// PacketCh returns the channel of received packets.
func (t *GossipTransport) PacketCh() <-chan *memberlist.Packet { return t.packetCh }

// StreamCh returns the channel of accepted streams.
func (t *GossipTransport) StreamCh() <-chan net.Conn { return t.streamCh }

// DialTimeout opens a stream to a derived address seen before.
func (t *GossipTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout opens a GossipStreamProtocol stream to the peer named by
// addr.
func (t *GossipTransport) DialAddressTimeout(addr memberlist.Address, timeout time.Duration) (net.Conn, error) {
	p, err := t.peerOf(addr)
	if err != nil {
		return nil, err
	}
	if !t.cfg.Admit(p) {
		t.c.rejected.Add(1)
		return nil, fmt.Errorf("%w: %s", ErrGossipNotAdmitted, p)
	}
	if timeout <= 0 {
		timeout = gossipDialTimeout
	}
	st, err := t.openStream(t.ctx, p, GossipStreamProtocol, timeout)
	if err != nil {
		return nil, err
	}
	return t.newConn(st), nil
}

// Shutdown removes the handlers, stops the senders and resets inbound
// streams, waiting for every goroutine it started. Safe to call more than once.
func (t *GossipTransport) Shutdown() error {
	t.shutdown.Do(func() {
		t.h.Network().StopNotify(t.notifee)
		t.h.RemoveStreamHandler(GossipPacketProtocol)
		t.h.RemoveStreamHandler(GossipStreamProtocol)
		t.cancel()
		t.mu.Lock()
		t.closed = true
		for st := range t.inbound {
			st.Reset()
		}
		t.mu.Unlock()
		t.wg.Wait()
	})
	return nil
}

// gossipConn is a libp2p stream as the net.Conn memberlist expects, counting
// payload bytes.
type gossipConn struct {
	network.Stream
	t             *GossipTransport
	local, remote gossipNetAddr
	// r reads the stream: the stream itself, or the guard's filter for a
	// member whose word about others does not count.
	r io.Reader
}

func (t *GossipTransport) newConn(st network.Stream) *gossipConn {
	p := st.Conn().RemotePeer()
	c := &gossipConn{
		Stream: st,
		t:      t,
		local:  gossipNetAddr{p: t.self, s: gossipAddrString(t.self)},
		remote: t.remember(p),
		r:      st,
	}
	if g := t.cfg.guard; g != nil && !g.isTrusted(p) {
		c.r = &guardedReader{gd: g, from: p, src: bufio.NewReader(st),
			onForged:   t.forged,
			onFiltered: func() { t.c.filtered.Add(1) },
		}
	}
	return c
}

func (c *gossipConn) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.t.c.bytesReceived.Add(uint64(n))
	return n, err
}

func (c *gossipConn) Write(b []byte) (int, error) {
	n, err := c.Stream.Write(b)
	c.t.c.bytesSent.Add(uint64(n))
	return n, err
}

func (c *gossipConn) LocalAddr() net.Addr  { return c.local }
func (c *gossipConn) RemoteAddr() net.Addr { return c.remote }
