package bench

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/scheduler"
)

// vclock is the simulation's virtual clock, read by the scheduler.
type vclock struct{ t time.Time }

func (c *vclock) Now() time.Time { return c.t }

// errAgentGone is what a request in flight on a killed agent sees.
var errAgentGone = errors.New("agent connection closed")

// simEvent is one entry of the simulation's calendar.
type simEvent struct {
	at   time.Time
	seq  uint64 // insertion order breaks ties: FIFO among equal times
	kind uint8
	i    int    // session (evSend) or engine (evEngine) or action index
	gen  uint64 // evEngine: the engine's generation when scheduled
}

const (
	evSend uint8 = iota
	evEngine
	evAction
)

// simQueue is a binary min-heap of events by (at, seq), typed to avoid
// boxing every event in an interface.
type simQueue []simEvent

func (q simQueue) less(i, j int) bool {
	if !q[i].at.Equal(q[j].at) {
		return q[i].at.Before(q[j].at)
	}
	return q[i].seq < q[j].seq
}

func (q *simQueue) push(e simEvent) {
	*q = append(*q, e)
	h := *q
	for i := len(h) - 1; i > 0; {
		p := (i - 1) / 2
		if !h.less(i, p) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
}

func (q *simQueue) pop() simEvent {
	h := *q
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h = h[:n]
	for i := 0; ; {
		l, m := 2*i+1, i
		if l < n && h.less(l, m) {
			m = l
		}
		if r := l + 1; r < n && h.less(r, m) {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	*q = h
	return top
}

// simEngine is one engine and its agent in the simulation.
type simEngine struct {
	id     string
	eng    *simengine.Engine
	gen    uint64
	up     bool                // registered with the scheduler
	flight map[uint64]*simCall // requests on it by engine request ID
}

// simSession is a session's client state.
type simSession struct {
	turn   int
	tokens []simengine.Token
	hashes []simengine.BlockHash
	done   bool
}

// simCall is one request in flight.
type simCall struct {
	sess, turn int
	rec        int // index into records
	att        *scheduler.Attempt
	relay      int // which relay took the request (Config.Relays)
	choice     scheduler.Choice
	eng        int
	req        *simengine.Request
	sent       time.Time // client send time
	tried      time.Time // this attempt's start
	attempts   int
	first      bool
	firstAt    time.Time
	decision   time.Duration
}

// simRun is one policy's discrete-event simulation.
type simRun struct {
	cfg     *Config
	w       *Workload
	clock   *vclock
	start   time.Time
	sched   *scheduler.Scheduler
	relays  *simRelays // nil with one relay (relays.go)
	engines []*simEngine
	q       simQueue
	seq     uint64
	sess    []simSession
	recs    []record
	calls   map[uint64]*simCall // by engine request ID
	nextID  uint64
	actions []action
	byID    map[string]int
	sent    int
	evBuf   []simengine.Event
	decide  []time.Duration
	// sysTokens is the tokenized system prompt and first "user" header,
	// shared by all chat sessions' first turns.
	sysTokens []simengine.Token
}

// runSim simulates one policy on w.
func runSim(ctx context.Context, cfg *Config, w *Workload, policy scheduler.Policy) (Result, error) {
	wall := time.Now()
	r := &simRun{
		cfg:   cfg,
		w:     w,
		clock: &vclock{t: time.Unix(1_000_000, 0)},
		sess:  make([]simSession, len(w.Sessions)),
		calls: make(map[uint64]*simCall),
	}
	r.start = r.clock.t
	sc := cfg.Scheduler
	sc.Policy, sc.Clock, sc.Seed = policy, r.clock, int64(cfg.Seed)|1
	var err error
	if r.sched, err = scheduler.New(sc); err != nil {
		return Result{}, err
	}
	if err := r.newRelays(sc); err != nil {
		return Result{}, err
	}
	for i := range cfg.Engines {
		ec := cfg.Engine
		ec.Seed = cfg.Seed
		eng, err := simengine.NewEngine(ec)
		if err != nil {
			return Result{}, err
		}
		e := &simEngine{id: engineName(i), eng: eng, flight: make(map[uint64]*simCall)}
		r.engines = append(r.engines, e)
	}
	r.byID = make(map[string]int, len(r.engines))
	for i, e := range r.engines {
		r.byID[e.id] = i
	}
	r.actions = scenarioActions(cfg.Scenario, w, cfg.Engines)
	for i := range r.engines {
		if !(cfg.Scenario == ScenarioJoin && i == len(r.engines)-1) {
			r.setUp(i, true)
		}
	}
	if w.Chat {
		r.sysTokens = simengine.Tokenize(nil, imStart+"system\n"+w.System+imEnd+imStart+"user\n")
		if w.System == "" {
			r.sysTokens = simengine.Tokenize(nil, imStart+"user\n")
		}
	}
	for i, s := range w.Sessions {
		at := s.Start
		if !w.Chat && len(s.Turns) > 0 {
			at = s.Turns[0].At
		}
		r.push(r.start.Add(at), evSend, i, 0)
	}
	for i, a := range r.actions {
		r.push(r.start.Add(a.at), evAction, i, 0)
	}

	for steps := 0; len(r.q) > 0; steps++ {
		if steps%65536 == 0 && ctx.Err() != nil {
			return Result{}, ctx.Err()
		}
		ev := r.q.pop()
		if ev.at.After(r.clock.t) {
			r.clock.t = ev.at
		}
		switch ev.kind {
		case evSend:
			r.send(ev.i)
		case evAction:
			r.act(r.actions[ev.i])
		case evEngine:
			if e := r.engines[ev.i]; ev.gen == e.gen {
				r.advance(ev.i)
			}
		case evBind:
			r.deliver(ev.i)
		}
	}
	if err := r.checkDrained(); err != nil {
		return Result{}, err
	}
	res := summarize(policy.String(), cfg.Scenario.String(), "sim", r.recs, len(r.engines))
	r.relayTraffic(&res, r.clock.t.Sub(r.start))
	dq := quantiles(r.decide)
	res.Decision = &Micros{P50: dq.P50 * 1000, P99: dq.P99 * 1000}
	res.Wall = time.Since(wall)
	return res, nil
}

func (r *simRun) push(at time.Time, kind uint8, i int, gen uint64) {
	r.seq++
	r.q.push(simEvent{at: at, seq: r.seq, kind: kind, i: i, gen: gen})
}

// reschedule puts engine i's next event on the calendar.
func (r *simRun) reschedule(i int) {
	e := r.engines[i]
	e.gen++
	if at, ok := e.eng.Next(); ok {
		r.push(at, evEngine, i, e.gen)
	}
}

// setUp registers engine i with the scheduler (its agent joined) or
// removes it (its agent left).
func (r *simRun) setUp(i int, up bool) {
	e := r.engines[i]
	e.up = up
	for _, s := range r.everyScheduler() {
		if up {
			s.Upsert(scheduler.Endpoint{ID: e.id, Models: []string{r.cfg.Model}, Capacity: r.cfg.Capacity})
		} else {
			s.Remove(e.id)
		}
	}
}

// act applies a scenario action.
func (r *simRun) act(a action) {
	now := r.clock.t
	switch a.kind {
	case actSlow:
		_ = r.engines[a.engine].eng.SetSlowdown(now, a.factor)
		r.reschedule(a.engine)
	case actKill:
		// The relay sees the agent's connection close: the join stream
		// ends (the agent leaves) and every stream in flight breaks.
		e := r.engines[a.engine]
		r.setUp(a.engine, false)
		calls := make([]*simCall, 0, len(e.flight))
		for id, c := range e.flight {
			e.eng.Cancel(now, id)
			calls = append(calls, c)
		}
		clear(e.flight)
		r.reschedule(a.engine)
		// Deterministic order: by request ID.
		sortCalls(calls)
		for _, c := range calls {
			delete(r.calls, c.req.ID)
			r.report(c, scheduler.Outcome{Err: errAgentGone, Latency: now.Sub(c.tried)})
			if c.first {
				r.fail(c, "stream broke: agent gone") // the client sees an error
			} else {
				r.pick(c) // the relay retries before the first byte
			}
		}
	case actRestart, actJoin:
		r.setUp(a.engine, true)
	}
}

// send starts turn sess's next turn.
func (r *simRun) send(si int) {
	s := &r.sess[si]
	ws := &r.w.Sessions[si]
	now := r.clock.t
	if s.done || s.turn >= len(ws.Turns) ||
		(r.cfg.MaxRequests > 0 && r.sent >= r.cfg.MaxRequests) ||
		(r.cfg.Duration > 0 && now.Sub(r.start) > r.cfg.Duration) {
		s.done = true
		return
	}
	t := &ws.Turns[s.turn]
	bs := r.cfg.Engine.BlockSize
	if r.w.Chat {
		if s.turn == 0 {
			// Allocate the session's whole history at once: growing it
			// turn by turn copies it again and again.
			n := len(r.sysTokens)
			for _, t := range ws.Turns {
				n += t.QuestionTokens + t.MaxTokens + 2*templateTokens
			}
			s.tokens = append(make([]simengine.Token, 0, n), r.sysTokens...)
			s.hashes = make([]simengine.BlockHash, 0, n/bs+1)
		} else {
			s.tokens = simengine.Tokenize(s.tokens, imEnd+imStart+"user\n")
		}
		s.tokens = simengine.Tokenize(s.tokens, simengine.Filler(t.QuestionSeed, t.QuestionTokens)+imEnd+genPrompt)
		s.hashes = simengine.BlockHashes(s.hashes, s.tokens, bs)
	} else {
		// Open loop: an earlier turn may still be in flight and holds
		// its own slices.
		s.tokens = simengine.Tokenize(nil, render([]message{{Role: "user", Content: traceText(t.Blocks, t.InputTokens)}}))
		s.hashes = simengine.BlockHashes(nil, s.tokens, bs)
	}
	r.sent++
	r.nextID++
	c := &simCall{
		sess: si, turn: s.turn, rec: len(r.recs), sent: now,
		req: &simengine.Request{ID: r.nextID, Tokens: s.tokens, Hashes: s.hashes, MaxTokens: t.MaxTokens},
	}
	key := ws.Key
	if r.cfg.Keyless {
		key = ""
	}
	r.begin(c, key)
	r.recs = append(r.recs, record{engine: -1})
	s.turn++
	if !r.w.Chat && s.turn < len(ws.Turns) {
		r.push(r.start.Add(ws.Turns[s.turn].At), evSend, si, 0)
	}
	r.pick(c)
}

// pick places c (a first try or a retry) and submits it to its engine.
func (r *simRun) pick(c *simCall) {
	now := r.clock.t
	why := "retries exhausted"
	for c.attempts < r.cfg.MaxAttempts {
		t0 := time.Now()
		ch, err := c.att.Pick()
		c.decision += time.Since(t0)
		if err != nil {
			r.fail(c, "no agent available")
			return
		}
		c.attempts++
		c.choice, c.tried = ch, now
		c.eng = r.engineIndex(ch.EndpointID)
		e := r.engines[c.eng]
		err = e.eng.Submit(now, c.req)
		if err == nil {
			e.flight[c.req.ID] = c
			r.calls[c.req.ID] = c
			r.reschedule(c.eng)
			return
		}
		status := http.StatusServiceUnavailable // the engine's queue is full
		if !errors.Is(err, simengine.ErrQueueFull) {
			status = http.StatusBadRequest
		}
		why = err.Error()
		if !r.report(c, scheduler.Outcome{Status: status}).Retryable() {
			break
		}
	}
	r.fail(c, why)
}

// report hands c's outcome to the scheduler, timing it.
func (r *simRun) report(c *simCall, o scheduler.Outcome) scheduler.Class {
	t0 := time.Now()
	cl := c.att.Report(c.choice, o)
	c.decision += time.Since(t0)
	if cl == scheduler.ClassSuccess {
		r.shareSuccess(c)
	}
	return cl
}

// fail ends c as an error; a chat client gives up on the session.
func (r *simRun) fail(c *simCall, why string) {
	r.recs[c.rec].failed = true
	r.recs[c.rec].why = why
	r.decide = append(r.decide, c.decision)
	if r.w.Chat {
		r.sess[c.sess].done = true
		r.sess[c.sess].tokens = nil
		r.sess[c.sess].hashes = nil
	}
}

// advance collects engine i's events at the current time.
func (r *simRun) advance(i int) {
	e := r.engines[i]
	now := r.clock.t
	r.evBuf = e.eng.Advance(now, r.evBuf[:0])
	for _, ev := range r.evBuf {
		c := r.calls[ev.ID]
		if c == nil {
			continue
		}
		rec := &r.recs[c.rec]
		switch ev.Kind {
		case simengine.EventFirstToken:
			c.first, c.firstAt = true, ev.At
			rec.ttft = ev.At.Sub(c.sent)
			rec.first = c.sent.Sub(r.start)
		case simengine.EventDone:
			delete(r.calls, ev.ID)
			delete(e.flight, ev.ID)
			r.report(c, scheduler.Outcome{Status: http.StatusOK, Latency: c.firstAt.Sub(c.tried)})
			r.decide = append(r.decide, c.decision)
			rec.e2e = ev.At.Sub(c.sent)
			rec.done = ev.At.Sub(r.start)
			rec.prompt, rec.cached, rec.completion = ev.Usage.PromptTokens, ev.Usage.CachedTokens, ev.Usage.CompletionTokens
			rec.engine = i
			s := &r.sess[c.sess]
			ws := &r.w.Sessions[c.sess]
			if r.w.Chat {
				s.tokens = append(s.tokens, ev.Output...)
				if s.turn < len(ws.Turns) {
					r.push(ev.At.Add(ws.Turns[s.turn].Think), evSend, c.sess, 0)
				} else {
					s.tokens, s.hashes = nil, nil
				}
			}
		}
	}
	r.reschedule(i)
}

func (r *simRun) engineIndex(id string) int {
	n, ok := r.byID[id]
	if !ok {
		panic("bench: unknown engine " + id)
	}
	return n
}

func sortCalls(cs []*simCall) {
	for i := 1; i < len(cs); i++ {
		for j := i; j > 0 && cs[j].req.ID < cs[j-1].req.ID; j-- {
			cs[j], cs[j-1] = cs[j-1], cs[j]
		}
	}
}

// engineName is the scheduler endpoint (agent) name of engine i.
func engineName(i int) string { return fmt.Sprintf("engine-%d", i) }
