package scheduler

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"
)

// The fair queue.
//
// When no endpoint has room for a request, the request waits in a Queue
// instead of joining an engine's first-come queue. The Queue decides the
// order in which waiting requests are dispatched; the Scheduler still
// decides where each one goes. Requests are grouped by model (endpoints
// serve models, so a free slot serves the waiting requests of its models),
// then by band (interactive before batch), then by flow (a client).
//
// Within a band the order is self-clocked fair queuing (Golestani, SCFQ)
// by cost: a request of flow f with weight w and cost c gets the start tag
// S = max(V + U_f/w, F_f) and the finish tag F_f = S + c/w, where V is the
// finish tag of the request dispatched last, F_f the finish tag of f's
// previous request and U_f the cost of f's requests being served now (so
// a client already using the fleet waits behind one that is not, even
// when neither has waited before); the request with the smallest finish
// tag goes first. The cost is
// what the request will use of an engine (its prompt and expected answer,
// in tokens), so a client sending long requests gets fewer of them, and two
// clients that both keep requests waiting share the dispatches in the ratio
// of their weights, measured in tokens. Ordering by finish tag serves the
// shorter of two new clients' requests first, and lets a long one wait no
// longer than it takes to dispatch about its own cost of others' work (V
// moves on with every dispatch): under a backlog, more first tokens come
// sooner, and none waits without bound. It is work conserving: a flow
// alone gets every free slot, and a flow that falls idle keeps no credit
// (its next request starts at V) and no debt beyond its own requests.
//
// Between bands, interactive requests go first, except that while both
// wait, every BatchEvery-th dispatch goes to the batch band: batch work is
// slowed, never starved.

// Band is a request's priority class. The zero value is BandInteractive.
type Band uint8

const (
	// BandInteractive is for requests a person waits on.
	BandInteractive Band = iota
	// BandBatch is for work that can wait: it is dispatched while
	// interactive requests wait only every QueueConfig.BatchEvery-th time.
	BandBatch
	numBands
)

// String returns "interactive" or "batch".
func (b Band) String() string {
	if b == BandBatch {
		return "batch"
	}
	return "interactive"
}

// ParseBand parses "interactive" or "batch".
func ParseBand(s string) (Band, error) {
	switch s {
	case "interactive":
		return BandInteractive, nil
	case "batch":
		return BandBatch, nil
	}
	return 0, fmt.Errorf("unknown class %q (want interactive or batch)", s)
}

// Defaults for the zero values of QueueConfig.
const (
	// DefaultMaxQueued bounds the requests waiting in a Queue in all.
	DefaultMaxQueued = 8192
	// DefaultMaxQueuedPerFlow bounds one flow's waiting requests: a
	// quarter of the total, so that one client serving many users of its
	// own (an application behind one key) may keep a fleet of several
	// 256-sequence engines busy, and still leaves room for three others.
	DefaultMaxQueuedPerFlow = 2048
	// DefaultBatchEvery gives the batch band one dispatch in 10 while
	// interactive requests wait.
	DefaultBatchEvery = 10
)

// QueueConfig configures a Queue. The zero value of every field means its
// default.
type QueueConfig struct {
	// MaxQueued bounds the requests waiting in all. Zero means
	// DefaultMaxQueued.
	MaxQueued int
	// MaxQueuedPerFlow bounds the requests one flow may have waiting (for
	// one model). Zero means DefaultMaxQueuedPerFlow.
	MaxQueuedPerFlow int
	// BatchEvery: while both bands of a model have requests waiting, every
	// BatchEvery-th dispatch takes a batch request. Zero means
	// DefaultBatchEvery; 2 alternates the bands.
	BatchEvery int
	// Clock supplies the time (wait times, the drain rate). Nil means the
	// real clock.
	Clock Clock
}

func (c QueueConfig) populate() QueueConfig {
	if c.MaxQueued == 0 {
		c.MaxQueued = DefaultMaxQueued
	}
	if c.MaxQueuedPerFlow == 0 {
		c.MaxQueuedPerFlow = DefaultMaxQueuedPerFlow
	}
	if c.BatchEvery == 0 {
		c.BatchEvery = DefaultBatchEvery
	}
	if c.Clock == nil {
		c.Clock = realClock{}
	}
	return c
}

func (c QueueConfig) validate() error {
	var errs []error
	if c.MaxQueued < 0 {
		errs = append(errs, fmt.Errorf("MaxQueued must not be negative, got %d", c.MaxQueued))
	}
	if c.MaxQueuedPerFlow < 0 {
		errs = append(errs, fmt.Errorf("MaxQueuedPerFlow must not be negative, got %d", c.MaxQueuedPerFlow))
	}
	if c.BatchEvery < 2 {
		errs = append(errs, fmt.Errorf("BatchEvery must be at least 2, got %d", c.BatchEvery))
	}
	if len(errs) > 0 {
		return fmt.Errorf("scheduler: invalid queue config: %w", errors.Join(errs...))
	}
	return nil
}

// ErrQueueFull matches (with errors.Is) every *QueueFullError.
var ErrQueueFull = errors.New("scheduler: queue full")

// QueueFullError is returned by Push when the request may not wait.
type QueueFullError struct {
	// PerFlow is true when the flow's own bound was reached, false when
	// the queue's bound in all was.
	PerFlow bool
	// Limit is the bound reached.
	Limit int
}

// Error describes the condition.
func (e *QueueFullError) Error() string {
	if e.PerFlow {
		return fmt.Sprintf("scheduler: this client already has %d requests waiting", e.Limit)
	}
	return fmt.Sprintf("scheduler: %d requests are already waiting", e.Limit)
}

// Is makes errors.Is(err, ErrQueueFull) true.
func (e *QueueFullError) Is(target error) bool { return target == ErrQueueFull }

// Queue holds waiting requests, each carrying a value of type T for its
// owner (such as the channel its goroutine waits on), and hands them out
// in fair order. It is safe for concurrent use; one mutex guards it, and no
// method blocks.
type Queue[T any] struct {
	cfg   QueueConfig
	epoch time.Time

	mu     sync.Mutex // guards the following fields and every item, flow and model
	models map[string]*queueModel[T]
	queued int
	// serving is the cost of each flow's requests in service (Serving
	// or Pop, until Done); flows at zero are dropped.
	serving map[string]*inService
}

type inService struct {
	n    int
	cost float64
}

// queueModel is the waiting requests of one model, kept while any wait.
type queueModel[T any] struct {
	name       string
	bands      [numBands]queueBand[T]
	queued     int
	sinceBatch int // interactive dispatches since the last batch one while batch waited
	// The drain rate: a moving average of the time between dispatches.
	lastDispatch int64   // ns since epoch; 0 before the first
	interval     float64 // ns; 0 until two dispatches
}

// queueBand is one band of a model: its flows and virtual time.
type queueBand[T any] struct {
	v     float64 // the finish tag of the request dispatched last
	flows map[string]*queueFlow[T]
	heap  []*queueFlow[T] // flows with requests waiting, by their head's finish tag
	seq   uint64          // order of arrival, the last tie-break
}

// queueFlow is one flow's requests waiting in one band, oldest first.
type queueFlow[T any] struct {
	id         string
	finish     float64 // finish tag of its last request pushed
	head, tail *QueueItem[T]
	n          int
	hi         int // index in the band's heap; -1 when it has nothing waiting
}

// QueueItem is one waiting request. Its Value belongs to the caller.
type QueueItem[T any] struct {
	// Value is the caller's, set by Push.
	Value T

	model         *queueModel[T]
	band          Band
	flow          *queueFlow[T]
	start, finish float64
	cost          float64
	seq           uint64
	enqueued      int64
	prev, next    *QueueItem[T]
	waiting       bool
}

// Band returns the band the item waits in.
func (it *QueueItem[T]) Band() Band { return it.band }

// Flow returns the flow the item was pushed for.
func (it *QueueItem[T]) Flow() string { return it.flow.id }

// NewQueue returns an empty Queue.
func NewQueue[T any](cfg QueueConfig) (*Queue[T], error) {
	cfg = cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Queue[T]{cfg: cfg, epoch: cfg.Clock.Now(), models: make(map[string]*queueModel[T]),
		serving: make(map[string]*inService)}, nil
}

func (q *Queue[T]) now() int64 { return int64(q.cfg.Clock.Now().Sub(q.epoch)) }

// Waiting returns how many requests for model are waiting. A request that
// finds none may be dispatched at once without taking anyone's turn.
func (q *Queue[T]) Waiting(model string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	if m := q.models[model]; m != nil {
		return m.queued
	}
	return 0
}

// Len returns how many requests are waiting in all.
func (q *Queue[T]) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.queued
}

// Serving records that a request of flow of cost went into service without
// waiting. Done must follow when it ends.
func (q *Queue[T]) Serving(flow string, cost float64) {
	cost = validCost(cost)
	q.mu.Lock()
	q.servingLocked(flow, cost)
	q.mu.Unlock()
}

func (q *Queue[T]) servingLocked(flow string, cost float64) {
	s := q.serving[flow]
	if s == nil {
		s = &inService{}
		q.serving[flow] = s
	}
	s.n++
	s.cost += cost
}

// Done records that a request of flow of cost, in service since Serving or
// Pop, ended.
func (q *Queue[T]) Done(flow string, cost float64) {
	cost = validCost(cost)
	q.mu.Lock()
	defer q.mu.Unlock()
	s := q.serving[flow]
	if s == nil {
		return
	}
	if s.n--; s.n <= 0 {
		delete(q.serving, flow)
		return
	}
	s.cost = max(s.cost-cost, 0)
}

// InService returns the number of requests of flow in service.
func (q *Queue[T]) InService(flow string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	if s := q.serving[flow]; s != nil {
		return s.n
	}
	return 0
}

func validCost(c float64) float64 {
	if !(c > 0) || math.IsInf(c, 0) {
		return 1
	}
	return c
}

// Push adds a request of flow for model to band. weight is the flow's share
// (non-positive or non-finite means 1) and cost what the request will use
// (non-positive means 1). It fails with a *QueueFullError when the queue or
// the flow is at its bound.
func (q *Queue[T]) Push(model, flow string, band Band, weight, cost float64, v T) (*QueueItem[T], error) {
	if !(weight > 0) || math.IsInf(weight, 0) {
		weight = 1
	}
	cost = validCost(cost)
	band = min(band, numBands-1)
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.queued >= q.cfg.MaxQueued {
		return nil, &QueueFullError{Limit: q.cfg.MaxQueued}
	}
	m := q.models[model]
	if m == nil {
		m = &queueModel[T]{name: model}
		q.models[model] = m
	}
	b := &m.bands[band]
	if b.flows == nil {
		b.flows = make(map[string]*queueFlow[T])
	}
	f := b.flows[flow]
	if f == nil {
		b.pruneIdle(q.cfg.MaxQueued)
		f = &queueFlow[T]{id: flow, hi: -1}
		b.flows[flow] = f
	}
	if f.n >= q.cfg.MaxQueuedPerFlow {
		return nil, &QueueFullError{PerFlow: true, Limit: q.cfg.MaxQueuedPerFlow}
	}
	b.seq++
	it := &QueueItem[T]{Value: v, model: m, band: band, flow: f, cost: cost, seq: b.seq, enqueued: q.now(), waiting: true}
	v0 := b.v
	if s := q.serving[flow]; s != nil {
		v0 += s.cost / weight
	}
	it.start = max(v0, f.finish)
	it.finish = it.start + cost/weight
	f.finish = it.finish
	if f.tail == nil {
		f.head, f.tail = it, it
	} else {
		it.prev, f.tail.next, f.tail = f.tail, it, it
	}
	f.n++
	if f.hi < 0 {
		b.heapPush(f)
	}
	m.queued++
	q.queued++
	return it, nil
}

// Peek returns the request of model to dispatch next, or nil when none
// waits. It does not remove it: the caller tries to place it, and calls
// Pop once it is placed.
func (q *Queue[T]) Peek(model string) *QueueItem[T] {
	q.mu.Lock()
	defer q.mu.Unlock()
	m := q.models[model]
	if m == nil {
		return nil
	}
	return m.next(q.cfg.BatchEvery)
}

// next returns the head of the band whose turn it is.
func (m *queueModel[T]) next(batchEvery int) *QueueItem[T] {
	ih, bh := m.bands[BandInteractive].head(), m.bands[BandBatch].head()
	switch {
	case ih == nil:
		return bh
	case bh == nil || m.sinceBatch < batchEvery-1:
		return ih
	}
	return bh
}

// Pop removes a dispatched request and records it in service (Done must
// follow when it ends). It reports false when it was no longer waiting
// (already popped or removed).
func (q *Queue[T]) Pop(it *QueueItem[T]) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !it.waiting {
		return false
	}
	m := it.model
	b := &m.bands[it.band]
	b.v = max(b.v, it.finish)
	if it.band == BandBatch {
		m.sinceBatch = 0
	} else if m.bands[BandBatch].head() != nil {
		m.sinceBatch++
	}
	now := q.now()
	if m.lastDispatch > 0 {
		const alpha = 0.2
		d := float64(now - m.lastDispatch)
		if m.interval == 0 {
			m.interval = d
		} else {
			m.interval = (1-alpha)*m.interval + alpha*d
		}
	}
	m.lastDispatch = max(now, 1)
	q.servingLocked(it.flow.id, it.cost)
	q.unlink(it, false)
	return true
}

// Remove takes a request out without dispatching it (its client left, or
// it waited too long). Its flow's later requests move up by its cost. It
// reports false when the request was no longer waiting: it was popped, and
// its owner holds a dispatch it must use or give back.
func (q *Queue[T]) Remove(it *QueueItem[T]) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !it.waiting {
		return false
	}
	q.unlink(it, true)
	return true
}

// unlink takes it out of its flow and the counts. refund gives its cost
// back to the flow's later requests.
func (q *Queue[T]) unlink(it *QueueItem[T], refund bool) {
	f, m := it.flow, it.model
	b := &m.bands[it.band]
	wasHead := f.head == it
	if refund {
		d := it.finish - it.start
		for x := it.next; x != nil; x = x.next {
			x.start -= d
			x.finish -= d
		}
		f.finish -= d
		if it.next == nil {
			f.finish = it.start
		}
	}
	if it.prev != nil {
		it.prev.next = it.next
	} else {
		f.head = it.next
	}
	if it.next != nil {
		it.next.prev = it.prev
	} else {
		f.tail = it.prev
	}
	it.prev, it.next, it.waiting = nil, nil, false
	f.n--
	m.queued--
	q.queued--
	switch {
	case f.n == 0:
		b.heapRemove(f)
		if f.finish <= b.v {
			delete(b.flows, f.id) // nothing to remember: its next request starts at V
		}
	case wasHead:
		b.heapFix(f.hi)
	}
	if len(b.heap) == 0 {
		// The band is idle: no flow keeps credit or debt.
		clear(b.flows)
	}
	if m.queued == 0 {
		// Its busy period is over; the next one measures its own drain
		// rate. Models come and go with clients' requests: none is kept
		// idle.
		delete(q.models, m.name)
	}
}

// Enqueued returns when it was pushed.
func (q *Queue[T]) Enqueued(it *QueueItem[T]) time.Time {
	return q.epoch.Add(time.Duration(it.enqueued))
}

// DrainInterval returns the recent mean time between dispatches of model,
// or 0 when not known yet. The time until a request pushed now is
// dispatched is about the number waiting ahead of it times this.
func (q *Queue[T]) DrainInterval(model string) time.Duration {
	q.mu.Lock()
	defer q.mu.Unlock()
	if m := q.models[model]; m != nil {
		return time.Duration(m.interval)
	}
	return 0
}

// Models returns the models with requests waiting, sorted.
func (q *Queue[T]) Models() []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := make([]string, 0, len(q.models))
	for name, m := range q.models {
		if m.queued > 0 {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// QueueFlowStatus is one flow's waiting requests in a QueueSnapshot.
type QueueFlowStatus struct {
	Model  string
	Band   Band
	Flow   string
	Queued int
	// OldestWait is how long its oldest request has waited.
	OldestWait time.Duration
}

// Snapshot returns every flow with requests waiting, by model, band and
// flow.
func (q *Queue[T]) Snapshot() []QueueFlowStatus {
	q.mu.Lock()
	defer q.mu.Unlock()
	now := q.now()
	var out []QueueFlowStatus
	for _, m := range q.models {
		for bi := range m.bands {
			for _, f := range m.bands[bi].heap {
				out = append(out, QueueFlowStatus{Model: m.name, Band: Band(bi), Flow: f.id, Queued: f.n,
					OldestWait: time.Duration(now - f.head.enqueued)})
			}
		}
	}
	slices.SortFunc(out, func(a, b QueueFlowStatus) int {
		if c := cmpString(a.Model, b.Model); c != 0 {
			return c
		}
		if a.Band != b.Band {
			return int(a.Band) - int(b.Band)
		}
		return cmpString(a.Flow, b.Flow)
	})
	return out
}

// pruneIdle bounds the flows a band remembers with nothing waiting (those
// whose finish tag is ahead of V), dropping them once there are more than
// limit: such a flow forgets its debt, no more.
func (b *queueBand[T]) pruneIdle(limit int) {
	if len(b.flows) < 2*limit {
		return
	}
	for id, f := range b.flows {
		if f.n == 0 {
			delete(b.flows, id)
		}
	}
}

func (b *queueBand[T]) head() *QueueItem[T] {
	if len(b.heap) == 0 {
		return nil
	}
	return b.heap[0].head
}

// The heap of flows by their head's finish tag, then start tag, then
// arrival.

func (b *queueBand[T]) less(i, j int) bool {
	x, y := b.heap[i].head, b.heap[j].head
	if x.finish != y.finish {
		return x.finish < y.finish
	}
	if x.start != y.start {
		return x.start < y.start
	}
	return x.seq < y.seq
}

func (b *queueBand[T]) swap(i, j int) {
	b.heap[i], b.heap[j] = b.heap[j], b.heap[i]
	b.heap[i].hi, b.heap[j].hi = i, j
}

func (b *queueBand[T]) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !b.less(i, p) {
			return
		}
		b.swap(i, p)
		i = p
	}
}

func (b *queueBand[T]) down(i int) bool {
	i0, n := i, len(b.heap)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		j := l
		if r := l + 1; r < n && b.less(r, l) {
			j = r
		}
		if !b.less(j, i) {
			break
		}
		b.swap(i, j)
		i = j
	}
	return i > i0
}

func (b *queueBand[T]) heapPush(f *queueFlow[T]) {
	f.hi = len(b.heap)
	b.heap = append(b.heap, f)
	b.up(f.hi)
}

func (b *queueBand[T]) heapFix(i int) {
	if !b.down(i) {
		b.up(i)
	}
}

func (b *queueBand[T]) heapRemove(f *queueFlow[T]) {
	i, n := f.hi, len(b.heap)-1
	if i != n {
		b.swap(i, n)
	}
	b.heap[n] = nil
	b.heap = b.heap[:n]
	if i != n {
		b.heapFix(i)
	}
	f.hi = -1
}
