package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
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
	evPublish
)

// PublishDelay is how long a simulated agent's index update takes to reach
// the relay: it batches changes and sends them over its stream.
const PublishDelay = 100 * time.Millisecond

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
	// The agent's picture of its engine's cache, and the changes it has
	// not yet published to the relay.
	lru       *scheduler.BlockLRU
	deltas    []indexDelta
	publishAt bool // a publish event is on the calendar
	// The agent sizes its LRU from the engine's capacity in tokens and the
	// bytes per token it measures on its traffic (prompt text over the
	// engine's prompt_tokens), once it has seen calibrateAfter answers.
	sizedBytes, sizedTokens int64
	sizedN                  int
}

// calibrateAfter is how many answers an agent measures before it sizes its
// index from the bytes per token it saw.
const calibrateAfter = 32

// indexDelta is one change an agent publishes.
type indexDelta struct{ added, evicted []uint64 }

// simSession is a session's client state.
type simSession struct {
	turn   int
	tokens []simengine.Token
	hashes []simengine.BlockHash
	msgs   []message // what the client sends: the relay hashes it
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
	prefix     []uint64 // the relay's PromptBlocks of the request body
	predicted  int      // the agent index's prediction for prefix (BlockLRU.Insert)
	why        string   // why its last attempt failed
	// In the relay's queue (simqueue.go): its flow and cost, its item
	// while it waits, since when, and how many times it waited.
	flow     string
	cost     float64
	item     *scheduler.QueueItem[*simCall]
	waitFrom time.Time
	waits    uint64
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
	// index is set when agents publish their caches to the scheduler's
	// prefix index (the sticky policy).
	index bool
	// The relays' queues (simqueue.go): nil when the dispatch limit is
	// off. kick marks the relays whose dispatcher should look at its
	// queue, kicked any; waiters are the waiting requests by record.
	queues  []*scheduler.Queue[*simCall]
	kick    []bool
	kicked  bool
	waiters map[int]*simCall
	flows   []string // the queue's flow of each session (flowOf)
}

// runSim simulates one policy on w.
func runSim(ctx context.Context, cfg *Config, w *Workload, policy scheduler.Policy) (Result, error) {
	res, _, err := simulate(ctx, cfg, w, policy)
	return res, err
}

// simulate simulates one policy on w and returns its result and what each
// request measured.
func simulate(ctx context.Context, cfg *Config, w *Workload, policy scheduler.Policy) (Result, []record, error) {
	wall := time.Now()
	r := &simRun{
		cfg:   cfg,
		w:     w,
		clock: &vclock{t: time.Unix(1_000_000, 0)},
		sess:  make([]simSession, len(w.Sessions)),
		calls: make(map[uint64]*simCall),
	}
	r.start = r.clock.t
	r.index = policy == scheduler.PolicySticky
	sc := cfg.Scheduler
	sc.Policy, sc.Clock, sc.Seed = policy, r.clock, int64(cfg.Seed)|1
	var err error
	if r.sched, err = scheduler.New(sc); err != nil {
		return Result{}, nil, err
	}
	if err := r.newRelays(sc); err != nil {
		return Result{}, nil, err
	}
	if err := r.newQueues(); err != nil {
		return Result{}, nil, err
	}
	for i := range cfg.Engines {
		ec := cfg.Engine
		ec.Seed = cfg.Seed
		eng, err := simengine.NewEngine(ec)
		if err != nil {
			return Result{}, nil, err
		}
		e := &simEngine{id: engineName(i), eng: eng, flight: make(map[uint64]*simCall)}
		ecfg := eng.Config()
		e.lru = scheduler.NewBlockLRU(ecfg.CacheBlocks * ecfg.BlockSize / scheduler.DefaultBlockTokens)
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
			return Result{}, nil, ctx.Err()
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
		case evPublish:
			r.publish(ev.i)
		case evBind:
			r.deliver(ev.i)
		case evQueueWait:
			r.waitExpired(ev.i, ev.gen)
		}
		r.dispatch()
	}
	if err := r.checkDrained(); err != nil {
		return Result{}, nil, err
	}
	res := summarize(policy.String(), cfg.Scenario.String(), "sim", r.recs, len(r.engines))
	r.relayTraffic(&res, r.clock.t.Sub(r.start))
	dq := quantiles(r.decide)
	res.Decision = &Micros{P50: dq.P50 * 1000, P99: dq.P99 * 1000}
	res.Wall = time.Since(wall)
	return res, r.recs, nil
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
			s.Upsert(scheduler.Endpoint{ID: e.id, Models: []string{r.cfg.Model}, Capacity: r.cfg.dispatchLimit(), PrefillLimit: r.cfg.prefillLimit()})
			if r.index {
				// A joining agent publishes a snapshot to every relay;
				// deltas before it are superseded.
				s.IndexReset(e.id, e.lru.Snapshot(nil))
			}
		} else {
			s.Remove(e.id)
		}
	}
	for i := range r.queues {
		r.kickRelay(i) // room may have come
	}
}

// note queues an index change of engine i's agent for publication.
func (r *simRun) note(i int, added, evicted []uint64) {
	if !r.index || len(added)+len(evicted) == 0 {
		return
	}
	e := r.engines[i]
	e.deltas = append(e.deltas, indexDelta{added, evicted})
	if !e.publishAt {
		e.publishAt = true
		r.push(r.clock.t.Add(PublishDelay), evPublish, i, 0)
	}
}

// publish delivers engine i's queued index changes to the relay.
func (r *simRun) publish(i int) {
	e := r.engines[i]
	e.publishAt = false
	if !e.up {
		e.deltas = e.deltas[:0]
		return
	}
	for _, s := range r.everyScheduler() {
		for _, d := range e.deltas {
			s.IndexApply(e.id, d.added, d.evicted)
		}
	}
	clear(e.deltas)
	e.deltas = e.deltas[:0]
}

// requestPrefix is what the relay computes from the request body the
// client sends: PromptBlocks over the JSON, as the live bench sends it.
func (r *simRun) requestPrefix(msgs []message, maxTokens int) []uint64 {
	body := chatRequest{Model: r.cfg.Model, Messages: msgs, Stream: true, MaxTokens: maxTokens}
	body.StreamOptions.IncludeUsage = true
	b, err := json.Marshal(&body)
	if err != nil {
		return nil
	}
	return scheduler.PromptBlocks(nil, b, r.cfg.Prefix)
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
		q := simengine.Filler(t.QuestionSeed, t.QuestionTokens)
		s.tokens = simengine.Tokenize(s.tokens, q+imEnd+genPrompt)
		s.hashes = simengine.BlockHashes(s.hashes, s.tokens, bs)
		if s.turn == 0 && r.w.System != "" {
			s.msgs = append(s.msgs[:0], message{Role: "system", Content: r.w.System})
		}
		s.msgs = append(s.msgs, message{Role: "user", Content: q})
	} else {
		// Open loop: an earlier turn may still be in flight and holds
		// its own slices.
		s.msgs = []message{{Role: "user", Content: traceText(t.Blocks, t.InputTokens)}}
		s.tokens = simengine.Tokenize(nil, render(s.msgs))
		s.hashes = simengine.BlockHashes(nil, s.tokens, bs)
	}
	var prefix []uint64
	if r.cfg.prefixes {
		prefix = r.requestPrefix(s.msgs, t.MaxTokens)
	}
	r.sent++
	r.nextID++
	c := &simCall{
		sess: si, turn: s.turn, rec: len(r.recs), sent: now,
		req:    &simengine.Request{ID: r.nextID, Tokens: s.tokens, Hashes: s.hashes, MaxTokens: t.MaxTokens},
		prefix: prefix,
		// The relay's estimate: prompt and answer (relay/queue.go).
		cost: float64(len(s.tokens) + min(t.MaxTokens, 4096)),
	}
	if r.queues != nil {
		c.flow = r.flowOf(c)
	}
	r.begin(c, ws.Key)
	r.recs = append(r.recs, record{engine: -1})
	s.turn++
	if !r.w.Chat && s.turn < len(ws.Turns) {
		r.push(r.start.Add(ws.Turns[s.turn].At), evSend, si, 0)
	}
	r.pick(c)
}

// pick places c (a first try or a retry) and submits it to its engine:
// at once when nothing waits at its relay and the scheduler finds room,
// else after a wait in the relay's queue (simqueue.go).
func (r *simRun) pick(c *simCall) {
	q := r.queueOf(c)
	if c.why == "" {
		c.why = "retries exhausted"
	}
	for c.attempts < r.cfg.MaxAttempts {
		if q != nil && q.Waiting(r.cfg.Model) > 0 {
			r.wait(c) // it would take a waiting request's turn
			return
		}
		ch, err := r.choose(c)
		if err != nil {
			if q != nil && waitable(err) {
				r.wait(c)
			} else {
				r.fail(c, "no agent available")
			}
			return
		}
		if q != nil {
			q.Serving(c.flow, c.cost)
		}
		ok, retry := r.submit(c, ch)
		if ok {
			return
		}
		if !retry {
			break
		}
	}
	r.fail(c, c.why)
}

// choose asks the scheduler for c's next attempt, timing it.
func (r *simRun) choose(c *simCall) (scheduler.Choice, error) {
	t0 := time.Now()
	ch, err := c.att.Pick()
	c.decision += time.Since(t0)
	return ch, err
}

// submit hands c, placed at ch, to its engine. When the engine refuses
// it, the attempt is reported and submit says whether to try again.
func (r *simRun) submit(c *simCall, ch scheduler.Choice) (ok, retry bool) {
	now := r.clock.t
	c.attempts++
	c.choice, c.tried = ch, now
	c.eng = r.engineIndex(ch.EndpointID)
	e := r.engines[c.eng]
	err := e.eng.Submit(now, c.req)
	if err == nil {
		e.flight[c.req.ID] = c
		r.calls[c.req.ID] = c
		r.reschedule(c.eng)
		if r.index && len(c.prefix) > 0 {
			// The agent forwards the request: its engine will hold
			// the prompt.
			var added, evicted []uint64
			c.predicted, added, evicted = e.lru.Insert(c.prefix, nil, nil)
			r.note(c.eng, added, evicted)
		}
		return true, false
	}
	status := http.StatusServiceUnavailable // the engine's queue is full
	if !errors.Is(err, simengine.ErrQueueFull) {
		status = http.StatusBadRequest
	}
	c.why = err.Error()
	return false, r.report(c, scheduler.Outcome{Status: status}).Retryable()
}

// report hands c's outcome to the scheduler, timing it.
func (r *simRun) report(c *simCall, o scheduler.Outcome) scheduler.Class {
	t0 := time.Now()
	cl := c.att.Report(c.choice, o)
	c.decision += time.Since(t0)
	if cl == scheduler.ClassSuccess {
		r.shareSuccess(c)
	}
	r.finished(c) // a slot freed
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
		r.sess[c.sess].msgs = nil
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
			c.att.Started(c.choice) // the relay sees the first byte
			r.kickRelay(c.relay)    // its prefill left the agent's: room may have freed
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
			if r.index && len(c.prefix) > 0 {
				// The engine's usage corrects the agent's picture.
				n := scheduler.CachedBlocks(len(c.prefix), ev.Usage.PromptTokens, ev.Usage.CachedTokens)
				r.note(i, nil, e.lru.Correct(c.prefix, c.predicted, n, nil))
				if e.sizedN < calibrateAfter {
					e.sizedBytes += int64(len(c.prefix)) * int64(r.cfg.Prefix.BlockBytes())
					e.sizedTokens += int64(ev.Usage.PromptTokens)
					if e.sizedN++; e.sizedN == calibrateAfter && e.sizedTokens > 0 {
						ec := e.eng.Config()
						tokens := float64(ec.CacheBlocks * ec.BlockSize)
						blocks := tokens * float64(e.sizedBytes) / float64(e.sizedTokens) / float64(r.cfg.Prefix.BlockBytes())
						r.note(i, nil, e.lru.SetCapacity(int(blocks), nil))
					}
				}
			}
			s := &r.sess[c.sess]
			ws := &r.w.Sessions[c.sess]
			if r.w.Chat {
				if r.cfg.prefixes {
					s.msgs = append(s.msgs, message{Role: "assistant", Content: strings.Join(e.eng.AnswerText(c.req), "")})
				}
				s.tokens = append(s.tokens, ev.Output...)
				if s.turn < len(ws.Turns) {
					r.push(ev.At.Add(ws.Turns[s.turn].Think), evSend, c.sess, 0)
				} else {
					s.tokens, s.hashes, s.msgs = nil, nil, nil
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
