package transport

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"slices"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
)

// streamTransport is the HTTP/1.1 client of NewRoundTripper. The wire is
// what net/http writes and parses (Request.Write, http.ReadResponse); what
// it drops is http.Transport's machinery around a connection: a reader and
// a writer goroutine per connection and the channel hand-offs between them
// and the caller. Over a libp2p stream, which has goroutines of its own
// under it (quic-go's connection loop and send queue), those hand-offs were
// two of the wake-ups on every request's path and a sizable share of the
// relay's CPU. Here the caller's goroutine writes the request and reads the
// response itself; a stream whose response was read to its end goes back to
// an idle pool (HTTP/1.1 keep-alive) and carries the next request to that
// peer. There is no proxy, no compression and no HTTP/2: the agent speaks
// HTTP/1.1 on InferProtocol and nothing else.
type streamTransport struct {
	// key names the pool a request goes to (a peer ID, a host:port), or
	// fails for a URL this transport does not serve.
	key func(*http.Request) (string, error)
	// dial opens a connection for key; its Close must abort at once (a
	// stream reset, a TCP close).
	dial func(ctx context.Context, key string) (net.Conn, error)

	mu   sync.Mutex // guards idle, open, nValid and swept
	idle map[string][]*pooledStream
	// open counts each peer's streams, in use and idle, when maxOpen
	// bounds them.
	open  map[string]*openStreams
	swept time.Time // when the last sweep of expired idle streams ran

	valid    sync.Map // URL host -> peer.ID, hosts known to be peer IDs
	nValid   int      // entries in valid (approximate; guarded by mu)
	maxIdle  int      // idle streams kept per peer
	maxOpen  int      // streams open per peer, in use and idle; 0: no bound
	idleTime time.Duration
}

// openStreams is one peer's count of open streams. Guarded by
// streamTransport.mu.
type openStreams struct {
	n int
	// wake, made by a request waiting for a stream, is closed (and
	// dropped) when one is released or goes idle.
	wake chan struct{}
}

// pooledStream is a client stream (or connection) with its buffers.
type pooledStream struct {
	s         net.Conn
	br        *bufio.Reader
	bw        *bufio.Writer
	idleSince time.Time
	key       string
	counted   bool // holds one of its peer's open streams
	closed    bool // guarded by the transport's mu when counted
}

// Pool limits, as NewRoundTripper documented them for its http.Transport.
const (
	// The agent's side accepts 256 concurrent streams per connection
	// (quic-go's limit in libp2p): keep the idle pool well below.
	maxIdlePerPeer = 32
	// maxOpenPerPeer bounds the InferProtocol streams open to one peer, in
	// use and idle, below quic-go's 256: a stream beyond the peer's limit
	// would wait inside QUIC for the peer's credit, and so would every
	// other stream opened meanwhile, the liveness probes among them. The
	// rest is left to those: pings, gossip. A request beyond the bound
	// waits here for a stream (its context bounds the wait).
	maxOpenPerPeer = 224
	// Shorter than the server's IdleTimeout, so that the client retires an
	// idle stream before the server closes it under a new request.
	idleStreamTimeout = 30 * time.Second
	// maxValidHosts bounds the cache of validated URL hosts.
	maxValidHosts = 4096
)

func newStreamTransport(h host.Host) *streamTransport {
	t := &streamTransport{idle: map[string][]*pooledStream{}, open: map[string]*openStreams{},
		maxIdle: maxIdlePerPeer, maxOpen: maxOpenPerPeer, idleTime: idleStreamTimeout}
	// A peer's idle streams die with its connection: drop them then, so
	// that peers that come and go (agents rejoining under new peer IDs)
	// leave nothing behind. The notifee lives as long as the host.
	h.Network().Notify(&network.NotifyBundle{DisconnectedF: func(_ network.Network, c network.Conn) {
		t.dropConn(c.RemotePeer(), c)
	}})
	t.key = func(req *http.Request) (string, error) {
		p, err := t.peerOf(req.URL.Hostname())
		if err != nil {
			return "", fmt.Errorf("transport: URL host %q is not a peer ID: %w", req.URL.Hostname(), err)
		}
		return string(p), nil
	}
	t.dial = func(ctx context.Context, key string) (net.Conn, error) {
		s, err := openStream(ctx, h, peer.ID(key))
		if err != nil {
			return nil, err
		}
		return &streamConn{Stream: s}, nil
	}
	return t
}

// NewHTTP1RoundTripper returns an http.RoundTripper for plain http:// URLs
// (no proxy, no TLS, no HTTP/2, no compression) over connections from dial,
// with the design of NewRoundTripper: the caller's goroutine writes the
// request and reads the answer, with no reader and writer goroutines per
// connection; a connection whose response was read to its end is kept for
// the next request to the same host:port (at most 32 idle per host, 30 s);
// a cancelled request or a body closed early closes its connection; a reused
// connection that fails before any byte of an answer (the server closed it
// while idle) is replaced once. A nil dial means a net.Dialer's.
func NewHTTP1RoundTripper(dial func(ctx context.Context, network, addr string) (net.Conn, error)) http.RoundTripper {
	if dial == nil {
		dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	t := &streamTransport{idle: map[string][]*pooledStream{}, maxIdle: maxIdlePerPeer, idleTime: idleStreamTimeout}
	t.key = func(req *http.Request) (string, error) {
		if req.URL.Scheme != "http" {
			return "", fmt.Errorf("transport: unsupported scheme %q (plain http only)", req.URL.Scheme)
		}
		host, port := req.URL.Hostname(), req.URL.Port()
		if host == "" {
			return "", errors.New("transport: URL has no host")
		}
		if port == "" {
			port = "80"
		}
		return net.JoinHostPort(host, port), nil
	}
	t.dial = func(ctx context.Context, key string) (net.Conn, error) {
		c, err := dial(ctx, "tcp", key)
		if err != nil {
			return nil, fmt.Errorf("transport: dial %s: %w", key, err)
		}
		return c, nil
	}
	return t
}

// peerOf returns the peer ID a URL host names; decoding one (base58 and a
// multihash) per request showed in the relay's profile, hence the cache.
func (t *streamTransport) peerOf(host string) (peer.ID, error) {
	if v, ok := t.valid.Load(host); ok {
		return v.(peer.ID), nil
	}
	p, err := peer.Decode(host)
	if err != nil {
		return "", err
	}
	t.mu.Lock()
	if t.nValid++; t.nValid > maxValidHosts {
		t.valid.Clear()
		t.nValid = 1
	}
	t.mu.Unlock()
	t.valid.Store(host, p)
	return p, nil
}

// RoundTrip implements http.RoundTripper.
func (t *streamTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	closeBody := func() {
		if req.Body != nil {
			req.Body.Close()
		}
	}
	if req.URL == nil {
		closeBody()
		return nil, errors.New("transport: nil request URL")
	}
	key, err := t.key(req)
	if err != nil {
		closeBody()
		return nil, err
	}
	ctx := req.Context()
	trace := httptrace.ContextClientTrace(ctx)
	for try := 0; ; try++ {
		if err := ctx.Err(); err != nil {
			closeBody()
			return nil, err
		}
		ps, reused, err := t.get(ctx, key)
		if err != nil {
			closeBody()
			return nil, err
		}
		if ps == nil {
			c, err := t.dial(ctx, key)
			if err != nil {
				t.release(key)
				closeBody()
				return nil, err
			}
			ps = &pooledStream{s: c, br: bufio.NewReader(c), bw: bufio.NewWriter(c), key: key, counted: t.maxOpen > 0}
		}
		if trace != nil && trace.GotConn != nil {
			trace.GotConn(httptrace.GotConnInfo{Conn: ps.s, Reused: reused})
		}
		resp, err := t.exchange(ctx, req, key, ps, trace)
		if err == nil {
			return resp, nil
		}
		// A reused stream may have been closed by the server while idle
		// (its idle timeout, or a restart): if no byte of an answer came,
		// send the request once more on a fresh stream, as http.Transport
		// does for a connection it finds closed.
		var nr *noResponseError
		if !reused || try > 0 || !errors.As(err, &nr) || ctx.Err() != nil || (req.Body != nil && req.Body != http.NoBody && req.GetBody == nil) {
			closeBody()
			return nil, err
		}
		if req.GetBody != nil {
			body, gerr := req.GetBody()
			if gerr != nil {
				return nil, err
			}
			r2 := *req
			r2.Body = body
			req = &r2
		}
	}
}

// noResponseError is a failure on a stream before any byte of a response.
type noResponseError struct{ err error }

func (e *noResponseError) Error() string { return e.err.Error() }
func (e *noResponseError) Unwrap() error { return e.err }

// exchange writes req on ps and reads the response head; the body is read
// by the caller through a streamBody, which returns ps to the pool at its
// end. A cancelled context resets the stream at once, whatever is under way.
func (t *streamTransport) exchange(ctx context.Context, req *http.Request, key string, ps *pooledStream, trace *httptrace.ClientTrace) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() { t.closeStream(ps) })
	fail := func(err error) (*http.Response, error) {
		stop()
		t.closeStream(ps)
		if cerr := ctx.Err(); cerr != nil {
			return nil, cerr
		}
		return nil, err
	}
	if err := req.Write(ps.bw); err != nil {
		return fail(&noResponseError{fmt.Errorf("transport: write request: %w", err)})
	}
	// Request.Write reported WroteRequest to the trace itself.
	if err := ps.bw.Flush(); err != nil {
		return fail(&noResponseError{fmt.Errorf("transport: write request: %w", err)})
	}
	var resp *http.Response
	for first := true; ; first = false {
		if _, err := ps.br.Peek(1); err != nil {
			if first {
				return fail(&noResponseError{fmt.Errorf("transport: read response: %w", err)})
			}
			return fail(fmt.Errorf("transport: read response: %w", err))
		}
		if first && trace != nil && trace.GotFirstResponseByte != nil {
			trace.GotFirstResponseByte()
		}
		r, err := http.ReadResponse(ps.br, req)
		if err != nil {
			return fail(fmt.Errorf("transport: read response: %w", err))
		}
		// Informational answers (1xx but 101) precede the real one.
		if r.StatusCode >= 100 && r.StatusCode < 200 && r.StatusCode != http.StatusSwitchingProtocols {
			if trace != nil && trace.Got1xxResponse != nil {
				if err := trace.Got1xxResponse(r.StatusCode, textproto.MIMEHeader(r.Header)); err != nil {
					return fail(err)
				}
			}
			continue
		}
		resp = r
		break
	}
	b := &streamBody{t: t, ctx: ctx, ps: ps, key: key, stop: stop, rc: resp.Body, keep: !resp.Close && resp.StatusCode != http.StatusSwitchingProtocols}
	b.read, _ = ctx.Value(readProgressKey{}).(func())
	if resp.Body == http.NoBody || resp.Body == nil {
		b.rc = http.NoBody
		b.finish(true)
	}
	resp.Body = b
	return resp, nil
}

// streamBody is a response body on a pooled stream.
type streamBody struct {
	t    *streamTransport
	ctx  context.Context
	ps   *pooledStream
	key  string
	stop func() bool
	rc   io.ReadCloser
	keep bool   // the stream may carry another request after this one
	read func() // WithReadProgress's; nil without

	mu   sync.Mutex // guards done
	done bool
}

// Read reads the body; at its end the stream goes back to the pool.
func (b *streamBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if n > 0 && b.read != nil {
		b.read()
	}
	if err != nil {
		b.finish(err == io.EOF)
		if cerr := b.ctx.Err(); err != io.EOF && cerr != nil {
			// The stream broke because the request was cancelled: say so,
			// as http.Transport does.
			err = cerr
		}
	}
	return n, err
}

// Close ends the body; a body not read to its end resets its stream, so
// the server's handler learns at once that nobody reads its answer.
func (b *streamBody) Close() error {
	b.finish(false)
	return nil
}

// finish releases the stream once: back to the pool after a clean end,
// reset otherwise.
func (b *streamBody) finish(clean bool) {
	b.mu.Lock()
	if b.done {
		b.mu.Unlock()
		return
	}
	b.done = true
	b.mu.Unlock()
	// stop is false once the context's reset ran (or is running).
	if !b.stop() || !clean || !b.keep || b.ps.br.Buffered() > 0 {
		b.t.closeStream(b.ps)
		return
	}
	b.t.put(b.key, b.ps)
}

// get returns an idle stream for key, newest first, dropping expired ones.
// Without one it returns nil, having counted the stream the caller is to
// open (release it if that fails); with maxOpen streams open already it
// waits for one to go idle or close, or for ctx to end.
func (t *streamTransport) get(ctx context.Context, key string) (ps *pooledStream, reused bool, err error) {
	for {
		var expired []*pooledStream
		var wake chan struct{}
		now := time.Now()
		t.mu.Lock()
		l := t.idle[key]
		for len(l) > 0 && ps == nil {
			last := l[len(l)-1]
			l[len(l)-1] = nil
			l = l[:len(l)-1]
			if now.Sub(last.idleSince) < t.idleTime {
				ps = last
			} else {
				expired = append(expired, last)
			}
		}
		if len(l) > 0 {
			t.idle[key] = l
		} else {
			delete(t.idle, key)
		}
		if ps == nil && t.maxOpen > 0 {
			o := t.open[key]
			if o == nil {
				o = &openStreams{}
				t.open[key] = o
			}
			// The expired streams close below: their places are free.
			if o.n-len(expired) < t.maxOpen {
				o.n++
			} else {
				if o.wake == nil {
					o.wake = make(chan struct{})
				}
				wake = o.wake
			}
		}
		t.mu.Unlock()
		for _, e := range expired {
			t.closeStream(e)
		}
		if wake == nil {
			return ps, ps != nil, nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		}
	}
}

// put returns a stream whose exchange ended cleanly to the idle pool. Every
// idleTime/2 it also sweeps the whole pool of expired streams, so that
// those of a peer never asked again do not wait for that peer.
func (t *streamTransport) put(key string, ps *pooledStream) {
	now := time.Now()
	ps.idleSince = now
	var expired []*pooledStream
	t.mu.Lock()
	if now.Sub(t.swept) >= t.idleTime/2 {
		t.swept = now
		expired = t.sweepLocked(now)
	}
	full := len(t.idle[key]) >= t.maxIdle
	if !full {
		t.idle[key] = append(t.idle[key], ps)
		t.wakeLocked(key)
	}
	t.mu.Unlock()
	if full {
		t.closeStream(ps)
	}
	for _, e := range expired {
		t.closeStream(e)
	}
}

// sweepLocked takes the expired idle streams out of the pool and returns
// them (t.mu held).
func (t *streamTransport) sweepLocked(now time.Time) []*pooledStream {
	var out []*pooledStream
	for key, l := range t.idle {
		// Newest last: the expired ones are a prefix.
		n := 0
		for n < len(l) && now.Sub(l[n].idleSince) >= t.idleTime {
			n++
		}
		if n == 0 {
			continue
		}
		out = append(out, l[:n]...)
		if n == len(l) {
			delete(t.idle, key)
		} else {
			t.idle[key] = slices.Delete(l, 0, n)
		}
	}
	return out
}

// dropConn drops the idle streams to peer p that ride connection c (which
// closed), and p's cached URL host.
func (t *streamTransport) dropConn(p peer.ID, c network.Conn) {
	key := string(p)
	var dead []*pooledStream
	t.mu.Lock()
	l := t.idle[key]
	kept := l[:0]
	for _, ps := range l {
		if sc, ok := ps.s.(*streamConn); ok && sc.Conn() == c {
			dead = append(dead, ps)
		} else {
			kept = append(kept, ps)
		}
	}
	clear(l[len(kept):])
	if len(kept) == 0 {
		delete(t.idle, key)
	} else {
		t.idle[key] = kept
	}
	t.mu.Unlock()
	if _, ok := t.valid.LoadAndDelete(p.String()); ok {
		t.mu.Lock()
		t.nValid--
		t.mu.Unlock()
	}
	for _, ps := range dead {
		t.closeStream(ps)
	}
}

// closeStream closes (resets) ps and frees its place among its peer's open
// streams, once.
func (t *streamTransport) closeStream(ps *pooledStream) {
	_ = ps.s.Close()
	if !ps.counted {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps.closed {
		return
	}
	ps.closed = true
	t.releaseLocked(ps.key)
}

// release frees a place counted by get for a stream that was not opened.
func (t *streamTransport) release(key string) {
	if t.maxOpen == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.releaseLocked(key)
}

func (t *streamTransport) releaseLocked(key string) {
	o := t.open[key]
	if o == nil {
		return
	}
	o.n--
	t.wakeLocked(key)
	if o.n <= 0 && o.wake == nil {
		delete(t.open, key)
	}
}

// wakeLocked wakes the requests waiting for a stream to key.
func (t *streamTransport) wakeLocked(key string) {
	if o := t.open[key]; o != nil && o.wake != nil {
		close(o.wake)
		o.wake = nil
	}
}

// CloseIdleConnections closes (resets) the idle streams of the pool.
func (t *streamTransport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = map[string][]*pooledStream{}
	t.mu.Unlock()
	for _, l := range idle {
		for _, ps := range l {
			t.closeStream(ps)
		}
	}
}

// openStream opens an InferProtocol stream to pid, bounded by
// streamOpenTimeout when ctx has no earlier deadline.
func openStream(ctx context.Context, h host.Host, pid peer.ID) (network.Stream, error) {
	ctx, cancel := context.WithTimeout(ctx, streamOpenTimeout)
	defer cancel()
	s, err := h.NewStream(ctx, pid, InferProtocol)
	if err != nil {
		return nil, fmt.Errorf("transport: open stream to %s: %w", pid, err)
	}
	return s, nil
}
