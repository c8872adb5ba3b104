package transport

import (
	"bufio"
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

// HTTP over libp2p: each request travels on its own stream of InferProtocol,
// as an HTTP/1.1 message written and parsed by net/http itself (the agent runs
// a stock http.Server on a gostream listener). A new QUIC stream on the open
// connection costs no round trip (multistream-select is negotiated lazily,
// with the request bytes), so one stream per request keeps cancellation
// exact: resetting the stream ends that request and nothing else.

// MaxRequestBody bounds the request bodies ServeHTTP accepts (413 above).
const MaxRequestBody = 64 << 20

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
// HTTPServer.Rejected); a nil allow admits nobody. The returned Closer is an
// *HTTPServer; Close stops serving, closes open streams and waits for the
// handlers to return, so handlers must honor their request's context.
//
// A request's body is read whole (up to MaxRequestBody) before handler runs.
// net/http watches a connection for its peer going away only once the body has
// been consumed; reading it first makes a client's cancellation (a stream
// reset) end the request's context at once, whatever the handler does.
// OpenAI request bodies are complete JSON documents, so nothing is lost.
func ServeHTTP(h host.Host, handler http.Handler, allow func(peer.ID) bool) (io.Closer, error) {
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
		// One request per stream: the client asks to close after it.
		IdleTimeout: 30 * time.Second,
		ErrorLog:    log.New(io.Discard, "", 0),
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
		_ = s.srv.Serve(s.ln)
	}()
	return s, nil
}

func bufferBody(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil && r.Body != http.NoBody {
			b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBody))
			if err != nil {
				var tooBig *http.MaxBytesError
				if errors.As(err, &tooBig) {
					http.Error(w, "request body too large", http.StatusRequestEntityTooLarge)
				} else {
					http.Error(w, "reading request body failed", http.StatusBadRequest)
				}
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(b))
			r.ContentLength = int64(len(b))
		}
		next.ServeHTTP(w, r)
	})
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

// NewRoundTripper returns an http.RoundTripper that carries each request on a
// new InferProtocol stream of h to the peer named by the URL's host
// (http://<peer ID>/v1/...). Cancelling the request's context, or closing the
// response body before its end, resets the stream; a response read to its end
// closes it cleanly. Connections (not streams) are reused: libp2p keeps one
// QUIC connection per peer. Limited (relayed) connections are not used: they
// are too small for inference traffic.
func NewRoundTripper(h host.Host) http.RoundTripper {
	return &roundTripper{h: h}
}

type roundTripper struct {
	h host.Host
}

// RoundTrip implements http.RoundTripper.
func (rt *roundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	fail := func(err error) (*http.Response, error) {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	if req.URL == nil {
		return fail(errors.New("transport: nil request URL"))
	}
	hostname := req.URL.Hostname()
	pid, err := peer.Decode(hostname)
	if err != nil {
		return fail(fmt.Errorf("transport: URL host %q is not a peer ID: %w", hostname, err))
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	openCtx, cancelOpen := context.WithTimeout(ctx, streamOpenTimeout)
	s, err := rt.h.NewStream(openCtx, pid, InferProtocol)
	cancelOpen()
	if err != nil {
		if ctx.Err() != nil {
			return fail(ctx.Err())
		}
		return fail(fmt.Errorf("transport: open stream to %s: %w", pid, err))
	}

	ex := &exchange{s: s, ctx: ctx, wrote: make(chan struct{})}
	ex.stop = context.AfterFunc(ctx, ex.reset)

	// The request goes out as HTTP/1.1 with "Connection: close": the stream
	// carries this one exchange. A shallow copy keeps the caller's request
	// untouched.
	out := new(http.Request)
	*out = *req
	out.Close = true
	go func() {
		defer close(ex.wrote)
		// Write closes the body. After a failed write (the request body
		// failed, or the server stopped reading because it has answered),
		// half-close: the server sees a truncated request, and a response
		// already on its way still arrives.
		if err := out.Write(s); err != nil {
			_ = s.CloseWrite()
		}
	}()

	resp, err := http.ReadResponse(bufio.NewReader(s), req)
	if err != nil {
		ex.finish(false)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("transport: read response from %s: %w", pid, err)
	}
	resp.Body = &streamBody{body: resp.Body, ex: ex}
	return resp, nil
}

// exchange is one request/response on one stream.
type exchange struct {
	s     network.Stream
	ctx   context.Context
	stop  func() bool   // stops the context watch
	wrote chan struct{} // closed when the request has been written (or failed)
	once  sync.Once
}

func (ex *exchange) reset() { _ = ex.s.Reset() }

// finish ends the stream: Close when the whole response was read and the
// request fully written, else Reset (which also unblocks the writer).
func (ex *exchange) finish(complete bool) {
	ex.once.Do(func() {
		ex.stop()
		if complete {
			select {
			case <-ex.wrote:
				_ = ex.s.Close()
				return
			default:
			}
		}
		_ = ex.s.Reset()
	})
}

// streamBody ends the stream when the response body is done.
type streamBody struct {
	body io.ReadCloser
	ex   *exchange
	eof  atomic.Bool
}

func (b *streamBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	if err == io.EOF {
		b.eof.Store(true)
	} else if err != nil && b.ex.ctx.Err() != nil {
		err = b.ex.ctx.Err()
	}
	return n, err
}

func (b *streamBody) Close() error {
	err := b.body.Close()
	b.ex.finish(b.eof.Load())
	return err
}
