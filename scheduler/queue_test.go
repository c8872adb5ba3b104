package scheduler

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

func newTestQueue(t testing.TB, cfg QueueConfig) (*Queue[int], *fakeClock) {
	t.Helper()
	clk := newFakeClock()
	cfg.Clock = clk
	q, err := NewQueue[int](cfg)
	if err != nil {
		t.Fatal(err)
	}
	return q, clk
}

// drain dispatches every waiting request of model in the queue's order and
// returns their values.
func drain(q *Queue[int], model string) []int {
	var out []int
	for it := q.Peek(model); it != nil; it = q.Peek(model) {
		if !q.Pop(it) {
			panic("peeked item not waiting")
		}
		q.Done(it.Flow(), it.cost) // a slot of its own: it ends before the next
		out = append(out, it.Value)
	}
	return out
}

// A long request among new clients' short ones: the short ones go first,
// and the long one waits for about its own cost of their work, not for as
// long as short ones keep coming.
func TestQueueLongRequestWaitsItsCost(t *testing.T) {
	const long, short = 100.0, 10.0
	q, _ := newTestQueue(t, QueueConfig{})
	if _, err := q.Push("m", "long", BandInteractive, 1, long, -1); err != nil {
		t.Fatal(err)
	}
	before := 0
	for i := range 1000 {
		// One new client's short request arrives per dispatch: there is
		// always one waiting besides the long one.
		if _, err := q.Push("m", fmt.Sprint("short", i), BandInteractive, 1, short, i); err != nil {
			t.Fatal(err)
		}
		it := q.Peek("m")
		q.Pop(it)
		q.Done(it.Flow(), it.cost)
		if it.Value == -1 {
			break
		}
		before++
	}
	if want := int(long / short); before < 1 || before > want {
		t.Fatalf("%d short requests went before the long one, want 1 to %d", before, want)
	}
}

func TestQueueOrder(t *testing.T) {
	type push struct {
		flow   string
		band   Band
		weight float64
		cost   float64
	}
	// Each case pushes its requests in order (values 0, 1, ...) and
	// dispatches them all.
	cases := []struct {
		name   string
		pushes []push
		want   []int
	}{
		{"one flow is first come first served",
			[]push{{"a", 0, 1, 5}, {"a", 0, 1, 1}, {"a", 0, 1, 9}},
			[]int{0, 1, 2}},
		{"two flows of equal weight and cost alternate",
			[]push{{"a", 0, 1, 1}, {"a", 0, 1, 1}, {"a", 0, 1, 1}, {"b", 0, 1, 1}, {"b", 0, 1, 1}, {"b", 0, 1, 1}},
			[]int{0, 3, 1, 4, 2, 5}},
		{"a light flow arriving behind a backlog goes first",
			[]push{{"heavy", 0, 1, 100}, {"heavy", 0, 1, 100}, {"heavy", 0, 1, 100}, {"light", 0, 1, 10}},
			// heavy finishes at 100, 200, 300; light at 10.
			[]int{3, 0, 1, 2}},
		{"weight 2 gets two dispatches for one",
			[]push{{"a", 0, 2, 1}, {"a", 0, 2, 1}, {"a", 0, 2, 1}, {"a", 0, 2, 1}, {"b", 0, 1, 1}, {"b", 0, 1, 1}},
			[]int{0, 4, 1, 2, 5, 3}},
		{"a cheap flow gets more requests, not more tokens",
			[]push{{"big", 0, 1, 4}, {"big", 0, 1, 4}, {"small", 0, 1, 1}, {"small", 0, 1, 1}, {"small", 0, 1, 1}, {"small", 0, 1, 1}, {"small", 0, 1, 1}},
			// big finishes at 4, 8; small at 1, 2, 3, 4, 5 (the tie at 4
			// goes to the earlier start).
			[]int{2, 3, 4, 0, 5, 6, 1}},
		{"interactive before batch",
			[]push{{"b", BandBatch, 1, 1}, {"b", BandBatch, 1, 1}, {"i", BandInteractive, 1, 1}, {"i", BandInteractive, 1, 1}},
			[]int{2, 3, 0, 1}},
		{"non-positive weights and costs count as 1",
			[]push{{"a", 0, 0, 0}, {"a", 0, -1, math.NaN()}, {"b", 0, math.Inf(1), -3}, {"b", 0, 1, 1}},
			[]int{0, 2, 1, 3}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			q, _ := newTestQueue(t, QueueConfig{})
			for i, p := range tc.pushes {
				if _, err := q.Push("m", p.flow, p.band, p.weight, p.cost, i); err != nil {
					t.Fatal(err)
				}
			}
			if got := drain(q, "m"); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("order %v, want %v", got, tc.want)
			}
			if q.Len() != 0 || q.Waiting("m") != 0 {
				t.Fatalf("left %d waiting", q.Len())
			}
		})
	}
}

// TestQueueBatchNotStarved keeps interactive requests waiting all along and
// checks the batch band still gets every BatchEvery-th dispatch.
func TestQueueBatchNotStarved(t *testing.T) {
	for _, every := range []int{2, 4, 10} {
		t.Run(fmt.Sprint(every), func(t *testing.T) {
			q, _ := newTestQueue(t, QueueConfig{BatchEvery: every})
			for i := range 50 {
				q.Push("m", "batch", BandBatch, 1, 1, -1-i)
			}
			batch := 0
			for i := range 100 {
				q.Push("m", "chat", BandInteractive, 1, 1, i)
				it := q.Peek("m")
				q.Pop(it)
				q.Done(it.Flow(), 1)
				if it.Value < 0 {
					batch++
				}
			}
			if want := 100 / every; batch != want {
				t.Fatalf("batch got %d of 100 dispatches, want %d", batch, want)
			}
		})
	}
}

// TestQueueWeightedShare keeps two flows of weights 2 and 1 backlogged with
// requests of random cost and checks the tokens dispatched split 2:1.
func TestQueueWeightedShare(t *testing.T) {
	q, _ := newTestQueue(t, QueueConfig{})
	rng := rand.New(rand.NewPCG(1, 2))
	tokens := map[string]float64{}
	cost := map[int]float64{}
	n := 0
	push := func(flow string, w float64) {
		c := float64(50 + rng.IntN(2000))
		cost[n] = c
		if _, err := q.Push("m", flow, BandInteractive, w, c, n); err != nil {
			t.Fatal(err)
		}
		n++
	}
	for range 20 {
		push("two", 2)
		push("one", 1)
	}
	for range 2000 {
		it := q.Peek("m")
		q.Pop(it)
		q.Done(it.Flow(), cost[it.Value])
		tokens[it.Flow()] += cost[it.Value]
		// Keep both backlogged: replace what left.
		if it.Flow() == "two" {
			push("two", 2)
		} else {
			push("one", 1)
		}
	}
	ratio := tokens["two"] / tokens["one"]
	if ratio < 1.9 || ratio > 2.1 {
		t.Fatalf("tokens %v: ratio %.3f, want 2 within 5%%", tokens, ratio)
	}
}

// TestQueueInService: a flow whose requests are being served waits behind
// one that has none in service, though neither waited before; in
// proportion to its weight.
func TestQueueInService(t *testing.T) {
	q, _ := newTestQueue(t, QueueConfig{})
	q.Serving("heavy", 100)
	q.Push("m", "heavy", 0, 1, 100, 0)
	q.Push("m", "light", 0, 1, 100, 1)
	if got := drain(q, "m"); fmt.Sprint(got) != "[1 0]" {
		t.Fatalf("order %v, want the light request first", got)
	}
	// Weight 2 with twice the work in service is level with weight 1.
	q.Serving("two", 100)
	q.Serving("two", 100)
	q.Serving("one", 100)
	q.Push("m", "two", 0, 2, 100, 2)
	q.Push("m", "one", 0, 1, 100, 3)
	if got := drain(q, "m"); fmt.Sprint(got) != "[2 3]" {
		t.Fatalf("order %v, want arrival order between equal shares", got)
	}
	for _, f := range []string{"heavy", "two", "two", "one"} {
		q.Done(f, 100)
	}
	if len(q.serving) != 0 || q.InService("two") != 0 {
		t.Fatalf("serving %v after every request ended", q.serving)
	}
}

func TestQueueRemove(t *testing.T) {
	q, _ := newTestQueue(t, QueueConfig{})
	a0, _ := q.Push("m", "a", 0, 1, 10, 0)
	q.Push("m", "a", 0, 1, 10, 1)
	q.Push("m", "b", 0, 1, 10, 2)
	q.Push("m", "b", 0, 1, 10, 3)
	// a's first request leaves: a's second moves up to start at 0 and
	// goes before b's second.
	if !q.Remove(a0) {
		t.Fatal("Remove of a waiting item reported false")
	}
	if q.Remove(a0) || q.Pop(a0) {
		t.Fatal("a removed item is still waiting")
	}
	if got := drain(q, "m"); fmt.Sprint(got) != "[1 2 3]" {
		t.Fatalf("order %v after removing a's first, want [1 2 3]", got)
	}
	// A popped item cannot be removed: its owner holds the dispatch.
	it, _ := q.Push("m", "a", 0, 1, 1, 9)
	q.Pop(it)
	if q.Remove(it) {
		t.Fatal("Remove of a popped item reported true")
	}
}

func TestQueueBounds(t *testing.T) {
	q, _ := newTestQueue(t, QueueConfig{MaxQueued: 5, MaxQueuedPerFlow: 3})
	for i := range 3 {
		if _, err := q.Push("m", "a", 0, 1, 1, i); err != nil {
			t.Fatal(err)
		}
	}
	_, err := q.Push("m", "a", 0, 1, 1, 3)
	var qf *QueueFullError
	if !errors.As(err, &qf) || !qf.PerFlow || qf.Limit != 3 || !errors.Is(err, ErrQueueFull) {
		t.Fatalf("fourth push of one flow: %v", err)
	}
	// Another flow still gets in, up to the bound in all.
	q.Push("m", "b", 0, 1, 1, 4)
	q.Push("x", "c", BandBatch, 1, 1, 5)
	_, err = q.Push("m", "d", 0, 1, 1, 6)
	if !errors.As(err, &qf) || qf.PerFlow || qf.Limit != 5 {
		t.Fatalf("push beyond the bound in all: %v", err)
	}
	if q.Len() != 5 || q.Waiting("m") != 4 || q.Waiting("x") != 1 {
		t.Fatalf("len %d, m %d, x %d", q.Len(), q.Waiting("m"), q.Waiting("x"))
	}
}

// TestQueueIdleFlowKeepsNoDebt: a flow that used the fleet alone, then fell
// idle, starts level with a newcomer once the queue has emptied.
func TestQueueIdleFlowKeepsNoDebt(t *testing.T) {
	q, _ := newTestQueue(t, QueueConfig{})
	for i := range 100 {
		q.Push("m", "heavy", 0, 1, 1000, i)
	}
	drain(q, "m")
	q.Push("m", "heavy", 0, 1, 1, 100)
	q.Push("m", "new", 0, 1, 1, 101)
	if got := drain(q, "m"); fmt.Sprint(got) != "[100 101]" {
		t.Fatalf("order %v, want arrival order once idle", got)
	}
	// Nothing is kept for an idle queue.
	if len(q.models) != 0 {
		t.Fatalf("%d models kept while idle", len(q.models))
	}
}

func TestQueueSnapshotAndDrain(t *testing.T) {
	q, clk := newTestQueue(t, QueueConfig{})
	q.Push("m", "a", 0, 1, 1, 0)
	clk.Advance(time.Second)
	q.Push("m", "a", 0, 1, 1, 1)
	q.Push("m", "b", BandBatch, 1, 1, 2)
	clk.Advance(time.Second)
	snap := q.Snapshot()
	want := []QueueFlowStatus{
		{Model: "m", Band: BandInteractive, Flow: "a", Queued: 2, OldestWait: 2 * time.Second},
		{Model: "m", Band: BandBatch, Flow: "b", Queued: 1, OldestWait: time.Second},
	}
	if fmt.Sprint(snap) != fmt.Sprint(want) {
		t.Fatalf("snapshot %v, want %v", snap, want)
	}
	if q.DrainInterval("m") != 0 {
		t.Fatal("drain interval known before two dispatches")
	}
	q.Pop(q.Peek("m"))
	clk.Advance(100 * time.Millisecond)
	q.Pop(q.Peek("m"))
	if d := q.DrainInterval("m"); d != 100*time.Millisecond {
		t.Fatalf("drain interval %v, want 100ms", d)
	}
	if fmt.Sprint(q.Models()) != "[m]" {
		t.Fatalf("models %v", q.Models())
	}
}

func TestQueueConfigValidate(t *testing.T) {
	for _, cfg := range []QueueConfig{{MaxQueued: -1}, {MaxQueuedPerFlow: -1}, {BatchEvery: -2}, {BatchEvery: 1}} {
		if _, err := NewQueue[int](cfg); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
	if _, err := ParseBand("urgent"); err == nil {
		t.Error("ParseBand accepted urgent")
	}
	for _, b := range []Band{BandInteractive, BandBatch} {
		if got, err := ParseBand(b.String()); err != nil || got != b {
			t.Errorf("ParseBand(%q) = %v, %v", b.String(), got, err)
		}
	}
}

// checkQueue verifies the queue's invariants: counts agree with the items
// linked, every flow's items are in push order with non-decreasing start
// tags, each band's heap holds exactly its flows with items waiting, in
// heap order, and no idle band remembers flows.
func checkQueue(t *testing.T, q *Queue[int]) {
	t.Helper()
	total := 0
	for name, m := range q.models {
		mq := 0
		for bi := range m.bands {
			b := &m.bands[bi]
			inHeap := 0
			for _, f := range b.flows {
				n := 0
				var prev *QueueItem[int]
				for it := f.head; it != nil; it = it.next {
					if it.prev != prev || it.flow != f || !it.waiting || it.model != m {
						t.Fatalf("model %s flow %s: broken links", name, f.id)
					}
					if prev != nil && (it.seq <= prev.seq || it.start < prev.start-1e-9) {
						t.Fatalf("flow %s out of order", f.id)
					}
					if it.finish < it.start {
						t.Fatalf("flow %s: finish before start", f.id)
					}
					prev = it
					n++
				}
				if f.tail != prev || f.n != n {
					t.Fatalf("flow %s: n %d, linked %d", f.id, f.n, n)
				}
				if (n > 0) != (f.hi >= 0) {
					t.Fatalf("flow %s: %d waiting, heap index %d", f.id, n, f.hi)
				}
				if f.hi >= 0 {
					inHeap++
					if b.heap[f.hi] != f {
						t.Fatalf("flow %s: heap index %d wrong", f.id, f.hi)
					}
				}
				mq += n
			}
			if inHeap != len(b.heap) {
				t.Fatalf("band %d: %d flows waiting, heap %d", bi, inHeap, len(b.heap))
			}
			for i := 1; i < len(b.heap); i++ {
				if b.less(i, (i-1)/2) {
					t.Fatalf("band %d: heap order broken at %d", bi, i)
				}
			}
			if len(b.heap) == 0 && len(b.flows) != 0 {
				t.Fatalf("idle band %d remembers %d flows", bi, len(b.flows))
			}
		}
		if mq != m.queued || mq == 0 {
			t.Fatalf("model %s: queued %d, linked %d", name, m.queued, mq)
		}
		total += mq
	}
	if total != q.queued {
		t.Fatalf("queued %d, linked %d", q.queued, total)
	}
}

// queueOps runs a sequence of operations decoded from ops against q,
// checking the invariants after each, and against a plain model: the set
// of items waiting, and that Peek returns a waiting item of the least finish
// tag in the band whose turn it is.
func queueOps(t *testing.T, ops []byte) {
	q, clk := newTestQueue(t, QueueConfig{MaxQueued: 40, MaxQueuedPerFlow: 12, BatchEvery: 3})
	var live []*QueueItem[int]
	popped := map[*QueueItem[int]]bool{}
	removed := map[*QueueItem[int]]bool{}
	done := map[*QueueItem[int]]bool{}
	models := []string{"m", "n"}
	for i := 0; i+1 < len(ops); i += 2 {
		op, arg := ops[i], ops[i+1]
		switch op % 6 {
		case 0, 1: // push
			model := models[arg&1]
			flow := string(rune('a' + (arg>>1)%4))
			band := Band((arg >> 3) & 1)
			it, err := q.Push(model, flow, band, float64(1+(arg>>4)%3), float64(1+int(op)%7), len(live))
			if err != nil {
				if !errors.Is(err, ErrQueueFull) {
					t.Fatal(err)
				}
				continue
			}
			live = append(live, it)
		case 2: // dispatch
			model := models[arg&1]
			it := q.Peek(model)
			if it == nil {
				if q.Waiting(model) != 0 {
					t.Fatalf("Peek nil with %d waiting", q.Waiting(model))
				}
				continue
			}
			// It has the least finish tag of its band.
			for _, x := range live {
				if x.waiting && x.model == it.model && x.band == it.band && x.finish < it.finish-1e-9 {
					t.Fatalf("peeked finish %v, but %v waits", it.finish, x.finish)
				}
			}
			if !q.Pop(it) {
				t.Fatal("peeked item not waiting")
			}
			popped[it] = true
		case 3: // remove
			if len(live) == 0 {
				continue
			}
			it := live[int(arg)%len(live)]
			want := !popped[it] && !removed[it]
			if got := q.Remove(it); got != want {
				t.Fatalf("Remove reported %v for an item popped %v, removed %v", got, popped[it], removed[it])
			}
			removed[it] = true
		case 4:
			clk.Advance(time.Duration(arg) * time.Millisecond)
		case 5: // a popped request ends
			for _, it := range live {
				if popped[it] && !done[it] {
					q.Done(it.Flow(), it.cost)
					done[it] = true
					break
				}
			}
		}
		for f, s := range q.serving {
			if s.n <= 0 || s.cost < 0 {
				t.Fatalf("flow %s in service: %+v", f, *s)
			}
		}
		checkQueue(t, q)
	}
	waiting := 0
	for _, it := range live {
		if it.waiting {
			waiting++
		}
	}
	if waiting != q.Len() {
		t.Fatalf("%d items waiting, queue says %d", waiting, q.Len())
	}
}

func TestQueueRandomOperations(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 200 {
		ops := make([]byte, 400)
		for i := range ops {
			ops[i] = byte(rng.UintN(256))
		}
		queueOps(t, ops)
	}
}

func FuzzQueue(f *testing.F) {
	f.Add([]byte{0, 0, 0, 2, 1, 4, 2, 0, 3, 0, 2, 1})
	f.Add([]byte{0, 8, 0, 8, 1, 0, 2, 0, 2, 0, 2, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 2000 {
			return
		}
		queueOps(t, ops)
	})
}

// BenchmarkQueueFastPath is a request's pass through the queue when nothing
// waits: one look at its model's count.
func BenchmarkQueueFastPath(b *testing.B) {
	q, _ := newTestQueue(b, QueueConfig{})
	b.ReportAllocs()
	for b.Loop() {
		if q.Waiting("m") != 0 {
			b.Fatal("waiting")
		}
	}
}

// BenchmarkQueueWait is a request's pass through the queue when it has to
// wait: push, then peek and pop, with 100 flows' requests waiting.
func BenchmarkQueueWait(b *testing.B) {
	q, _ := newTestQueue(b, QueueConfig{MaxQueued: 1 << 20, MaxQueuedPerFlow: 1 << 20})
	flows := make([]string, 100)
	for i := range flows {
		flows[i] = fmt.Sprint("client-", i)
		q.Push("m", flows[i], 0, 1, 100, 0)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		q.Push("m", flows[i%len(flows)], 0, 1, 100, i)
		q.Pop(q.Peek("m"))
		i++
	}
}
