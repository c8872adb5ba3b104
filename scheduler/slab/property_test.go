package slab

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// opBytes decodes a fuzz input into operations; past its end every read
// returns 0 and done reports true.
type opBytes struct {
	b []byte
	i int
}

func (o *opBytes) done() bool { return o.i >= len(o.b) }

// intn returns the next byte modulo n (n > 0), 0 past the end.
func (o *opBytes) intn(n int) int {
	if o.i >= len(o.b) {
		return 0
	}
	o.i++
	return int(o.b[o.i-1]) % n
}

func runSlab(t *testing.T, b []byte) {
	m := &slabMachine{t: t, l: New()}
	for o := (&opBytes{b: b}); !o.done(); {
		m.step(o)
	}
}

// slabMachine drives a List and its model: the live slots most recent
// first, and the released slots in the order they were released (the list
// reuses the last released first).
type slabMachine struct {
	t     *testing.T
	l     List
	order []int32
	free  []int32
}

// pick returns a live slot chosen by the next byte; false when none.
func (m *slabMachine) pick(o *opBytes) (int32, bool) {
	if len(m.order) == 0 {
		return 0, false
	}
	return m.order[o.intn(len(m.order))], true
}

func (m *slabMachine) step(o *opBytes) {
	switch op := o.intn(8); {
	case op < 3: // alloc, most often, so that the list grows
		n, grew := m.l.Alloc()
		want, wantGrew := int32(len(m.order)+len(m.free)), true
		if k := len(m.free); k > 0 {
			want, wantGrew = m.free[k-1], false
			m.free = m.free[:k-1]
		}
		if n != want || grew != wantGrew {
			m.t.Fatalf("alloc gave slot %d (grew %v), want %d (grew %v)", n, grew, want, wantGrew)
		}
		m.order = slices.Insert(m.order, 0, n)
	case op < 5:
		if n, ok := m.pick(o); ok {
			m.l.Release(n)
			m.order = slices.DeleteFunc(m.order, func(x int32) bool { return x == n })
			m.free = append(m.free, n)
		}
	case op < 7:
		if n, ok := m.pick(o); ok {
			m.l.Touch(n)
			m.order = slices.DeleteFunc(m.order, func(x int32) bool { return x == n })
			m.order = slices.Insert(m.order, 0, n)
		}
	default:
		n, ok1 := m.pick(o)
		p, ok2 := m.pick(o)
		if ok1 && ok2 {
			m.l.MoveAfter(n, p)
			if n != p {
				m.order = slices.DeleteFunc(m.order, func(x int32) bool { return x == n })
				i := slices.Index(m.order, p)
				m.order = slices.Insert(m.order, i+1, n)
			}
		}
	}
	m.check()
}

// check compares the list, walked both ways, and its free list with the
// model: every slot is live or free, once.
func (m *slabMachine) check() {
	t, l := m.t, &m.l
	if len(l.links) != len(m.order)+len(m.free) {
		t.Fatalf("%d slots, model has %d live and %d free", len(l.links), len(m.order), len(m.free))
	}
	var fwd []int32
	prev := int32(-1)
	for n := l.head; n >= 0 && len(fwd) <= len(l.links); n = l.links[n].next {
		if l.links[n].prev != prev {
			t.Fatalf("slot %d: prev %d, walked from %d", n, l.links[n].prev, prev)
		}
		fwd = append(fwd, n)
		prev = n
	}
	if l.tail != prev {
		t.Fatalf("tail %d, the walk ended at %d", l.tail, prev)
	}
	if !slices.Equal(fwd, m.order) {
		t.Fatalf("list %v, model %v", fwd, m.order)
	}
	var back []int32
	for n := l.tail; n >= 0 && len(back) <= len(l.links); n = l.links[n].prev {
		back = append(back, n)
	}
	slices.Reverse(back)
	if !slices.Equal(back, m.order) {
		t.Fatalf("list walked from the tail %v, model %v", back, m.order)
	}
	var free []int32
	for n := l.free; n >= 0 && len(free) <= len(l.links); n = l.links[n].next {
		free = append(free, n)
	}
	slices.Reverse(free)
	if !slices.Equal(free, m.free) {
		t.Fatalf("free list %v, model %v", free, m.free)
	}
}

// TestSlabListProperties: random allocs, releases, touches and moves keep
// the list in the model's order, walked from either end, every slot live
// or free exactly once, released slots reused last released first.
func TestSlabListProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(0x5eed, 7))
	for range 300 {
		b := make([]byte, 1+rng.IntN(400))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		runSlab(t, b)
		if t.Failed() {
			t.Logf("failing input (a fuzz seed): []byte(%q)", b)
			return
		}
	}
}

// FuzzSlabList is TestSlabListProperties on the fuzzer's operation sequences.
func FuzzSlabList(f *testing.F) {
	f.Add([]byte{0, 0, 0, 7, 1, 0, 5, 2, 3, 0})
	f.Add([]byte{0, 1, 2, 0, 1, 2, 7, 0, 1, 7, 2, 2, 3, 1, 4, 0, 5, 1, 6, 2})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) <= 2048 {
			runSlab(t, data)
		}
	})
}
