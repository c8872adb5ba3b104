package transport

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
)

// The join protocol opens with the framed handshake of handshake.go: the
// relay accepts, the agent initiates with its info (JSON) as the payload,
// and only the agent proves the token. Afterwards the agent sends update
// frames (info JSON) and the stream's end means the agent left.
const (
	joinVersion  byte = 1
	maxFrameSize      = 64 << 10
	macSize           = handshakeMAC

	msgUpdate = FrameProtocol // agent -> relay: info

	maxNameLen   = 128
	maxModels    = 1024
	maxAPIs      = 32
	maxEngineLen = 64
	maxModelLen  = 256
	maxReasonLen = 512
	maxRelays    = 16
	maxRelayLen  = 512
	maxWeight    = 1e6
	maxCapacity  = 1 << 20

	handshakeTimeout = 10 * time.Second
	updateTimeout    = 10 * time.Second
	protectTag       = "computeflux-join"
	proofLabel       = "computeflux join proof"
)

// joinFraming is the join protocol's framing.
var joinFraming = Framing{Version: joinVersion, MaxFrame: maxFrameSize}

// joinHandshake is the join protocol's handshake with token.
func joinHandshake(token []byte) *Handshake {
	return &Handshake{Framing: joinFraming, Secret: token, Label: proofLabel}
}

// Errors returned by Join and Membership.
var (
	// ErrRejected is wrapped by every *RejectedError.
	ErrRejected = errors.New("join rejected")
)

// RejectedError is returned by Join (or Membership.Err) when the relay
// refused the agent; Reason is the relay's explanation.
type RejectedError struct{ Reason string }

// Error says that the relay rejected the join, and why.
func (e *RejectedError) Error() string { return "join rejected by relay: " + e.Reason }

// Unwrap makes errors.Is(err, ErrRejected) true.
func (e *RejectedError) Unwrap() error { return ErrRejected }

// JoinInfo is what an agent tells the relay about itself when joining and in
// every update.
type JoinInfo struct {
	Name     string   `json:"name"`               // unique among agents of a relay
	Models   []string `json:"models,omitempty"`   // model IDs the engine serves
	Weight   float64  `json:"weight,omitempty"`   // 0 means 1
	Capacity int      `json:"capacity,omitempty"` // max concurrent requests; 0 means unlimited
	Draining bool     `json:"draining,omitempty"` // takes no new requests
	// APIs are the request paths beyond chat, completions and embeddings
	// that the agent's engine serves (e.g. /v1/responses, /v1/messages);
	// the relay routes those paths only to agents that list them.
	APIs []string `json:"apis,omitempty"`
	// UnknownAPIs are optional paths whose support the engine's answers to
	// the agent's probes did not show either way. The agent forwards them
	// and learns from the engine's first real answer (then the path moves
	// to APIs or goes); a relay may try an agent listing one when no agent
	// lists the path in APIs.
	UnknownAPIs []string `json:"apis_unknown,omitempty"`
	// Engine is the kind of engine the agent recognised ("vllm",
	// "llamacpp", ...; empty when not recognised). Audits compare sampled
	// answers only between engines of one kind.
	Engine string `json:"engine,omitempty"`
	// Relays are the multiaddrs (with /p2p/<ID>) of every relay the agent
	// joins, this one included: relays learn their peers from them.
	Relays []string `json:"relays,omitempty"`
}

// JoinHandler receives the registrations of a relay's agents. The relay's
// registry implements it. Its methods are called from stream goroutines,
// concurrently for different peers, must be safe for that and must not block
// long. For one peer the calls are ordered: Joined, any number of Updated,
// Left; a peer that joins again while its previous registration is still open
// has that one ended (Left) before the new Joined.
type JoinHandler interface {
	// Joined admits the peer; a non-nil error rejects it and its message is
	// sent to the agent (e.g. the name is taken by another peer).
	Joined(p peer.ID, info JoinInfo) error
	// Updated reports changed info of a joined peer.
	Updated(p peer.ID, info JoinInfo)
	// Left reports the end of a registration that Joined accepted.
	Left(p peer.ID)
}

// JoinServer is the relay side of the join protocol; see ServeJoin.
type JoinServer struct {
	h     host.Host
	token []byte
	jh    JoinHandler

	mu     sync.Mutex // guards the following fields
	closed bool
	active map[network.Stream]struct{}
	regs   map[peer.ID]*registration

	lim *joinLimiter

	wg      sync.WaitGroup
	failed  atomic.Uint64
	refused atomic.Uint64
	once    sync.Once
}

// registration is one joined agent's open stream.
type registration struct {
	s    network.Stream
	done chan struct{} // closed after Left (or after a failed handshake)
}

// ServeJoin accepts agents on JoinProtocol streams of h: those proving
// knowledge of token are passed to jh. The returned Closer is a *JoinServer;
// Close resets every registration (jh.Left is called for each) and waits.
func ServeJoin(h host.Host, token []byte, jh JoinHandler) (io.Closer, error) {
	if len(token) == 0 {
		return nil, errors.New("join: empty token")
	}
	if jh == nil {
		return nil, errors.New("join: nil handler")
	}
	js := &JoinServer{
		h:      h,
		token:  bytes.Clone(token),
		jh:     jh,
		active: make(map[network.Stream]struct{}),
		regs:   make(map[peer.ID]*registration),
		lim:    newJoinLimiter(),
	}
	h.SetStreamHandler(JoinProtocol, js.handle)
	return js, nil
}

// Failed returns how many handshakes failed (bad proof, malformed or
// rejected by the handler, or timed out).
func (js *JoinServer) Failed() uint64 { return js.failed.Load() }

// Refused returns how many join attempts were refused without a handshake
// because their peer or address was backing off after failures: after
// joinFreeFailures failed handshakes of a peer (joinAddrFreeFailures from an
// IP address), each further failure doubles a back-off from 500 ms up to
// 5 s during which that peer (address) is refused at once.
func (js *JoinServer) Refused() uint64 { return js.refused.Load() }

// Close stops accepting joins, ends every registration and waits for the
// handler calls to finish. It is safe to call more than once.
func (js *JoinServer) Close() error {
	js.once.Do(func() {
		js.h.RemoveStreamHandler(JoinProtocol)
		js.mu.Lock()
		js.closed = true
		for s := range js.active {
			_ = s.Reset()
		}
		js.mu.Unlock()
		js.wg.Wait()
	})
	return nil
}

func (js *JoinServer) handle(s network.Stream) {
	js.mu.Lock()
	if js.closed {
		js.mu.Unlock()
		_ = s.Reset()
		return
	}
	js.active[s] = struct{}{}
	js.wg.Add(1)
	js.mu.Unlock()
	defer func() {
		js.mu.Lock()
		delete(js.active, s)
		js.mu.Unlock()
		js.wg.Done()
	}()

	p := s.Conn().RemotePeer()
	ip := RemoteIP(s.Conn().RemoteMultiaddr())
	if ok, wait := js.lim.allow(p, ip, time.Now()); !ok {
		js.refused.Add(1)
		_ = s.SetDeadline(time.Now().Add(handshakeTimeout))
		_ = joinHandshake(nil).Reject(s, backoffReason(wait))
		_ = s.Close()
		return
	}
	hs := joinHandshake(js.token)
	info, hello, reject, err := js.handshake(hs, s, p)
	if err != nil {
		js.failed.Add(1)
		js.lim.failed(p, ip, time.Now())
		if reject == "" {
			_ = s.Reset()
			return
		}
		// Say why, and close gracefully so that the reason arrives.
		_ = hs.Reject(s, reject)
		_ = s.Close()
		return
	}

	reg := &registration{s: s, done: make(chan struct{})}
	defer close(reg.done)
	js.mu.Lock()
	old := js.regs[p]
	js.regs[p] = reg
	js.mu.Unlock()
	if old != nil {
		// A peer joins again while its old stream looks alive (e.g. the
		// agent lost its network and came back): end the old one first so
		// the handler sees Left before Joined.
		_ = old.s.Reset()
		<-old.done
		if c := old.s.Conn(); c != s.Conn() {
			// It joins on a new connection: the old one is dead (a
			// restarted process, a new network) and would otherwise carry
			// new streams into the void until its idle timeout.
			_ = c.Close()
		}
	}
	defer func() {
		js.mu.Lock()
		if js.regs[p] == reg {
			delete(js.regs, p)
		}
		js.mu.Unlock()
	}()

	if err := js.jh.Joined(p, info); err != nil {
		js.failed.Add(1)
		js.lim.failed(p, ip, time.Now())
		_ = hs.Reject(s, err.Error())
		_ = s.Close()
		return
	}
	js.lim.succeeded(p, ip)
	js.h.ConnManager().Protect(p, protectTag)
	defer js.h.ConnManager().Unprotect(p, protectTag)
	defer js.jh.Left(p)
	if err := hs.Welcome(s, hello, js.h.ID(), p); err != nil {
		_ = s.Reset()
		return
	}
	_ = s.SetDeadline(time.Time{})

	for {
		typ, body, err := readFrame(s)
		if err != nil {
			if errors.Is(err, io.EOF) {
				_ = s.Close()
			} else {
				_ = s.Reset()
			}
			return
		}
		if typ != msgUpdate {
			// Unknown messages of this version are ignored so that a newer
			// agent can add some.
			continue
		}
		info, err := parseInfo(body)
		if err != nil {
			_ = s.Reset()
			return
		}
		js.jh.Updated(p, info)
	}
}

// handshake runs the relay's side of hs up to a verified hello and its
// info. On failure, reject is the reason to send the agent, if any.
func (js *JoinServer) handshake(hs *Handshake, s network.Stream, p peer.ID) (info JoinInfo, hello *Hello, reject string, err error) {
	_ = s.SetDeadline(time.Now().Add(handshakeTimeout))
	hello, err = hs.Accept(s, s, js.h.ID(), p)
	if errors.Is(err, ErrBadProof) {
		// A wrong token is the usual mistake: say so.
		return JoinInfo{}, nil, "invalid join proof (wrong token?)", errors.New("invalid join proof")
	}
	if err != nil {
		return JoinInfo{}, nil, "", err
	}
	info, err = parseInfo(hello.Payload)
	if err != nil {
		return JoinInfo{}, nil, "invalid join info", err
	}
	return info, hello, "", nil
}

// Membership is an agent's open registration with one relay, returned by
// Join. Its methods are safe for concurrent use.
type Membership struct {
	h     host.Host
	relay peer.ID
	s     network.Stream

	wmu sync.Mutex // serializes writes

	done    chan struct{} // closed when the stream has ended
	err     error         // why; set before done is closed
	closing atomic.Bool
	once    sync.Once
}

// Join dials relay (if not connected), proves knowledge of token and
// registers with info. On success the returned Membership holds the
// registration open until Close or until the connection ends (see Done).
// A relay that refuses returns a *RejectedError. Cancelling ctx aborts the
// handshake; it does not affect the Membership once Join has returned.
func Join(ctx context.Context, h host.Host, relay peer.ID, token []byte, info JoinInfo) (*Membership, error) {
	if len(token) == 0 {
		return nil, errors.New("join: empty token")
	}
	infoBytes, err := encodeInfo(info)
	if err != nil {
		return nil, err
	}
	// A relayed connection may be all there is (behind NAT, before a
	// direct path is punched); the registration is small enough for it.
	sctx := network.WithAllowLimitedConn(ctx, "computeflux join")
	s, err := h.NewStream(sctx, relay, JoinProtocol)
	if err != nil {
		return nil, fmt.Errorf("join: open stream to %s: %w", relay, err)
	}
	stop := context.AfterFunc(ctx, func() { _ = s.Reset() })
	defer stop()
	deadline := time.Now().Add(handshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = s.SetDeadline(deadline)

	fail := func(err error) (*Membership, error) {
		_ = s.Reset()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("join %s: %w", relay, err)
	}
	if err := joinHandshake(token).Initiate(s, s, h.ID(), relay, infoBytes); err != nil {
		var rej *RejectedError
		if errors.As(err, &rej) {
			// Refused: before the handshake (back-off after failed
			// joins), for a wrong token or by the relay's registry.
			_ = s.Close()
			return nil, rej
		}
		return fail(err)
	}
	if !stop() {
		// ctx ended at the last moment and the stream is being reset.
		return fail(ctx.Err())
	}
	_ = s.SetDeadline(time.Time{})
	h.ConnManager().Protect(relay, protectTag)
	m := &Membership{h: h, relay: relay, s: s, done: make(chan struct{})}
	go m.read()
	return m, nil
}

// read watches the stream: the relay sends nothing after the welcome except,
// possibly, a reject that ends the registration.
func (m *Membership) read() {
	var err error
	for {
		var typ byte
		var body []byte
		typ, body, err = readFrame(m.s)
		if err != nil {
			break
		}
		if typ == FrameReject {
			err = rejected(body)
			break
		}
	}
	if m.closing.Load() {
		// Close sent FIN already; a reset now could discard it.
		err = net.ErrClosed
	} else {
		if errors.Is(err, io.EOF) {
			err = fmt.Errorf("relay %s ended the registration: %w", m.relay, io.EOF)
		}
		_ = m.s.Reset()
	}
	m.err = err
	m.h.ConnManager().Unprotect(m.relay, protectTag)
	close(m.done)
}

// Relay returns the relay's peer ID.
func (m *Membership) Relay() peer.ID { return m.relay }

// Update sends new info to the relay.
func (m *Membership) Update(info JoinInfo) error {
	b, err := encodeInfo(info)
	if err != nil {
		return err
	}
	select {
	case <-m.done:
		return m.Err()
	default:
	}
	m.wmu.Lock()
	defer m.wmu.Unlock()
	_ = m.s.SetWriteDeadline(time.Now().Add(updateTimeout))
	if err := writeFrame(m.s, msgUpdate, b); err != nil {
		_ = m.s.Reset()
		return fmt.Errorf("join update to %s: %w", m.relay, err)
	}
	_ = m.s.SetWriteDeadline(time.Time{})
	return nil
}

// Done is closed when the registration has ended: Close, the relay went
// away, or the connection broke.
func (m *Membership) Done() <-chan struct{} { return m.done }

// Err returns why the registration ended (nil while it is open). After
// Close it satisfies errors.Is(err, net.ErrClosed).
func (m *Membership) Err() error {
	select {
	case <-m.done:
		return m.err
	default:
		return nil
	}
}

// Close leaves the relay (it sees the agent go at once) and waits for the
// watcher to stop. It is safe to call more than once.
func (m *Membership) Close() error {
	m.once.Do(func() {
		m.closing.Store(true)
		m.wmu.Lock()
		_ = m.s.Close()
		m.wmu.Unlock()
	})
	<-m.done
	return nil
}

// writeFrame writes one join frame.
func writeFrame(w io.Writer, typ byte, body []byte) error {
	return joinFraming.WriteFrame(w, typ, body)
}

// readFrame reads one join frame.
func readFrame(r io.Reader) (typ byte, body []byte, err error) { return joinFraming.ReadFrame(r) }

// encodeInfo checks info and encodes it for the wire.
func encodeInfo(info JoinInfo) ([]byte, error) {
	if err := validateInfo(info); err != nil {
		return nil, err
	}
	b, err := json.Marshal(info)
	if err != nil {
		return nil, fmt.Errorf("join info: %w", err)
	}
	if len(b)+2+macSize > maxFrameSize {
		return nil, fmt.Errorf("join info: %d bytes exceeds the frame limit", len(b))
	}
	return b, nil
}

// parseInfo decodes and checks info from the wire.
func parseInfo(b []byte) (JoinInfo, error) {
	var info JoinInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return JoinInfo{}, fmt.Errorf("%w: info: %v", errBadFrame, err)
	}
	if err := validateInfo(info); err != nil {
		return JoinInfo{}, fmt.Errorf("%w: %v", errBadFrame, err)
	}
	return info, nil
}

func validateInfo(info JoinInfo) error {
	if info.Name == "" || len(info.Name) > maxNameLen || !utf8.ValidString(info.Name) {
		return fmt.Errorf("join info: name must be 1..%d bytes of UTF-8", maxNameLen)
	}
	if len(info.Models) > maxModels {
		return fmt.Errorf("join info: %d models exceed %d", len(info.Models), maxModels)
	}
	for _, m := range info.Models {
		if m == "" || len(m) > maxModelLen || !utf8.ValidString(m) {
			return fmt.Errorf("join info: model IDs must be 1..%d bytes of UTF-8", maxModelLen)
		}
	}
	if len(info.APIs)+len(info.UnknownAPIs) > maxAPIs {
		return fmt.Errorf("join info: %d APIs exceed %d", len(info.APIs)+len(info.UnknownAPIs), maxAPIs)
	}
	for _, a := range append(info.APIs[:len(info.APIs):len(info.APIs)], info.UnknownAPIs...) {
		if len(a) < 2 || len(a) > maxModelLen || a[0] != '/' || !utf8.ValidString(a) {
			return fmt.Errorf("join info: API paths must be 2..%d bytes starting with '/'", maxModelLen)
		}
	}
	if len(info.Engine) > maxEngineLen || !utf8.ValidString(info.Engine) {
		return fmt.Errorf("join info: engine must be at most %d bytes of UTF-8", maxEngineLen)
	}
	if math.IsNaN(info.Weight) || info.Weight < 0 || info.Weight > maxWeight {
		return fmt.Errorf("join info: weight %v outside 0..%g", info.Weight, float64(maxWeight))
	}
	if info.Capacity < 0 || info.Capacity > maxCapacity {
		return fmt.Errorf("join info: capacity %d outside 0..%d", info.Capacity, maxCapacity)
	}
	if len(info.Relays) > maxRelays {
		return fmt.Errorf("join info: %d relays exceed %d", len(info.Relays), maxRelays)
	}
	for _, r := range info.Relays {
		if r == "" || len(r) > maxRelayLen || !utf8.ValidString(r) {
			return fmt.Errorf("join info: relay addresses must be 1..%d bytes of UTF-8", maxRelayLen)
		}
	}
	return nil
}
