package scheduler

import (
	"slices"
	"testing"
)

// lruMachine drives a BlockLRU and its model: the held hashes most recent
// first and the capacity, as BlockLRU's doc comments define them. A relay
// that applies every change the LRU reports (added, then evicted or
// dropped, as IndexApply does) must end up holding what the LRU holds.
type lruMachine struct {
	t *testing.T
	l *BlockLRU

	order             []uint64
	capacity, initial int
	published         map[uint64]bool
	inflight          []lruRequest
}

// lruRequest is a request between its Insert and its Correct.
type lruRequest struct {
	chain     []uint64
	predicted int
}

func newLRUMachine(t *testing.T, o *opBytes) *lruMachine {
	c := 1 + o.intn(48)
	return &lruMachine{t: t, l: NewBlockLRU(c), capacity: c, initial: c, published: map[uint64]bool{}}
}

// lruChain decodes a chain of a small tree of prompts: six families, each
// a trunk that three branches leave at a point of their own, so chains
// share prefixes as conversations do.
func lruChain(o *opBytes) []uint64 {
	fam, branch, n := uint64(o.intn(6)), uint64(o.intn(3)), o.intn(40)
	split := int(3 + 4*branch)
	c := make([]uint64, n)
	for i := range c {
		b := uint64(0)
		if i >= split {
			b = branch
		}
		c[i] = fam<<32 | b<<16 | uint64(i)
	}
	return c
}

func (m *lruMachine) lookup(chain []uint64) int {
	for i, h := range chain {
		if !slices.Contains(m.order, h) {
			return i
		}
	}
	return len(chain)
}

// truncate drops the model's least recent hashes beyond the capacity.
func (m *lruMachine) truncate() {
	m.order = m.order[:min(len(m.order), m.capacity)]
}

func (m *lruMachine) step(o *opBytes) {
	before := slices.Clone(m.order)
	var added, removed []uint64
	switch op := o.intn(8); {
	case op < 4:
		chain := lruChain(o)
		var held int
		held, added, removed = m.l.Insert(chain, nil, nil)
		if want := m.lookup(chain); held != want {
			m.t.Fatalf("Insert(%x) predicted %d held, model holds %d", chain, held, want)
		}
		// The chain, as far as the capacity goes, becomes the most recent,
		// in its order; the rest keep theirs behind it.
		c := chain[:min(len(chain), m.capacity)]
		rest := slices.DeleteFunc(slices.Clone(m.order), func(h uint64) bool { return slices.Contains(c, h) })
		m.order = append(slices.Clone(c), rest...)
		m.truncate()
		if len(chain) > 0 {
			m.inflight = append(m.inflight, lruRequest{chain, held})
		}
	case op < 6:
		// The engine's answer to a request in flight (any of them, in any
		// order), or to one whose Insert the LRU never saw.
		var rq lruRequest
		if len(m.inflight) > 0 && op == 4 {
			i := o.intn(len(m.inflight))
			rq = m.inflight[i]
			m.inflight = slices.Delete(m.inflight, i, i+1)
		} else {
			rq = lruRequest{lruChain(o), NoPrediction}
		}
		cached := o.intn(len(rq.chain)+6) - 2
		removed = m.l.Correct(rq.chain, rq.predicted, cached, nil)
		m.correct(rq, cached)
	case op < 7:
		n := o.intn(64) - 1
		removed = m.l.SetCapacity(n, nil)
		m.capacity, m.initial = max(n, 1), max(n, 1)
		m.truncate()
	default:
		// Reads only.
		chain := lruChain(o)
		if got, want := m.l.Lookup(chain), m.lookup(chain); got != want {
			m.t.Fatalf("Lookup(%x) = %d, model %d", chain, got, want)
		}
	}
	for _, h := range added {
		m.published[h] = true
	}
	for _, h := range removed {
		delete(m.published, h)
	}
	m.check(before, added, removed)
}

// correct applies Correct's documented rules to the model.
func (m *lruMachine) correct(rq lruRequest, cached int) {
	chain, predicted := rq.chain, rq.predicted
	if len(chain) == 0 {
		return
	}
	cached = min(max(cached, 0), len(chain))
	if predicted < 0 {
		predicted = m.lookup(chain)
		if predicted > cached {
			lost := chain[cached:predicted]
			m.order = slices.DeleteFunc(m.order, func(h uint64) bool { return slices.Contains(lost, h) })
		}
	}
	predicted = min(predicted, len(chain))
	switch d := cached - predicted; {
	case d < -1:
		m.capacity = max(m.capacity+d, max(m.initial/16, 1))
	case d > 1:
		m.capacity = min(m.capacity+d, 4*m.initial)
	}
	m.truncate()
}

// check compares the LRU with the model after an operation that started
// from before and reported added and removed (evicted or dropped).
func (m *lruMachine) check(before, added, removed []uint64) {
	t, l := m.t, m.l
	snap := l.Snapshot(nil)
	if !slices.Equal(snap, m.order) {
		t.Fatalf("snapshot (most recent first) %x, model %x", snap, m.order)
	}
	if l.Len() != len(snap) || l.Capacity() != m.capacity || l.Len() > l.Capacity() {
		t.Fatalf("len %d of capacity %d, snapshot %d, model capacity %d", l.Len(), l.Capacity(), len(snap), m.capacity)
	}
	if lo, hi := max(m.initial/16, 1), 4*m.initial; l.Capacity() < lo || l.Capacity() > hi {
		t.Fatalf("capacity %d outside [%d, %d]", l.Capacity(), lo, hi)
	}
	for _, h := range snap {
		if !l.Contains(h) {
			t.Fatalf("%x in the snapshot but not contained", h)
		}
	}
	// What it reported is exactly what changed, each hash once.
	wantAdded := slices.DeleteFunc(slices.Clone(m.order), func(h uint64) bool { return slices.Contains(before, h) })
	wantRemoved := slices.DeleteFunc(slices.Clone(before), func(h uint64) bool { return slices.Contains(m.order, h) })
	for _, s := range [][]uint64{added, removed, wantAdded, wantRemoved} {
		slices.Sort(s)
	}
	if !slices.Equal(added, wantAdded) || !slices.Equal(removed, wantRemoved) {
		t.Fatalf("reported added %x, removed %x; the held set gained %x and lost %x", added, removed, wantAdded, wantRemoved)
	}
	if len(m.published) != len(snap) {
		t.Fatalf("a relay applying the reported changes holds %d hashes, the LRU %d", len(m.published), len(snap))
	}
	for _, h := range snap {
		if !m.published[h] {
			t.Fatalf("a relay applying the reported changes lacks %x", h)
		}
	}
}

// TestBlockLRUProperties: random inserts, corrections (of requests in
// flight in any number and order, or unknown to the LRU), resizes and
// lookups keep the LRU equal to its model: the held blocks in LRU order,
// within the capacity, the capacity within its bounds, each reported
// change exactly what changed, and a relay applying the reports holding
// what the LRU holds.
func TestBlockLRUProperties(t *testing.T) { checkProperty(t, 150, 600, newLRUMachine) }

// FuzzBlockLRU is TestBlockLRUProperties on the fuzzer's operation sequences.
func FuzzBlockLRU(f *testing.F) {
	f.Add([]byte{8, 0, 1, 0, 30, 0, 2, 1, 35, 4, 0, 40, 5, 3, 1, 20, 8, 6, 2})
	f.Add([]byte{3, 0, 0, 0, 2, 1, 1, 9, 0, 0, 0, 3, 4, 0, 9, 7, 0, 0, 3})
	fuzzMachine(f, 2048, newLRUMachine)
}
