package slab

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestListAgainstModel drives a List with random operations and checks it
// against a plain model: the slots in order, most recent first, and the
// released ones.
func TestListAgainstModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for run := range 50 {
		l := New()
		var order []int32         // most recent first
		var freed []int32         // released, most recent release last
		slots := map[int32]bool{} // every slot ever handed out
		for step := range 400 {
			switch op := rng.IntN(4); {
			case op == 0 || len(order) == 0:
				n, grew := l.Alloc()
				if want := len(freed) == 0; grew != want {
					t.Fatalf("run %d step %d: Alloc grew=%v with %d freed", run, step, grew, len(freed))
				}
				if !grew {
					if want := freed[len(freed)-1]; n != want {
						t.Fatalf("run %d step %d: reused %d, want %d", run, step, n, want)
					}
					freed = freed[:len(freed)-1]
				} else if slots[n] {
					t.Fatalf("run %d step %d: new slot %d was handed out before", run, step, n)
				}
				slots[n] = true
				order = append([]int32{n}, order...)
			case op == 1:
				n := order[rng.IntN(len(order))]
				l.Release(n)
				order = slices.DeleteFunc(order, func(x int32) bool { return x == n })
				freed = append(freed, n)
			case op == 2:
				n := order[rng.IntN(len(order))]
				l.Touch(n)
				order = append([]int32{n}, slices.DeleteFunc(order, func(x int32) bool { return x == n })...)
			case op == 3:
				n, p := order[rng.IntN(len(order))], order[rng.IntN(len(order))]
				l.MoveAfter(n, p)
				if n != p {
					order = slices.DeleteFunc(order, func(x int32) bool { return x == n })
					i := slices.Index(order, p)
					order = slices.Insert(order, i+1, n)
				}
			}
			var got []int32
			for n := l.Head(); n >= 0; n = l.Next(n) {
				got = append(got, n)
			}
			var back []int32
			for n := l.Tail(); n >= 0; n = l.Prev(n) {
				back = append([]int32{n}, back...)
			}
			if !slices.Equal(got, order) || !slices.Equal(back, order) {
				t.Fatalf("run %d step %d: order %v (backwards %v), want %v", run, step, got, back, order)
			}
		}
	}
}

// TestGrowKeepsSlots: Grow makes room without losing the order.
func TestGrowKeepsSlots(t *testing.T) {
	l := New()
	a, _ := l.Alloc()
	b, _ := l.Alloc()
	l.Grow(100)
	if cap(l.links)-len(l.links) < 100 {
		t.Fatalf("room for %d more slots, want 100", cap(l.links)-len(l.links))
	}
	if l.Head() != b || l.Next(b) != a || l.Tail() != a {
		t.Fatal("Grow changed the order")
	}
}
