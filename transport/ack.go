package transport

import (
	"context"
	"maps"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"sync"
	"time"
)

// AckStatus is the informational status (102 Processing) an InferProtocol
// server sends once it has held a request for AckDelay without a response
// head to send: long before an engine's first token, whatever the body's
// size. It tells the client that the peer is alive and holds the request,
// so that a client can bound the wait for an acknowledgement by the path's
// round trip time instead of by the engine's time to first token. A
// response head is an acknowledgement too; the client treats the two alike.
// It costs a few bytes on the request's own stream and no round trip.
const AckStatus = http.StatusProcessing

// AckDelay is how long a server holds a request before it sends AckStatus.
// An answer ready sooner (an engine's error, a cached model list, a fast
// engine) goes out alone: the ack would cost a QUIC packet each way and a
// wake-up on both ends, about a sixth of the path's CPU for short requests.
// It is far below any client's bound for the ack (the relay waits at least
// 250 ms), so a silent peer is found as early as before.
const AckDelay = 10 * time.Millisecond

// WithAck returns a context for an outgoing request on which onSent is
// called once the request is written, and onAck (from the transport's
// reader goroutine, so it must not block; possibly more than once) as soon
// as the first byte of the server's answer arrives, AckStatus or the
// response itself: the head need not be whole for the peer to have shown
// it holds the request. A bound on the ack starts at onSent: a request that
// waited for a stream (see NewRoundTripper) was not the server's to
// acknowledge meanwhile. A nil onSent is not called.
func WithAck(ctx context.Context, onSent, onAck func()) context.Context {
	trace := &httptrace.ClientTrace{
		GotFirstResponseByte: onAck,
		Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
			if code == AckStatus {
				onAck()
			}
			return nil
		},
	}
	if onSent != nil {
		trace.WroteRequest = func(httptrace.WroteRequestInfo) { onSent() }
	}
	return httptrace.WithClientTrace(ctx, trace)
}

type readProgressKey struct{}

// WithReadProgress returns a context on which NewRoundTripper's transport
// calls onRead (from the reader's goroutine, so it must not block) each
// time bytes of the response body arrive: a sign of life from the peer
// that costs it nothing.
func WithReadProgress(ctx context.Context, onRead func()) context.Context {
	return context.WithValue(ctx, readProgressKey{}, onRead)
}

// ackWriter is the http.ResponseWriter a handler of ServeHTTP gets: it sends
// AckStatus on its own after AckDelay unless the handler has written its
// response head by then. The timer writes from its own goroutine, so every
// write to the connection is made under mu, and the handler fills a header
// map of its own until its response head is written: net/http writes the
// current header map with a 1xx status, and the handler may be filling it
// just then.
//
// ackWriters are reused (ackWriters): the writer, its header map and its
// timer with the timer's function were four allocations per request, the
// same from one request to the next. A writer goes back to the pool only
// once its timer can no longer fire (a Stop that stopped it, or its ack
// sent) and its handler returned: net/http's rule that a ResponseWriter is
// not used after ServeHTTP returns is what makes the reuse safe. The
// request body's reader is not pooled: a round tripper may still read a
// request body after its RoundTrip returned (http.Transport writes it from
// a goroutine of its own), so a handler that forwards it could have it read
// after the handler returned.
type ackWriter struct {
	w     http.ResponseWriter
	mu    sync.Mutex
	h     http.Header // the handler's header until the head is written
	head  bool        // the response head is written (or the handler returned)
	idle  bool        // the timer can no longer fire: stopped, or its ack ran
	timer *time.Timer
	own   http.Header // the header map of the handler's own, reused
	// wide: own held more than maxPooledHeader fields (a map does not
	// shrink when cleared).
	wide bool
}

// ackWriters holds ackWriters whose handler returned and whose timer is
// stopped.
var ackWriters sync.Pool

// maxPooledHeader bounds the header map of a pooled writer (a handler that
// set many headers leaves a map that stays large).
const maxPooledHeader = 32

func newAckWriter(w http.ResponseWriter) *ackWriter {
	a, _ := ackWriters.Get().(*ackWriter)
	if a == nil {
		a = &ackWriter{own: make(http.Header)}
	}
	a.mu.Lock()
	a.w, a.h, a.head, a.idle, a.wide = w, a.own, false, false, false
	a.mu.Unlock()
	if a.timer == nil {
		a.timer = time.AfterFunc(AckDelay, a.ack)
	} else {
		a.timer.Reset(AckDelay)
	}
	return a
}

// ack sends AckStatus unless the response head is out.
func (a *ackWriter) ack() {
	a.mu.Lock()
	if !a.head {
		a.w.WriteHeader(AckStatus)
	}
	a.idle = true
	a.mu.Unlock()
}

// stopTimer stops the ack's timer; mu is held.
func (a *ackWriter) stopTimer() {
	if !a.idle && a.timer.Stop() {
		a.idle = true
	}
}

// done ends the ack's chance, the handler having returned, and puts the
// writer back in the pool when its timer can no longer fire. What the
// handler left in its header map goes to the connection's, which net/http
// writes after the handler returned: the header of a handler that wrote
// nothing (sent with the implicit 200), or, the head written, what was set
// through the map Header returned before the head (a handler may keep it:
// net/http's map is the same throughout), which is trailers.
func (a *ackWriter) done() {
	a.mu.Lock()
	if !a.head {
		a.writeHead()
	} else if len(a.own) > 0 {
		a.wide = a.wide || len(a.own) > maxPooledHeader
		maps.Copy(a.w.Header(), a.own)
	}
	a.stopTimer()
	reuse := a.idle && !a.wide
	a.w, a.h = nil, nil
	a.mu.Unlock()
	if !reuse {
		return
	}
	clear(a.own)
	ackWriters.Put(a)
}

// Header returns the handler's header map: its own until the head is
// written, the connection's after (trailers are set there).
func (a *ackWriter) Header() http.Header {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.h
}

// writeHead copies the handler's header to the connection's; mu is held.
func (a *ackWriter) writeHead() {
	if a.head {
		return
	}
	a.head = true
	a.stopTimer()
	dst := a.w.Header()
	maps.Copy(dst, a.h)
	a.h = dst
	// Emptied, so that what is left in it when the handler returns was
	// set after the head (done).
	a.wide = len(a.own) > maxPooledHeader
	clear(a.own)
}

func (a *ackWriter) WriteHeader(code int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if code >= 100 && code < 200 {
		// An informational status of the handler's own (an engine's 103
		// passed on) goes out with the handler's header as it is now,
		// and leaves the head to come.
		if !a.head {
			dst := a.w.Header()
			maps.Copy(dst, a.h)
			a.w.WriteHeader(code)
			clear(dst)
		}
		return
	}
	a.writeHead()
	a.w.WriteHeader(code)
}

func (a *ackWriter) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.writeHead()
	return a.w.Write(p)
}

// FlushError flushes the connection's buffer, as http.ResponseController
// expects of a writer.
func (a *ackWriter) FlushError() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.writeHead()
	if f, ok := a.w.(interface{ FlushError() error }); ok {
		return f.FlushError() // net/http's writer, without a ResponseController
	}
	return http.NewResponseController(a.w).Flush()
}

// Flush is http.Flusher's.
func (a *ackWriter) Flush() { _ = a.FlushError() }
