package relay

import (
	"cmp"
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Waiting for room.
//
// Agents announce how many requests their engines batch (their capacity,
// agent/gate.go). A request that finds every agent able to serve it full
// waits here, in a scheduler.Queue: fair between clients by weight and
// tokens, interactive before batch. When a slot frees (an answer ends, an
// agent joins or grows), the dispatcher asks the scheduler to place the
// request whose turn it is: the queue decides when, the scheduler where,
// so a request still goes where its conversation is cached. A request
// waits at most Config.QueueWait (and half its client's own timeout, when
// the client says it); then an overflow tier (a provider endpoint) takes
// it if the table has one, else it gets 429 with a Retry-After from the
// queue's drain rate. A client that leaves takes its request out at once.
//
// A relay that has just started has no agent yet: a request that arrives
// then waits up to Config.RestartHold for the agents to rejoin instead of
// getting 503.

// Defaults of the queue's settings in Config.
const (
	// DefaultQueueWait bounds a request's wait for room.
	DefaultQueueWait = 30 * time.Second
	// DefaultPrefillLimit is Config.PrefillLimit's default, in tokens:
	// twice the 8,192-token prefill step vLLM and SGLang commonly take by
	// default on large GPUs, so that an engine has a step's worth of
	// prompts to prefill while the rest wait here. The capacity sweep
	// holds the same speed from 3,200 to 32,768 tokens (docs/sharing.md).
	DefaultPrefillLimit = 16384
	// DefaultRestartHold bounds the wait for agents right after a start.
	DefaultRestartHold = 5 * time.Second
	// restartWindow is how long after its start the relay holds a request
	// for a model no agent has announced yet (its agent may be rejoining).
	restartWindow = 15 * time.Second
	// dispatchTick is how often the dispatcher looks at the queue while
	// requests wait, besides its wake-ups: breakers and health change
	// without one.
	dispatchTick = 50 * time.Millisecond
)

// waiter is one request waiting in the queue.
type waiter struct {
	att  *scheduler.Attempt
	fl   flowOf
	done chan pickResult // capacity 1: the dispatcher's answer
}

type pickResult struct {
	c   scheduler.Choice
	err error
}

// flowOf is who a request is for, in the queue's terms.
type flowOf struct {
	id     string // the queue's flow: the client's name, or its address without auth
	label  string // the metrics label: the client's name, or "anonymous"
	weight float64
	band   scheduler.Band
	cost   float64 // expected tokens: prompt and answer
}

// header is the flow as the agent's gate reads it.
func (f flowOf) header() string {
	return transport.Flow{Client: f.id, Weight: f.weight, Class: f.band, Cost: f.cost}.String()
}

// fairQueue is the relay's queue and its dispatcher.
type fairQueue struct {
	r       *Relay
	q       *scheduler.Queue[*waiter]
	kick    chan struct{} // capacity 1: look at the queue now
	started time.Time
	met     queueMetrics
}

func newFairQueue(r *Relay) (*fairQueue, error) {
	q, err := scheduler.NewQueue[*waiter](scheduler.QueueConfig{
		MaxQueued: r.cfg.MaxQueued, MaxQueuedPerFlow: r.cfg.MaxQueuedPerClient, Clock: r.cfg.Clock,
	})
	if err != nil {
		return nil, err
	}
	f := &fairQueue{r: r, q: q, kick: make(chan struct{}, 1), started: r.cfg.Clock.Now()}
	f.met = newQueueMetrics(f)
	return f, nil
}

// wake asks the dispatcher to look at the queue: a slot may have freed.
// It never blocks.
func (f *fairQueue) wake() {
	if f == nil {
		return
	}
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// finished records that an attempt of fl ended (reported to the
// scheduler): its slot is free for the next request.
func (f *fairQueue) finished(fl flowOf) {
	if f == nil {
		return
	}
	f.q.Done(fl.id, fl.cost)
	f.wake()
}

// run dispatches until ctx ends.
func (f *fairQueue) run(ctx context.Context) {
	t := time.NewTicker(dispatchTick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.kick:
		case <-t.C:
		}
		f.dispatch()
	}
}

// dispatch places waiting requests, in the queue's order, while the
// scheduler finds room for them.
func (f *fairQueue) dispatch() {
	for _, model := range f.q.Models() {
		for {
			it := f.q.Peek(model)
			if it == nil {
				break
			}
			w := it.Value
			if f.r.bindingPending(w.att.Request().SessionKey) {
				// A relay that has just started: the session's binding
				// may be on its way from a peer relay (package peering).
				break
			}
			c, err := w.att.Pick()
			if err != nil && f.waitable(err) {
				break // no room for this model yet
			}
			if !f.q.Pop(it) {
				// The request left while we placed it.
				if err == nil {
					w.att.Report(c, scheduler.Outcome{Status: statusClientClosed})
				}
				continue
			}
			if err != nil {
				f.q.Done(w.fl.id, w.fl.cost) // nothing to serve: the error goes back
			}
			f.met.dispatched(f.q, it)
			w.done <- pickResult{c, err}
		}
	}
}

// waitable reports whether a Pick error means "wait for room": the
// candidates are full, or no agent has joined yet after a start.
func (f *fairQueue) waitable(err error) bool {
	var ue *scheduler.UnavailableError
	if errors.As(err, &ue) {
		return ue.Full
	}
	return errors.Is(err, scheduler.ErrUnknownModel) && f.holding()
}

// holding reports whether requests for models no agent serves yet should
// wait: no agent is routable, or the relay started moments ago.
func (f *fairQueue) holding() bool {
	return f.r.reg.routable() == 0 || f.r.cfg.Clock.Now().Sub(f.started) < restartWindow
}

// pick returns the Choice for the request's next attempt: at once when
// nothing waits for its model and the scheduler finds room, else after a
// wait in the queue. A request whose wait ends without room gets the
// overflow tier or a 429 (or, while no agent has joined, the scheduler's
// error); one whose client leaves gets errClientGone.
func (f *fairQueue) pick(req *http.Request, att *scheduler.Attempt, fl flowOf) (scheduler.Choice, error) {
	model := queueKey(att.Request())
	var waitErr error // why the request waits, when it tried
	if f.q.Waiting(model) == 0 {
		c, err := att.Pick()
		if err == nil {
			f.q.Serving(fl.id, fl.cost)
		}
		if err == nil || !f.waitable(err) {
			return c, err
		}
		waitErr = err
	}
	bound := f.r.cfg.QueueWait
	if errors.Is(waitErr, scheduler.ErrUnknownModel) {
		bound = min(bound, f.r.cfg.RestartHold) // no agent yet: a short hold
	}
	if d := clientTimeout(req); d > 0 {
		bound = min(bound, d/2)
	}
	w := &waiter{att: att, fl: fl, done: make(chan pickResult, 1)}
	it, err := f.q.Push(model, fl.id, fl.band, fl.weight, fl.cost, w)
	if err != nil {
		f.met.rejected(fl, "full")
		return scheduler.Choice{}, errQueueFull(f.retryAfter(model), err)
	}
	f.wake()
	timer := time.NewTimer(bound)
	defer timer.Stop()
	select {
	case res := <-w.done:
		return res.c, res.err
	case <-req.Context().Done():
		if f.q.Remove(it) {
			f.met.left(f.q, it)
			return scheduler.Choice{}, errClientGone
		}
		if res := <-w.done; res.err == nil {
			att.Report(res.c, scheduler.Outcome{Status: statusClientClosed})
			f.finished(fl)
		}
		return scheduler.Choice{}, errClientGone
	case <-timer.C:
		if !f.q.Remove(it) {
			res := <-w.done
			return res.c, res.err
		}
		f.met.left(f.q, it)
	}
	// Waited long enough: an overflow tier may take it now.
	att.StopWaiting()
	c, err := att.Pick()
	var ue *scheduler.UnavailableError
	switch {
	case err == nil:
		f.met.overflowed(fl)
		f.q.Serving(fl.id, fl.cost)
	case errors.As(err, &ue) && ue.Full:
		f.met.rejected(fl, "wait")
		err = errQueueWait(bound, f.retryAfter(model), err)
	}
	return c, err
}

// queueKey is the queue a request waits in: its model's, or a model's own
// line for requests only some endpoints may take (Request.Allow), so that
// such a request at the head does not hold up the others.
func queueKey(r scheduler.Request) string {
	if r.Allow != nil {
		return r.Model + "\x00allow"
	}
	return r.Model
}

// retryAfter estimates when a request pushed now would be dispatched.
func (f *fairQueue) retryAfter(model string) time.Duration {
	d := f.q.DrainInterval(model) * time.Duration(f.q.Waiting(model)+1)
	return min(max(d.Round(time.Second), time.Second), time.Minute)
}

// clientTimeout returns the timeout the client says it has, from
// X-Request-Timeout or the OpenAI SDKs' X-Stainless-Timeout (seconds);
// 0 when it says none.
func clientTimeout(req *http.Request) time.Duration {
	for _, h := range [...]string{"X-Request-Timeout", "X-Stainless-Timeout"} {
		v := req.Header.Get(h)
		if v == "" {
			continue
		}
		if s, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil && s > 0 && s < 1e6 {
			return time.Duration(s * float64(time.Second))
		}
	}
	return 0
}

// flowFor names the flow of a request of client c (nil without auth) with
// the routing rt and a body of n bytes.
func flowFor(req *http.Request, c *Client, rt routing, n int) flowOf {
	fl := flowOf{weight: 1, cost: expectedTokens(n, rt.maxTokens)}
	if c != nil {
		fl.id, fl.label, fl.weight, fl.band = c.Name, c.Name, c.Weight, c.Class
	} else {
		host, _, err := net.SplitHostPort(req.RemoteAddr)
		if err != nil {
			host = req.RemoteAddr
		}
		fl.id, fl.label = "ip-"+host, "anonymous"
	}
	switch rt.tier {
	case "flex":
		fl.band = scheduler.BandBatch
	case "priority":
		// A client the operator put in the batch class stays there.
	}
	return fl
}

// defaultAnswerTokens is the answer length assumed for a request that
// sets no bound.
const defaultAnswerTokens = 256

// expectedTokens estimates what a request of n body bytes will use of an
// engine: its prompt (about 4 bytes a token) and its answer (its bound,
// capped, else defaultAnswerTokens).
func expectedTokens(n, maxTokens int) float64 {
	answer := defaultAnswerTokens
	if maxTokens > 0 {
		answer = min(maxTokens, 4096)
	}
	return float64(n/4 + answer)
}

func errQueueFull(retryAfter time.Duration, err error) *Error {
	e := errRateLimited(retryAfter, err)
	e.Code = "queue_full"
	e.Message = "Too many requests are waiting for this model; retry later"
	return e
}

func errQueueWait(waited, retryAfter time.Duration, err error) *Error {
	e := errRateLimited(retryAfter, err)
	e.Code = "queue_timeout"
	e.Message = "Every agent serving this model stayed busy for " + waited.Round(time.Millisecond).String() + "; retry later"
	return e
}

// queueMetrics are the queue's Prometheus series, by client label (named
// clients and keys: bounded by the configuration) and class.
type queueMetrics struct {
	waitH      *prometheus.HistogramVec // by class
	dispatches *prometheus.CounterVec   // by client and class
	rejects    *prometheus.CounterVec   // by client, class and reason
	overflows  *prometheus.CounterVec   // by client and class
}

func newQueueMetrics(f *fairQueue) queueMetrics {
	m := queueMetrics{
		waitH: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "computeflux_queue_wait_seconds",
			Help:    "Time requests waited at the relay for an agent with room, by class (placed or not).",
			Buckets: latencyBuckets,
		}, []string{"class"}),
		dispatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_queue_dispatched_total",
			Help: "Requests that waited at the relay and were then placed, by client and class.",
		}, []string{"client", "class"}),
		rejects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_queue_rejected_total",
			Help: "Requests answered 429 by the queue, by client, class and reason (full: too many waiting; wait: waited the bound).",
		}, []string{"client", "class", "reason"}),
		overflows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_queue_overflowed_total",
			Help: "Requests that waited the bound and went to an overflow tier, by client and class.",
		}, []string{"client", "class"}),
	}
	waiting := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "computeflux_queue_waiting",
		Help: "Requests waiting at the relay for an agent with room.",
	}, func() float64 { return float64(f.q.Len()) })
	f.r.metrics.reg.MustRegister(m.waitH, m.dispatches, m.rejects, m.overflows, waiting)
	return m
}

func (m *queueMetrics) dispatched(q *scheduler.Queue[*waiter], it *scheduler.QueueItem[*waiter]) {
	fl := it.Value.fl
	m.dispatches.WithLabelValues(fl.label, fl.band.String()).Inc()
	m.left(q, it)
}

// left records a request's wait, whatever ended it.
func (m *queueMetrics) left(q *scheduler.Queue[*waiter], it *scheduler.QueueItem[*waiter]) {
	m.waitH.WithLabelValues(it.Band().String()).Observe(time.Since(q.Enqueued(it)).Seconds())
}

func (m *queueMetrics) rejected(fl flowOf, reason string) {
	m.rejects.WithLabelValues(fl.label, fl.band.String(), reason).Inc()
}

func (m *queueMetrics) overflowed(fl flowOf) {
	m.overflows.WithLabelValues(fl.label, fl.band.String()).Inc()
}

// PrefillBlocks turns a prefill limit in tokens (Config.PrefillLimit) into
// the prompt blocks of prefix that the scheduler counts; 0 (no limit) for
// a non-positive one.
func PrefillBlocks(tokens int, prefix scheduler.PrefixConfig) int {
	if tokens <= 0 {
		return 0
	}
	bt := cmp.Or(prefix.BlockTokens, scheduler.DefaultBlockTokens)
	return max(tokens/bt, 1)
}
