package relay

// The request path, in named stages (the shape of caddy's reverse proxy):
//
//	serveProxied   once per request: authenticate, run the stages below,
//	               then record the request in the usage ledger (usage.go)
//	               and write the log line and the request metrics
//	  prepare      once per request: read and parse it, and choose its route
//	               (prepareInference here, prepareStored in responses.go)
//	  admit        once per request, before its first Pick: the client's
//	               budget (usage.go), then the per-key limits (a 429
//	               when over)
//	  proxy        the attempts, up to MaxAttempts:
//	    pick       the route names an endpoint (the scheduler, or the one
//	               agent that stores a response); an inference request
//	               that finds no room waits here, in the fair queue
//	               (queue.go), for its turn among the clients' requests
//	    attempt    send, first byte, commit, copy (attempt.go); it decides
//	               the attempt's outcome and reports nothing
//	    finish     the one place an attempt's end is recorded: reported to
//	               the route (the scheduler) once, its slot given back to
//	               the fair queue, shared with the peer relays, an answer
//	               handed to the auditor, counted and logged
//
// Every request that reaches an agent (chat, completions, embeddings,
// Responses, Messages, and GET, DELETE and cancel of a stored response)
// takes this path, and so gets the per-key limits, the liveness flight, the
// first-byte watchdog and the request metrics.

import (
	"errors"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/computeflux/computeflux/relay/auditor"
	"github.com/computeflux/computeflux/scheduler"
)

// route chooses where each attempt of a request goes and hears, once per
// attempt, how it ended. *scheduler.Attempt is the route of an inference
// request; storedRoute (responses.go) that of a request about a stored
// response.
type route interface {
	// Pick names the endpoint of the next attempt.
	Pick() (scheduler.Choice, error)
	// Started tells the route that c's answer began (its first byte).
	Started(c scheduler.Choice)
	// Report records how the attempt of c ended and classifies it.
	Report(c scheduler.Choice, o scheduler.Outcome) scheduler.Class
}

var _ route = (*scheduler.Attempt)(nil)

// proxied is one client request on its way to an endpoint: what prepare
// read from it, once, what every attempt uses, and what its log line and
// metrics report. It lives on serveProxied's stack: nothing that escapes
// may keep a reference to it (see exchange).
type proxied struct {
	w      http.ResponseWriter // the client's writer (wrapped for the Responses API)
	req    *http.Request
	rl     reqLog
	method string // the upstream request's method
	path   string // the upstream request's path
	query  string // the upstream request's query (stored responses only)
	body   []byte
	// agentBody is the body agents get (forward.go); nil means body.
	agentBody []byte
	session   string // the session key; empty for none
	route     route
	blocks    *[]uint64    // the prompt's block chain (pooled); nil when not hashed
	tap       *auditor.Tap // what the auditor reads of the answer; nil when not audited
	verify    bool         // the answer is re-checked (the client's choice)
	stream    bool         // the client asked for a stream
	// queued is set while an attempt holds a slot in the fair queue's
	// accounting (pick took it; finish gives it back).
	queued bool
	// lacking are the agents whose engines turned out, in this request,
	// not to serve its optional API (responses.go, allowServing).
	lacking []string
	// msg is a Messages request's translation (messages.go); nil for the
	// other APIs. translated is set while the attempt is translated.
	msg        *messagesReq
	translated bool
}

// release gives back what prepare took.
func (p *proxied) release() {
	if p.blocks != nil {
		releaseBlocks(p.blocks)
		p.blocks = nil
	}
	if p.tap != nil {
		p.tap.Release()
		p.tap = nil
	}
}

// attemptResult is how one attempt ended: its outcome for the route, and
// what the request path does next.
type attemptResult struct {
	outcome     scheduler.Outcome
	committed   bool          // the response (or its status) reached the client: no retry
	err         error         // why the attempt failed, or the stream broke
	rateLimited bool          // the endpoint answered 429
	retryAfter  time.Duration // from the endpoint's Retry-After
	apiMissing  bool          // the agent's engine lacks the optional API asked for
}

// serveProxied serves one request through the stages above and writes its
// log line (which names it by method, when not POST, and path) and metrics.
// stored is the response id of a request about a stored response; empty for
// an inference request.
func (r *Relay) serveProxied(w http.ResponseWriter, req *http.Request, method, path, stored string) {
	start := r.cfg.Clock.Now()
	p := &proxied{w: w, req: req, rl: reqLog{method: method, path: path}}
	rl := &p.rl
	err := r.runStages(p, stored)
	abort := false
	switch {
	case err == nil:
	case errors.Is(err, errAbort):
		abort = true
	case errors.Is(err, errClientGone):
		rl.status = statusClientClosed
	default:
		e := writeErrorFor(path, w, err)
		rl.status = e.Status
	}
	if rl.err == nil && err != nil && !errors.Is(err, errAbort) {
		rl.err = err
	}
	end := r.cfg.Clock.Now()
	dur := end.Sub(start)
	if stored == "" {
		r.recordUsage(p, end) // usage.go
	}
	r.metrics.observe(rl, dur)
	r.stats.observe(rl, start.Add(dur))
	ev := r.reqLog.Info()
	if rl.status >= 500 || rl.err != nil {
		ev = r.reqLog.Warn()
	}
	if rl.method != "" {
		ev = ev.Str("method", rl.method)
	}
	ev = ev.Str("path", rl.path).Str("model", rl.model).Bool("stream", rl.stream).
		Bool("session", rl.session).Str("agent", rl.agent).Str("affinity", rl.affinity).
		Int("attempts", rl.attempts).Int("status", rl.status).
		Dur("ttfb", rl.ttfb).Dur("duration", dur)
	if rl.err != nil {
		ev = ev.AnErr("error", rl.err)
	}
	ev.Msg("request")
	if abort {
		panic(http.ErrAbortHandler)
	}
}

// runStages authenticates p's request, then prepares, admits and proxies
// it. It returns nil once a response went out, or the error that
// writeError turns into one.
func (r *Relay) runStages(p *proxied, stored string) error {
	if !r.cfg.NoAuth {
		if p.rl.client = r.clients.lookup(keyID(p.req, false)); p.rl.client == nil {
			return errUnauthorized()
		}
	}
	var err error
	if stored == "" {
		err = r.prepareInference(p)
	} else {
		err = r.prepareStored(p, stored) // responses.go
	}
	defer p.release()
	if err != nil {
		return err
	}
	a, err := r.admit(p)
	if err != nil {
		return err
	}
	defer r.leave(a)
	return r.proxy(p)
}

// prepareInference reads and parses an inference request and begins its
// scheduling.
func (r *Relay) prepareInference(p *proxied) error {
	body, err := readBody(p.w, p.req, r.cfg.MaxBodyBytes)
	if err != nil {
		return err
	}
	p.method, p.path, p.body = http.MethodPost, p.req.URL.Path, body
	routed := body // what routing reads: a Messages request as the chat request it means
	if p.path == pathMessages {
		if p.msg, err = messagesToChat(body); err != nil { // messages.go
			return err
		}
		routed = p.msg.Chat
	}
	rt, err := parseRouting(routed)
	if err != nil {
		return err
	}
	p.session = sessionKey(p.req, rt)
	p.rl.model, p.rl.stream, p.rl.session = rt.model, rt.stream, p.session != ""

	// peers.go: a relay that has just started may wait for its peers' table.
	r.installBinding(p.req.Context(), p.session)
	p.blocks = r.promptBlocks(routed) // prefix.go; release gives them back
	sr := scheduler.Request{Model: rt.model, SessionKey: p.session, Prefix: *p.blocks, Wait: r.queue != nil, Streamed: rt.stream}
	p.rl.flow = flowFor(p.req, p.rl.client, rt, len(body))
	if p.w, err = r.routeAPI(p, rt, &sr); err != nil { // responses.go
		return err
	}
	if r.audits != nil && (p.path == pathChat || p.path == pathCompletions) {
		// Agents get the relay's seed and pseudonyms (forward.go).
		p.agentBody = forwardBody(body, relaySeed(), r.pseudo.of)
	}
	if r.audits != nil && p.msg != nil {
		p.msg.agentChat = forwardBody(p.msg.Chat, relaySeed(), r.pseudo.of) // as any chat request
	}
	if r.audits != nil && (p.path == pathChat || p.msg != nil) {
		c := p.rl.client
		p.verify = c != nil && c.Verify > 0 && rand.Float64() < c.Verify
		if r.audits.TapDue(rt.model, p.verify) {
			// finish hands the answer to the auditor (audits.go). A
			// Messages request's tap sits in front of the translation,
			// on attempts that are translated (attempt.go).
			p.tap, p.stream = auditor.NewTap(p.w), rt.stream
			if p.msg == nil {
				p.w = p.tap
			}
		}
	}
	p.route = r.sched.Begin(sr)
	return nil
}

// admission is a request's hold on its key's limits, from admit to leave.
type admission struct {
	key  [32]byte
	held bool
}

// admit is where a request is let in before its first Pick: the budget of
// an inference request's client, then the per-key rate and concurrency
// limits (a 429 when over). Release it with leave.
func (r *Relay) admit(p *proxied) (admission, error) {
	if _, inference := p.route.(*scheduler.Attempt); inference {
		if err := r.checkBudget(p.rl.client); err != nil { // usage.go
			return admission{}, err
		}
	}
	if r.limits == nil {
		return admission{}, nil
	}
	id := keyID(p.req, r.cfg.NoAuth)
	if err := r.limits.acquire(id); err != nil {
		return admission{}, err
	}
	return admission{key: id, held: true}, nil
}

// leave ends an admission.
func (r *Relay) leave(a admission) {
	if a.held {
		r.limits.release(a.key)
	}
}

// failureTally is what the failed attempts of a request add up to.
type failureTally struct {
	n              int
	last           error
	allRateLimited bool
	retryAfter     time.Duration
	apiMissing     int // attempts whose agent's engine lacked the API
}

func (f *failureTally) add(res *attemptResult) {
	f.n++
	f.last = res.err
	if res.apiMissing {
		f.apiMissing++
	}
	if res.rateLimited {
		f.retryAfter = max(f.retryAfter, res.retryAfter)
	} else {
		f.allRateLimited = false
	}
}

// proxy tries up to MaxAttempts endpoints until one answers. It returns nil
// once a response went out, or the error that writeError turns into one.
func (r *Relay) proxy(p *proxied) error {
	rl := &p.rl
	f := failureTally{allRateLimited: true}
	for n := 0; n < r.cfg.MaxAttempts; n++ {
		c, err := r.pick(p)
		var qe *Error
		if errors.As(err, &qe) || errors.Is(err, errClientGone) {
			rl.agent, rl.affinity = "", ""
			return err // the queue's own answer
		}
		if err != nil {
			rl.agent, rl.affinity = "", "" // no endpoint served the request
			if f.n > 0 && f.apiMissing == f.n {
				return errAPINotServed(p.path) // every engine tried lacked it
			}
			return r.pickError(err, rl.model, &f)
		}
		if n > 0 {
			r.metrics.retries.Inc()
		} else if p.blocks != nil {
			r.metrics.index.observePick(len(*p.blocks), c.CachedBlocks)
		}
		rl.attempts = n + 1
		rl.agent, rl.affinity = c.EndpointID, c.Affinity.String()
		res := r.attempt(p, c) // attempt.go
		r.finish(p, c, n+1, &res)
		if res.committed {
			rl.err = res.err
			if errors.Is(res.err, errClientGone) || errors.Is(res.err, errAbort) {
				return res.err
			}
			return nil
		}
		if p.req.Context().Err() != nil {
			return errClientGone
		}
		if res.apiMissing {
			p.lacking = append(p.lacking, c.EndpointID)
		}
		f.add(&res)
	}
	rl.agent, rl.affinity = "", ""
	if f.allRateLimited {
		return errRateLimited(f.retryAfter, f.last)
	}
	return errBadGateway(f.n, f.last)
}

// pick names the endpoint of p's next attempt. An inference request goes
// through the fair queue when it is on, and may wait there for room.
func (r *Relay) pick(p *proxied) (scheduler.Choice, error) {
	att, ok := p.route.(*scheduler.Attempt)
	if r.queue == nil || !ok {
		return p.route.Pick()
	}
	c, err := r.queue.pick(p.req, att, p.rl.flow)
	p.queued = err == nil
	return c, err
}

// finish records how attempt n (of choice c) ended, once: the route hears
// the outcome (the scheduler's statistics, breaker and session affinity), a
// success binds the session at the peer relays too, an answer that reached
// the client goes to the auditor, and an attempt that failed before its
// first byte is counted and logged.
func (r *Relay) finish(p *proxied, c scheduler.Choice, n int, res *attemptResult) {
	if p.route.Report(c, res.outcome) == scheduler.ClassSuccess {
		r.shareBinding(p.session, c.EndpointID)
	}
	if p.queued {
		p.queued = false
		r.queue.finished(p.rl.flow) // a slot freed
	}
	provider := r.providers.get(c.EndpointID) != nil
	if res.committed && r.audits != nil && (p.path == pathChat || p.msg != nil) && !provider {
		r.audits.Served(p.rl.tokens(len(p.body))) // the audit budget's base
	}
	if res.committed && p.tap != nil && (p.msg == nil || p.translated) {
		body, fwd := p.body, p.agentBody
		if p.msg != nil {
			body, fwd = p.msg.Chat, p.msg.agentChat // what the engine answered
		}
		x := auditor.Exchange{Model: p.rl.model, Agent: c.EndpointID, Provider: provider, Body: body, Forwarded: fwd,
			Header: p.req.Header, Stream: p.stream, Tap: p.tap, Verify: p.verify}
		if p.rl.client != nil {
			x.Client = p.rl.client.Name
		}
		r.audits.Answered(&x)
	}
	if res.committed || p.req.Context().Err() != nil {
		return
	}
	if res.apiMissing {
		r.log.Debug().Str("agent", c.EndpointID).Str("path", p.path).Msg("agent's engine turned out not to serve the API; trying another")
		return
	}
	r.metrics.failureCounter(c.EndpointID).Inc()
	r.logAttempt(c, n, res.err)
}

// pickError maps an error of Pick to the client's, taking the failed
// attempts so far into account.
func (r *Relay) pickError(err error, model string, f *failureTally) error {
	var ue *scheduler.UnavailableError
	switch {
	case errors.Is(err, scheduler.ErrUnknownModel) && f.n == 0 && !r.reg.serving():
		// No agent at all, as right after a relay restart while agents
		// rejoin: the model may well exist, so say "unavailable, retry"
		// rather than "no such model".
		e := errUnavailable(err)
		e.RetryAfter = time.Second
		return e
	case errors.Is(err, scheduler.ErrUnknownModel) && f.n == 0:
		return errModelNotFound(model, err)
	case errors.As(err, &ue) && ue.RateLimited && (f.n == 0 || f.allRateLimited):
		return errRateLimited(max(ue.RetryAfter, f.retryAfter), err)
	case f.n > 0 && f.allRateLimited:
		return errRateLimited(f.retryAfter, f.last)
	case f.n > 0:
		return errBadGateway(f.n, errors.Join(f.last, err))
	default:
		return errUnavailable(err)
	}
}
