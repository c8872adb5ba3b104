package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/scheduler"
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

// copyBufSize is the one buffer a response is copied through: buffering per
// request is bounded by it, whatever the client's reading speed.
const copyBufSize = 32 << 10

var bufPool = sync.Pool{New: func() any { b := make([]byte, copyBufSize); return &b }}

// hopHeaders are not forwarded (RFC 9110 section 7.6.1), nor are our own
// routing headers when an agent sends them, nor a provider's cookies.
var hopHeaders = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Connection": true, "Proxy-Authenticate": true,
	"Proxy-Authorization": true, "Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
	http.CanonicalHeaderKey(HeaderAgent): true, http.CanonicalHeaderKey(HeaderAffinity): true,
	// A provider's cookies and account names are the relay operator's,
	// not the client's.
	"Set-Cookie": true, "Openai-Organization": true, "Openai-Project": true,
}

// attemptResult is how one attempt ended.
type attemptResult struct {
	committed   bool          // the response (or its status) reached the client: no retry
	err         error         // why the attempt failed, or the stream broke
	rateLimited bool          // the agent answered 429
	retryAfter  time.Duration // from the agent's Retry-After
}

// serveInference reads and parses the request, then tries up to MaxAttempts
// agents until one answers. It returns nil once a response went out, or the
// error that writeError turns into one.
func (r *Relay) serveInference(w http.ResponseWriter, req *http.Request, rl *reqLog) error {
	body, err := readBody(w, req, r.cfg.MaxBodyBytes)
	if err != nil {
		return err
	}
	rt, err := parseRouting(body)
	if err != nil {
		return err
	}
	session := sessionKey(req, rt)
	rl.model, rl.stream, rl.session = rt.model, rt.stream, session != ""

	r.installBinding(session)
	blocks := r.promptBlocks(body) // prefix.go
	defer releaseBlocks(blocks)
	sr := scheduler.Request{Model: rt.model, SessionKey: session, Prefix: *blocks}
	if w, err = r.routeAPI(w, req, rt, &sr); err != nil { // responses.go
		return err
	}
	if r.audits != nil && req.URL.Path == "/v1/chat/completions" {
		// The auditor learns the request's shape and checks the answer
		// (audit.go).
		tap := newAnswerTap(w)
		defer tap.release()
		w = tap
		defer r.audits.answered(rt.model, "", body, req.Header, rt.stream, tap, rl)
	}
	att := r.sched.Begin(sr)
	var (
		lastErr        error
		failures       int
		allRateLimited = true
		retryAfter     time.Duration
	)
	for n := 0; n < r.cfg.MaxAttempts; n++ {
		c, err := att.Pick()
		if err != nil {
			if errors.Is(err, scheduler.ErrUnknownModel) && failures == 0 && r.reg.routable() == 0 {
				// No agent at all, as right after a relay restart while
				// agents rejoin: the model may well exist, so say
				// "unavailable, retry" rather than "no such model".
				e := errUnavailable(err)
				e.RetryAfter = time.Second
				return e
			}
			rl.agent, rl.affinity = "", "" // no agent served the request
			return pickError(err, rt.model, failures, allRateLimited, retryAfter, lastErr)
		}
		if n > 0 {
			r.metrics.retries.Inc()
		}
		rl.attempts = n + 1
		if n == 0 {
			r.metrics.index.observePick(len(*blocks), c.CachedBlocks)
		}
		rl.agent, rl.affinity = c.EndpointID, c.Affinity.String()
		res := r.attempt(w, req, body, att, c, rl)
		if res.committed {
			rl.err = res.err
			if errors.Is(res.err, errClientGone) || errors.Is(res.err, errAbort) {
				return res.err
			}
			return nil
		}
		if req.Context().Err() != nil {
			return errClientGone
		}
		failures++
		lastErr = res.err
		r.metrics.failures.WithLabelValues(c.EndpointID).Inc()
		r.logAttempt(c, n+1, res.err)
		if res.rateLimited {
			retryAfter = max(retryAfter, res.retryAfter)
		} else {
			allRateLimited = false
		}
	}
	rl.agent, rl.affinity = "", ""
	if allRateLimited {
		return errRateLimited(retryAfter, lastErr)
	}
	return errBadGateway(failures, lastErr)
}

// pickError maps a scheduler.Pick error to the client's error, taking the
// failed attempts so far into account.
func pickError(err error, model string, failures int, allRateLimited bool, retryAfter time.Duration, lastErr error) error {
	var ue *scheduler.UnavailableError
	switch {
	case errors.Is(err, scheduler.ErrUnknownModel) && failures == 0:
		return errModelNotFound(model, err)
	case errors.As(err, &ue) && ue.RateLimited && (failures == 0 || allRateLimited):
		return errRateLimited(max(ue.RetryAfter, retryAfter), err)
	case failures > 0 && allRateLimited:
		return errRateLimited(retryAfter, lastErr)
	case failures > 0:
		return errBadGateway(failures, errors.Join(lastErr, err))
	default:
		return errUnavailable(err)
	}
}

// attempt sends the request to the chosen agent. Before the first body byte
// it may fail (the caller retries); after that the response belongs to this
// attempt and any failure ends it (with an error event for streams).
// Every outcome is reported to the scheduler exactly once.
func (r *Relay) attempt(w http.ResponseWriter, req *http.Request, body []byte, att *scheduler.Attempt, c scheduler.Choice, rl *reqLog) attemptResult {
	report := func(o scheduler.Outcome) {
		if att.Report(c, o) == scheduler.ClassSuccess {
			r.shareBinding(att.Request().SessionKey, c.EndpointID)
		}
	}
	tgt, ok := r.target(c, req.URL.Path)
	if !ok {
		report(scheduler.Outcome{Err: ErrAgentGone})
		return attemptResult{err: fmt.Errorf("%s: %w", c.EndpointID, ErrAgentGone)}
	}

	ctx, cancel := context.WithCancelCause(req.Context())
	defer cancel(nil)
	upCtx := ctx
	var fl *flight
	if tgt.peer != "" && r.live != nil {
		// An agent (not a provider): see liveness.go. It must acknowledge
		// the request within a few round trips, and answer probes while
		// the request is in flight.
		fl, upCtx = r.live.begin(ctx, cancel, tgt.peer, c.EndpointID)
		defer fl.end()
	}
	// Parsing the target's URL string on every attempt was a visible cost
	// on a busy relay: the request is built with an empty URL (parsed for
	// free) and given the target's, already built.
	up, err := http.NewRequestWithContext(upCtx, http.MethodPost, "", bytes.NewReader(body))
	if err != nil {
		report(scheduler.Outcome{Err: err})
		return attemptResult{err: err}
	}
	*up.URL = tgt.u
	up.Host = tgt.u.Host
	up.ContentLength = int64(len(body))
	copyRequestHeaders(up.Header, req.Header)
	tgt.authorize(up.Header)

	start := r.cfg.Clock.Now()
	// The first byte and the timer race in the watchdog: the winner alone
	// decides whether the attempt timed out. Timer.Stop cannot tell: it
	// returns false once the timer's function has started, before that
	// function has cancelled anything.
	wd := r.watchdogs.get(r.cfg.TTFBTimeout, r.cfg.IdleTimeout, cancel)
	defer wd.stop()

	resp, err := tgt.rt.RoundTrip(up)
	if err != nil {
		return r.failed(ctx, req, report, start, 0, err)
	}
	if fl != nil {
		fl.acked() // a response header is an acknowledgement too
	}
	defer resp.Body.Close()

	if cls := scheduler.Classify(resp.StatusCode, nil); cls.Retryable() {
		ra := parseRetryAfter(resp.Header.Get("Retry-After"), r.cfg.Clock.Now())
		_, _ = io.CopyN(io.Discard, resp.Body, 4<<10) // lets the connection be reused
		report(scheduler.Outcome{Status: resp.StatusCode, Latency: r.cfg.Clock.Now().Sub(start), RetryAfter: ra})
		return attemptResult{
			err:         fmt.Errorf("%s answered %d", c.EndpointID, resp.StatusCode),
			rateLimited: resp.StatusCode == http.StatusTooManyRequests,
			retryAfter:  ra,
		}
	}

	// Wait for the first body byte before committing: until then a broken
	// agent can still be replaced by another.
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	n, rerr := readSome(resp.Body, buf)
	if !wd.firstByte() {
		// The timer fired as the first byte arrived: the request is
		// cancelled (or about to be), and nothing has gone to the client
		// yet.
		rerr = ErrTTFBTimeout
		n = 0
	}
	if n == 0 && rerr != nil && rerr != io.EOF {
		return r.failed(ctx, req, report, start, resp.StatusCode, rerr)
	}
	ttfb := r.cfg.Clock.Now().Sub(start)
	att.Started(c) // the prompt is prefilled: no longer the agent's backlog
	sse := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	first := buf[:n]
	if !sse && resp.StatusCode/100 == 2 {
		// A successful non-streamed answer must be JSON before the client
		// sees it; a broken one can still be retried elsewhere.
		first, rerr = readChecked(resp.Body, first, rerr, wd)
		if rerr != nil && rerr != io.EOF {
			if cause := context.Cause(ctx); errors.Is(cause, ErrIdleTimeout) {
				rerr = cause
			}
			return r.failed(ctx, req, report, start, resp.StatusCode, rerr)
		}
		if rerr == io.EOF && !json.Valid(first) {
			report(scheduler.Outcome{Status: resp.StatusCode, Err: ErrBadUpstream, Latency: ttfb})
			return attemptResult{err: fmt.Errorf("%s: %w", c.EndpointID, ErrBadUpstream)}
		}
	}
	rl.ttfb, rl.status = ttfb, resp.StatusCode

	// Commit: headers, status and the first chunk go to the client.
	h := w.Header()
	for k, vv := range resp.Header {
		if !hopHeaders[k] {
			h[k] = vv
		}
	}
	// Set without canonicalising, so the wire shows the documented
	// spelling (X-ComputeFlux-...); header names are case-insensitive.
	h[HeaderAgent] = []string{c.EndpointID}
	if int(c.Affinity) < len(affinityValues) {
		h[HeaderAffinity] = affinityValues[c.Affinity]
	} else {
		h[HeaderAffinity] = []string{c.Affinity.String()}
	}
	if sse {
		h.Set("X-Accel-Buffering", "no") // tell reverse proxies in front not to buffer
		// Re-framing may change the length (a malformed tail becomes an
		// error event): the client gets the stream chunked.
		h.Del("Content-Length")
	}
	flush := resp.ContentLength < 0 || sse // streamed bodies go out as they come
	rc := http.NewResponseController(w)
	w.WriteHeader(resp.StatusCode)

	cp := streamCopier{w: w, rc: rc, flush: flush, idle: r.cfg.IdleTimeout, clock: r.cfg.Clock}
	if sse {
		cp.frame = &sseFramer{}
	}
	defer cp.clearDeadline()
	werr, ferr := cp.writeUpstream(first)
	if werr == nil && ferr == nil && rerr == nil {
		for {
			n, rerr = resp.Body.Read(buf)
			wd.touch()
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
	wd.stop() // the body is read: what follows are writes, bounded by their deadline
	if werr == nil && ferr == nil && rerr == io.EOF {
		werr, ferr = cp.endUpstream()
	}
	if ferr != nil && werr == nil {
		cancel(ErrBadUpstream)
		rerr = ErrBadUpstream
	}
	outcome := scheduler.Outcome{Status: resp.StatusCode, Latency: ttfb}
	switch {
	case werr != nil || req.Context().Err() != nil:
		// The client left or stopped reading: not the agent's fault.
		cancel(errClientGone)
		rl.status = statusClientClosed
		report(scheduler.Outcome{Status: statusClientClosed, Latency: ttfb})
		return attemptResult{committed: true, err: errClientGone}
	case rerr == nil || rerr == io.EOF:
		report(outcome)
		return attemptResult{committed: true}
	}
	// The agent's response broke after it began.
	cause := context.Cause(ctx)
	if cause == nil || errors.Is(cause, context.Canceled) {
		cause = rerr
	}
	outcome.Err = cause
	report(outcome)
	if !sse {
		return attemptResult{committed: true, err: fmt.Errorf("%w: %w", errAbort, cause)}
	}
	msg, code := "The agent's response broke off", "upstream_failed"
	switch {
	case errors.Is(cause, ErrIdleTimeout):
		msg, code = "The agent's response stalled", "upstream_timeout"
	case errors.Is(cause, ErrAgentSilent):
		msg, code = "The agent stopped answering", "upstream_unreachable"
	case errors.Is(cause, ErrBadUpstream):
		msg, code = "The agent sent a malformed event", "upstream_invalid"
	}
	_ = cp.writeEvent(streamErrorEventFor(req.URL.Path, msg, code))
	return attemptResult{committed: true, err: cause}
}

// failed reports an attempt that ended before its first byte and names the
// cause: client gone, time to first byte, or the transport's error.
func (r *Relay) failed(ctx context.Context, req *http.Request, report func(scheduler.Outcome), start time.Time, status int, err error) attemptResult {
	lat := r.cfg.Clock.Now().Sub(start)
	if req.Context().Err() != nil {
		report(scheduler.Outcome{Status: statusClientClosed, Latency: lat})
		return attemptResult{err: errClientGone}
	}
	if cause := context.Cause(ctx); errors.Is(cause, ErrTTFBTimeout) || errors.Is(cause, ErrNoAck) || errors.Is(cause, ErrAgentSilent) {
		err = cause
	}
	report(scheduler.Outcome{Status: status, Err: err, Latency: lat})
	return attemptResult{err: err}
}

// readSome reads until it gets at least one byte or an error.
func readSome(rd io.Reader, buf []byte) (int, error) {
	for i := 0; i < 100; i++ {
		n, err := rd.Read(buf)
		if n > 0 || err != nil {
			return n, err
		}
	}
	return 0, io.ErrNoProgress
}

// streamCopier writes a response to the client, flushing streamed bodies as
// they come and bounding how long one write may block on a client that does
// not read.
type streamCopier struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	flush   bool
	idle    time.Duration
	clock   scheduler.Clock
	last    [2]byte // the last two bytes written, to find event boundaries
	written int64
	dl      bool       // a write deadline is set
	frame   *sseFramer // nil: bytes pass as they are
	out     []byte     // framed events to write, reused
}

// heldWrite is how much of a response net/http holds in its response
// buffer (bufferBeforeChunkingSize) before it writes to the connection: an
// unflushed body up to that size reaches the socket only after the handler
// returned, so its writes cannot block on the client and need no deadline.
// Setting and clearing one for every small answer was two runtime timer
// updates per request.
const heldWrite = 2048

func (s *streamCopier) write(p []byte) error {
	if len(p) == 0 {
		return nil
	}
	if (s.flush || s.written+int64(len(p)) > heldWrite) && s.rc.SetWriteDeadline(s.clock.Now().Add(s.idle)) == nil {
		s.dl = true
	}
	n, err := s.w.Write(p)
	s.written += int64(n)
	if n >= 2 {
		s.last = [2]byte{p[n-2], p[n-1]}
	} else if n == 1 {
		s.last = [2]byte{s.last[1], p[0]}
	}
	if err != nil {
		return err
	}
	if s.flush {
		return s.rc.Flush()
	}
	return nil
}

// writeEvent writes a whole server-sent event, first closing an event the
// agent left half written.
func (s *streamCopier) writeEvent(ev []byte) error {
	if s.written > 0 && s.last != [2]byte{'\n', '\n'} {
		if s.last[1] == '\n' {
			ev = append([]byte("\n"), ev...)
		} else {
			ev = append([]byte("\n\n"), ev...)
		}
	}
	s.flush = true
	return s.write(ev)
}

func (s *streamCopier) clearDeadline() {
	if s.dl {
		_ = s.rc.SetWriteDeadline(time.Time{})
	}
}

// forwardedHeaders are the request headers an engine may use: looked up by
// their canonical key (as the server parsed them), forwarded with the
// spelling the APIs document. Canonicalising "OpenAI-Beta" and the like on
// every request cost an allocation each.
var forwardedHeaders = [...]struct{ canon, wire string }{
	{"Content-Type", "Content-Type"},
	{"Accept", "Accept"},
	{"Openai-Beta", "OpenAI-Beta"},
	{"X-Request-Id", "X-Request-ID"},
	{headerSessionCanon, HeaderSession},
}

// headerSessionCanon is HeaderSession in canonical form.
const headerSessionCanon = "X-Session-Id"

// Shared header values: a RoundTripper must not modify its request, so
// one slice serves every request.
var (
	jsonContentType  = []string{"application/json"}
	identityEncoding = []string{"identity"}
)

// affinityValues are the X-ComputeFlux-Affinity values by
// scheduler.Affinity, shared by every response: header values are only
// read once set (net/http copies them when the header is written).
var affinityValues = [...][]string{
	scheduler.AffinityNone: {scheduler.AffinityNone.String()},
	scheduler.AffinityHit:  {scheduler.AffinityHit.String()},
	scheduler.AffinityMiss: {scheduler.AffinityMiss.String()},
}

// copyRequestHeaders forwards what an engine may use. The client's
// Authorization (its relay key) is never forwarded.
func copyRequestHeaders(dst, src http.Header) {
	for _, h := range forwardedHeaders {
		if v := src[h.canon]; len(v) > 0 {
			dst[h.wire] = v
		}
	}
	if dst.Get("Content-Type") == "" {
		dst["Content-Type"] = jsonContentType
	}
	// Bytes pass through as the agent sends them; no transparent gzip.
	dst["Accept-Encoding"] = identityEncoding
}

// parseRetryAfter reads Retry-After as seconds or an HTTP date; 0 if absent
// or malformed.
func parseRetryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && s >= 0 {
		return time.Duration(min(s, 3600)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return min(t.Sub(now), time.Hour)
	}
	return 0
}
