package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/computeflux/computeflux/relay/anthropic"
	"github.com/computeflux/computeflux/relay/liveness"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Causes of a cancelled upstream request.
var (
	// ErrTTFBTimeout is the cause when an agent sent no response byte within
	// Config.TTFBTimeout.
	ErrTTFBTimeout = errors.New("agent sent no response byte in time")
	// ErrIdleTimeout is the cause when a response paused longer than
	// Config.IdleTimeout.
	ErrIdleTimeout = errors.New("agent response stalled")
	// ErrAgentGone is the cause when the picked agent left before the
	// request could be sent.
	ErrAgentGone = errors.New("agent is no longer joined")
)

// One attempt, in stages:
//
//	send        the upstream request, under the attempt's liveness flight
//	            (agents) and first-byte watchdog; a retryable status ends
//	            the attempt here
//	first byte  wait for the answer's first byte (and, for a successful
//	            non-streamed answer, check that it is JSON): until then a
//	            broken endpoint can still be replaced by another
//	commit      the status and headers go to the client: the answer is this
//	            attempt's from now on
//	copy        the body goes to the client (copy.go); a failure now ends
//	            the answer (with an error event for a stream)
//
// Each stage that ends the attempt returns its result, outcome included; the
// request path (proxy.go, finish) reports it.

// exchange is one attempt in flight. It does not hold the request (each
// stage is given it): escape analysis would move a request referenced from
// here to the heap.
type exchange struct {
	r      *Relay
	c      scheduler.Choice
	path   string              // the upstream path
	w      http.ResponseWriter // what the answer is written to
	tr     *anthropic.Writer   // a translated Messages attempt's translation; nil for none
	ctx    context.Context     // the attempt's context: the client's, cancelled with a cause
	cancel context.CancelCauseFunc
	fl     *liveness.Flight // liveness of an agent's attempt; nil for providers
	wd     wdRef
	start  time.Time
}

// attempt sends p to the endpoint of choice c and, once it answers, passes
// the answer to the client. It reports nothing: its result carries the
// outcome.
func (r *Relay) attempt(p *proxied, c scheduler.Choice) attemptResult {
	x := exchange{r: r, c: c, path: p.path, w: p.w}
	p.translated = false
	if p.msg != nil && !r.reg.lists(c.EndpointID, pathMessages) {
		// An engine without the Messages API gets the chat request it
		// means (messages.go), a tap in front of the translation.
		x.path, x.tr, p.translated = pathChat, anthropic.NewWriter(p.w, p.msg.Model, maxCheckedBody), true
		x.w = x.tr
		if p.tap != nil {
			p.tap.ResponseWriter, x.w = x.tr, p.tap
		}
	}
	tgt, ok := r.target(c, x.path)
	if !ok {
		return attemptResult{outcome: scheduler.Outcome{Err: ErrAgentGone}, err: fmt.Errorf("%s: %w", c.EndpointID, ErrAgentGone)}
	}
	x.ctx, x.cancel = context.WithCancelCause(p.req.Context())
	defer x.cancel(nil)
	upCtx := x.ctx
	if tgt.peer != "" && r.live != nil {
		// An agent (not a provider): see package liveness. It must acknowledge
		// the request within a few round trips, and answer probes while
		// the request is in flight.
		x.fl, upCtx = r.live.Begin(x.ctx, x.cancel, tgt.peer, c.EndpointID)
		defer x.fl.End()
	}
	up, err := x.request(p, upCtx, tgt)
	if err != nil {
		return attemptResult{outcome: scheduler.Outcome{Err: err}, err: err}
	}

	x.start = r.cfg.Clock.Now()
	// The first byte and the timer race in the watchdog: the winner alone
	// decides whether the attempt timed out. Timer.Stop cannot tell: it
	// returns false once the timer's function has started, before that
	// function has cancelled anything.
	x.wd = r.watchdogs.get(r.cfg.TTFBTimeout, r.cfg.IdleTimeout, x.cancel)
	defer x.wd.stop()

	resp, err := tgt.rt.RoundTrip(up)
	if err != nil {
		return x.failed(p, 0, err)
	}
	if x.fl != nil {
		x.fl.Acked() // a response header is an acknowledgement too
	}
	defer resp.Body.Close()
	if cls := scheduler.Classify(resp.StatusCode, nil); cls.Retryable() {
		return x.refused(resp)
	}
	if resp.Header.Get(transport.HeaderAPIMissing) != "" && tgt.peer != "" &&
		(resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed) {
		// The agent's engine turned out not to serve this API: another
		// agent's may. Not the agent's fault, and nothing went out yet.
		_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
		return attemptResult{outcome: scheduler.Outcome{Status: resp.StatusCode}, apiMissing: true,
			err: fmt.Errorf("%s: its engine does not serve %s", x.c.EndpointID, p.path)}
	}

	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	hd, res, ok := x.firstByte(p, resp, *bp)
	if !ok {
		return res
	}
	cp := x.commit(p, resp, hd.sse)
	defer cp.clearDeadline()
	return x.copy(p, resp, &cp, hd, *bp)
}

// usageKeep is HeaderUsage's value on requests, shared: a header's values
// are only read.
var usageKeep = []string{transport.UsageKeep}

// head is what the first-byte stage read of an answer.
type head struct {
	first []byte // the bytes read so far
	err   error  // how that read ended: nil (more to come) or io.EOF (whole)
	sse   bool   // the answer is an event stream
}

// request builds the upstream request of the attempt for tgt.
func (x *exchange) request(p *proxied, ctx context.Context, tgt target) (*http.Request, error) {
	// Parsing the target's URL string on every attempt was a visible cost
	// on a busy relay: the request is built with an empty URL (parsed for
	// free) and given the target's, already built.
	body, agentBody := p.body, p.agentBody
	if x.tr != nil {
		body, agentBody = p.msg.Chat, p.msg.agentChat
	}
	if tgt.peer != "" && agentBody != nil {
		body = agentBody // forward.go
	}
	up, err := http.NewRequestWithContext(ctx, p.method, "", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	*up.URL = tgt.u
	up.URL.RawQuery = p.query
	up.Host = tgt.u.Host
	up.ContentLength = int64(len(body))
	copyRequestHeaders(up.Header, p.req.Header)
	tgt.authorize(up.Header)
	if tgt.peer != "" && p.rl.flow.id != "" { // the agent's gate reads it (agent/gate.go)
		up.Header[transport.HeaderFlow] = []string{p.rl.flow.header()}
	}
	if tgt.peer != "" && p.rl.stream {
		up.Header[transport.HeaderUsage] = usageKeep // the usage chunk reaches the ledger
	}
	return up, nil
}

// failed is the result of an attempt that ended before its first byte: the
// client gone, the time to first byte, a liveness check, or the transport's
// error.
func (x *exchange) failed(p *proxied, status int, err error) attemptResult {
	lat := x.r.cfg.Clock.Now().Sub(x.start)
	if p.req.Context().Err() != nil {
		return attemptResult{outcome: scheduler.Outcome{Status: statusClientClosed, Latency: lat}, err: errClientGone}
	}
	if cause := context.Cause(x.ctx); errors.Is(cause, ErrTTFBTimeout) || errors.Is(cause, liveness.ErrNoAck) || errors.Is(cause, liveness.ErrAgentSilent) {
		err = cause
	}
	return attemptResult{outcome: scheduler.Outcome{Status: status, Err: err, Latency: lat}, err: err}
}

// noteUsage notes for the usage ledger what the answer said about its
// tokens (the stream's usage chunk, or the usage object at the end of a
// whole non-streamed answer), a guess at its completion tokens from what
// the client got, and how long the endpoint took.
func (x *exchange) noteUsage(p *proxied, cp *streamCopier, hd head) {
	p.rl.guess = cp.written / estimateBytesPerToken
	switch {
	case cp.frame != nil:
		p.rl.usage = cp.frame.usage
		p.rl.guess = cp.frame.chunks // a chunk a token, as engines stream
	case hd.err == io.EOF && p.rl.status/100 == 2:
		p.rl.usage.scanTail(hd.first)
	}
	p.rl.answered = p.rl.status/100 == 2 // before a client gone makes it 499
	p.rl.serving = x.r.cfg.Clock.Now().Sub(x.start)
}

// refused is the result of an answer whose status asks for another
// endpoint (5xx, 429).
func (x *exchange) refused(resp *http.Response) attemptResult {
	now := x.r.cfg.Clock.Now()
	ra := parseRetryAfter(resp.Header.Get("Retry-After"), now)
	_, _ = io.CopyN(io.Discard, resp.Body, 4<<10) // lets the connection be reused
	return attemptResult{
		outcome:     scheduler.Outcome{Status: resp.StatusCode, Latency: now.Sub(x.start), RetryAfter: ra},
		err:         fmt.Errorf("%s answered %d", x.c.EndpointID, resp.StatusCode),
		rateLimited: resp.StatusCode == http.StatusTooManyRequests,
		retryAfter:  ra,
	}
}

// firstByte waits for the answer's first byte, and reads a successful
// non-streamed answer whole (up to maxCheckedBody) to check that it is JSON.
// It returns what was read; ok is false when the attempt ended here (res
// says how).
func (x *exchange) firstByte(p *proxied, resp *http.Response, buf []byte) (hd head, res attemptResult, ok bool) {
	n, rerr := readSome(resp.Body, buf)
	if !x.wd.firstByte() {
		// The timer fired as the first byte arrived: the request is
		// cancelled (or about to be), and nothing has gone to the client
		// yet.
		rerr = ErrTTFBTimeout
		n = 0
	}
	if n == 0 && rerr != nil && rerr != io.EOF {
		return head{}, x.failed(p, resp.StatusCode, rerr), false
	}
	ttfb := x.r.cfg.Clock.Now().Sub(x.start)
	p.route.Started(x.c) // the prompt is prefilled: no longer the agent's backlog
	x.r.queue.wake()     // which may make room under the agent's prefill limit
	sse := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	first := buf[:n]
	if !sse && resp.StatusCode/100 == 2 {
		// A successful non-streamed answer must be JSON before the client
		// sees it; a broken one can still be retried elsewhere.
		first, rerr = readChecked(resp.Body, first, rerr, x.wd)
		if rerr != nil && rerr != io.EOF {
			if cause := context.Cause(x.ctx); errors.Is(cause, ErrIdleTimeout) {
				rerr = cause
			}
			return head{}, x.failed(p, resp.StatusCode, rerr), false
		}
		if rerr == io.EOF && !json.Valid(first) {
			return head{}, attemptResult{
				outcome: scheduler.Outcome{Status: resp.StatusCode, Err: ErrBadUpstream, Latency: ttfb},
				err:     fmt.Errorf("%s: %w", x.c.EndpointID, ErrBadUpstream),
			}, false
		}
	}
	p.rl.ttfb, p.rl.status = ttfb, resp.StatusCode
	return head{first: first, err: rerr, sse: sse}, attemptResult{}, true
}

// commit sends the answer's status and headers to the client, with the
// routing headers, and returns the copier of its body.
func (x *exchange) commit(p *proxied, resp *http.Response, sse bool) streamCopier {
	w := x.w
	copyResponseHeaders(w.Header(), resp.Header, x.c) // headers.go
	h := w.Header()
	if sse {
		h.Set("X-Accel-Buffering", "no") // tell reverse proxies in front not to buffer
		// Re-framing may change the length (a malformed tail becomes an
		// error event): the client gets the stream chunked.
		h.Del("Content-Length")
	}
	flush := resp.ContentLength < 0 || sse // streamed bodies go out as they come
	rc := http.NewResponseController(w)
	w.WriteHeader(resp.StatusCode)
	cp := streamCopier{w: w, rc: rc, flush: flush, idle: x.r.cfg.IdleTimeout, clock: x.r.cfg.Clock}
	if sse {
		cp.frame = &sseFramer{dropUsage: resp.Header.Get(transport.HeaderUsage) == transport.UsageAdded}
	}
	return cp
}

// copy passes the answer to the client: what the first-byte stage read,
// then the rest. Its result is committed whatever happens.
func (x *exchange) copy(p *proxied, resp *http.Response, cp *streamCopier, hd head, buf []byte) attemptResult {
	rerr := hd.err
	werr, ferr := cp.writeUpstream(hd.first)
	if werr == nil && ferr == nil && rerr == nil {
		for {
			var n int
			n, rerr = resp.Body.Read(buf)
			x.wd.touch()
			if n > 0 {
				if werr, ferr = cp.writeUpstream(buf[:n]); werr != nil || ferr != nil {
					break
				}
			}
			if rerr != nil {
				break
			}
		}
	}
	x.wd.stop() // the body is read: what follows are writes, bounded by their deadline
	if werr == nil && ferr == nil && rerr == io.EOF {
		werr, ferr = cp.endUpstream()
		if x.tr != nil && werr == nil && ferr == nil {
			werr = x.tr.End() // the translated answer's last part
		}
	}
	if ferr != nil && werr == nil {
		x.cancel(ErrBadUpstream)
		rerr = ErrBadUpstream
	}
	x.noteUsage(p, cp, hd)
	ttfb := p.rl.ttfb
	switch {
	case werr != nil || p.req.Context().Err() != nil:
		// The client left or stopped reading: not the endpoint's fault.
		x.cancel(errClientGone)
		p.rl.status = statusClientClosed
		return attemptResult{outcome: scheduler.Outcome{Status: statusClientClosed, Latency: ttfb}, committed: true, err: errClientGone}
	case rerr == nil || rerr == io.EOF:
		return attemptResult{outcome: scheduler.Outcome{Status: resp.StatusCode, Latency: ttfb}, committed: true}
	}
	// The answer broke after it began.
	cause := context.Cause(x.ctx)
	if cause == nil || errors.Is(cause, context.Canceled) {
		cause = rerr
	}
	res := attemptResult{outcome: scheduler.Outcome{Status: resp.StatusCode, Err: cause, Latency: ttfb}, committed: true, err: cause}
	if cp.frame == nil {
		res.err = fmt.Errorf("%w: %w", errAbort, cause)
		return res
	}
	msg, code := "The agent's response broke off", "upstream_failed"
	switch {
	case errors.Is(cause, ErrIdleTimeout):
		msg, code = "The agent's response stalled", "upstream_timeout"
	case errors.Is(cause, liveness.ErrAgentSilent):
		msg, code = "The agent stopped answering", "upstream_unreachable"
	case errors.Is(cause, ErrBadUpstream):
		msg, code = "The agent sent a malformed event", "upstream_invalid"
	}
	if x.tr != nil {
		x.tr.PassRaw() // the event is in the Messages API's shape already
	}
	_ = cp.writeEvent(streamErrorEventFor(p.path, msg, code))
	return res
}
