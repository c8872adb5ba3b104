package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/p2p/net/gostream"
)

// HTTP over libp2p: requests travel on InferProtocol streams as HTTP/1.1
// messages written and parsed by net/http itself: the agent runs a stock
// http.Server on a gostream listener, the relay a stock http.Transport whose
// dialer opens a stream. A stream is a "connection" to net/http, so it is
// kept alive and reused for the next request when a response ends cleanly,
// and reset when a request is cancelled. Nothing here defines a framing.

// MaxRequestBody bounds the request bodies ServeHTTP accepts (413 above).
const MaxRequestBody = 64 << 20

// maxRequestBody is the bound readBody applies: MaxRequestBody, lowered by
// the test of the bound so that it sends megabytes, not 64 MiB.
var maxRequestBody = func() *atomic.Int64 {
	var n atomic.Int64
	n.Store(MaxRequestBody)
	return &n
}()

// streamOpenTimeout bounds NewStream (including a dial when no connection
// exists) when the request's context has no earlier deadline.
const streamOpenTimeout = 10 * time.Second

// HTTPServer serves HTTP on InferProtocol streams; see ServeHTTP.
type HTTPServer struct {
	srv      *http.Server
	ln       net.Listener
	allow    func(peer.ID) bool
	rejected atomic.Uint64
	served   chan struct{} // closed when Serve returns
	serveErr error         // why Serve returned, unless Close ended it; set before served closes
	conns    sync.WaitGroup
	once     sync.Once
}

type peerCtxKey struct{}

// PeerFromContext returns the remote peer of an HTTP request served by
// ServeHTTP (pass r.Context()).
func PeerFromContext(ctx context.Context) (peer.ID, bool) {
	p, ok := ctx.Value(peerCtxKey{}).(peer.ID)
	return p, ok
}

// ServeHTTP serves handler on InferProtocol streams of h. Streams from peers
// for which allow returns false are reset and counted (see
// HTTPServer.Rejected); a nil allow admits nobody. The returned server's
// Close stops serving, closes open streams and waits for the handlers to
// return, so handlers must honor their request's context. Done and Err
// tell when serving stopped on its own (accepting streams failed): the
// caller must watch them, as nothing is served after that.
//
// A request's body is read whole (up to MaxRequestBody) before handler runs.
// net/http watches a connection for its peer going away only once the body has
// been consumed; reading it first makes a client's cancellation (a stream
// reset) end the request's context at once, whatever the handler does.
// OpenAI request bodies are complete JSON documents, so nothing is lost.
//
// Every request is acknowledged with AckStatus once it has been held for
// AckDelay from its header on (body read or not) without a response head
// (see WithAck). A handler that is a BodyHandler gets the body's bytes.
// What net/http reports, a handler's recovered panic among it, is dropped
// unless WithServerLog gives the server a log.
func ServeHTTP(h host.Host, handler http.Handler, allow func(peer.ID) bool, opts ...ServeOption) (*HTTPServer, error) {
	var o serveOptions
	for _, opt := range opts {
		opt(&o)
	}
	if o.errorLog == nil {
		o.errorLog = log.New(io.Discard, "", 0)
	}
	if allow == nil {
		allow = func(peer.ID) bool { return false }
	}
	ln, err := gostream.Listen(h, InferProtocol)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", InferProtocol, err)
	}
	s := &HTTPServer{allow: allow, served: make(chan struct{})}
	s.ln = &allowListener{Listener: ln, s: s}
	s.srv = &http.Server{
		Handler:           bufferBody(handler),
		ReadHeaderTimeout: 30 * time.Second,
		// Idle keep-alive streams: longer than the client's pool timeout.
		IdleTimeout: 90 * time.Second,
		ErrorLog:    o.errorLog,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if p, err := peer.Decode(c.RemoteAddr().String()); err == nil {
				ctx = context.WithValue(ctx, peerCtxKey{}, p)
			}
			return ctx
		},
		ConnState: func(c net.Conn, st http.ConnState) {
			switch st {
			case http.StateNew:
				s.conns.Add(1)
			case http.StateClosed, http.StateHijacked:
				s.conns.Done()
			}
		},
	}
	go func() {
		defer close(s.served)
		if err := s.srv.Serve(s.ln); !errors.Is(err, http.ErrServerClosed) {
			s.serveErr = err
		}
	}()
	return s, nil
}

// Done returns a channel that is closed when the server stops serving:
// after Close, or on its own when accepting streams failed (see Err).
func (s *HTTPServer) Done() <-chan struct{} { return s.served }

// Err returns, once Done is closed, why the server stopped serving on its
// own; nil after Close, and while it serves.
func (s *HTTPServer) Err() error {
	select {
	case <-s.served:
		return s.serveErr
	default:
		return nil
	}
}

// BodyHandler is a handler that takes the request body ServeHTTP read as
// bytes, for a handler that reads it whole anyway (to scan it, hash it) and
// would otherwise copy it once more out of r.Body. ServeHTTP calls
// ServeHTTPBody instead of ServeHTTP when its handler is one: body holds
// what r.Body reads (r.Body is set as for any handler, not read yet), nil
// when the request has no body. The handler may keep body but must not
// change it.
type BodyHandler interface {
	http.Handler
	ServeHTTPBody(w http.ResponseWriter, r *http.Request, body []byte)
}

func bufferBody(next http.Handler) http.Handler {
	bh, _ := next.(BodyHandler)
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		// From the header on: the client's liveness bound ignores the
		// body's size.
		w := newAckWriter(rw)
		defer w.done()
		var b []byte
		if r.Body != nil && r.Body != http.NoBody {
			var err error
			b, err = readBody(rw, r)
			if err != nil {
				var tooBig *http.MaxBytesError
				if errors.As(err, &tooBig) {
					writeBodyError(w, http.StatusRequestEntityTooLarge, "request_too_large", "request body too large")
				} else {
					writeBodyError(w, http.StatusBadRequest, "bad_request_body", "reading request body failed")
				}
				return
			}
			// io.NopCloser over a *bytes.Reader: net/http knows the body
			// is in memory and writes a request carrying it on in one
			// write.
			r.Body = io.NopCloser(bytes.NewReader(b))
			r.ContentLength = int64(len(b))
		}
		if bh != nil {
			bh.ServeHTTPBody(w, r, b)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// writeBodyError answers a body the stream server could not read in
// OpenAI's error shape, as every other error on the path is answered.
func writeBodyError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Connection", "close") // the rest of the body is unread
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"error":{"message":%q,"type":"invalid_request_error","code":%q}}`+"\n", msg, code)
}

// preallocBody is the largest declared body length given its buffer before
// the bytes arrive; past it the buffer grows with what is read, so that a
// peer announcing a body it never sends holds no memory for it.
const preallocBody = 1 << 20

// readBody reads r's whole body, at most MaxRequestBody bytes: into one
// buffer of the declared length when it is small (the relay always declares
// it), growing one otherwise.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	if n := r.ContentLength; n > 0 && n <= preallocBody {
		// net/http's body reader stops at Content-Length and fails a
		// body cut short.
		b := make([]byte, n)
		if _, err := io.ReadFull(r.Body, b); err != nil {
			return nil, err
		}
		return b, nil
	}
	return io.ReadAll(http.MaxBytesReader(w, r.Body, maxRequestBody.Load()))
}

// Rejected returns how many streams from non-allowed peers were reset.
func (s *HTTPServer) Rejected() uint64 { return s.rejected.Load() }

// Close stops accepting streams, closes the open ones and waits for their
// handlers to return. It is safe to call more than once.
func (s *HTTPServer) Close() error {
	s.once.Do(func() {
		_ = s.srv.Close()
		<-s.served
		s.conns.Wait()
	})
	return nil
}

// allowListener resets streams from peers the server does not admit before
// net/http sees them.
type allowListener struct {
	net.Listener
	s *HTTPServer
}

// Accept returns the next stream from an allowed peer.
func (l *allowListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		p, err := peer.Decode(c.RemoteAddr().String())
		if err == nil && l.s.allow(p) {
			return c, nil
		}
		l.s.rejected.Add(1)
		if r, ok := c.(interface{ Reset() error }); ok {
			_ = r.Reset()
		} else {
			_ = c.Close()
		}
	}
}

// NewRoundTripper returns an http.RoundTripper that carries requests on
// InferProtocol streams of h to the peer named by the URL's host
// (http://<peer ID>/v1/...), as HTTP/1.1 written and parsed by net/http.
// A stream whose response was read to its end goes back to a small idle
// pool and carries the next request to that peer (HTTP/1.1 keep-alive),
// which saves opening and negotiating a stream per request. Cancelling a
// request's context, or closing its body early, resets its stream at once;
// the server's handler sees its context end. libp2p keeps one QUIC
// connection per peer under all of these streams; at most 224 of them are
// open to one peer at a time (in use and idle), below the 256 a peer's QUIC
// accepts, and a request beyond waits for one (its context bounds the
// wait). Limited (relayed)
// connections are not used: they are too small for inference traffic.
// See streamTransport for why this is not an http.Transport.
func NewRoundTripper(h host.Host) http.RoundTripper {
	return newStreamTransport(h)
}

// streamConn is a client stream as a net.Conn, as httptrace's GotConn
// reports it. Its Close resets the stream, so the server learns at once and
// nothing lingers half-open.
type streamConn struct {
	network.Stream
}

// Close resets the stream (see streamConn).
func (c *streamConn) Close() error { return c.Stream.Reset() }

// LocalAddr returns our peer ID.
func (c *streamConn) LocalAddr() net.Addr { return peerAddr(c.Stream.Conn().LocalPeer()) }

// RemoteAddr returns the server's peer ID.
func (c *streamConn) RemoteAddr() net.Addr { return peerAddr(c.Stream.Conn().RemotePeer()) }

// SetDeadline sets the stream's read and write deadlines.
func (c *streamConn) SetDeadline(t time.Time) error { return c.Stream.SetDeadline(t) }

// peerAddr is a peer ID as a net.Addr.
type peerAddr peer.ID

// Network returns gostream's network name, "libp2p".
func (a peerAddr) Network() string { return gostream.Network }

// String returns the peer ID.
func (a peerAddr) String() string { return peer.ID(a).String() }
