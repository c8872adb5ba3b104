package simengine

import (
	"slices"
	"testing"
)

// refLRU is the plain model of blockCache: a slice from most to least
// recently used, touched tail first.
type refLRU struct {
	capacity int
	order    []BlockHash
}

func (r *refLRU) touch(hs []BlockHash) {
	if len(hs) > r.capacity {
		hs = hs[:r.capacity]
	}
	for i := len(hs) - 1; i >= 0; i-- {
		if j := slices.Index(r.order, hs[i]); j >= 0 {
			r.order = slices.Delete(r.order, j, j+1)
		} else if len(r.order) == r.capacity {
			r.order = r.order[:len(r.order)-1]
		}
		r.order = slices.Insert(r.order, 0, hs[i])
	}
}

func (r *refLRU) lookup(hs []BlockHash) int {
	for i, h := range hs {
		if !slices.Contains(r.order, h) {
			return i
		}
	}
	return len(hs)
}

// TestCacheAgainstModel drives the cache with random chains, whole or in two
// parts, hints (right, stale and absent), repeated hashes and hashes that share their upper 32
// bits, and compares every state with the model.
func TestCacheAgainstModel(t *testing.T) {
	for _, capacity := range []int{1, 3, 8, 50} {
		c := newBlockCache(capacity)
		ref := &refLRU{capacity: capacity}
		s := uint64(capacity)
		rnd := func(n int) int { s = mix64(s + 0x9e3779b97f4a7c15); return int(s % uint64(n)) }
		hash := func() BlockHash {
			k := uint64(rnd(3 * capacity))
			if rnd(2) == 0 {
				return BlockHash(k) // tag 0 for all: collisions in the table
			}
			return BlockHash(mix64(k))
		}
		var at []int32
		var prev []BlockHash
		for step := range 4000 {
			hs := make([]BlockHash, rnd(capacity+3))
			for i := range hs {
				hs[i] = hash()
			}
			if len(prev) > 0 && rnd(2) == 0 { // reuse a chain with its hints
				hs = append(prev[:rnd(len(prev)+1):len(prev)], hs[:len(hs)/2]...)
			} else {
				at = at[:0]
			}
			for len(at) < len(hs) {
				at = append(at, int32(rnd(capacity+2))-1) // some stale or out of range
			}
			at = at[:len(hs)]
			switch rnd(4) {
			case 0:
				c.touch(hs)
			case 1:
				c.touchAt(hs, at)
			case 2:
				got := c.lookupInto(hs, at)
				if want := ref.lookup(hs); got != want {
					t.Fatalf("cap %d step %d: lookupInto %d, want %d", capacity, step, got, want)
				}
				c.touchAt(hs[:got], at[:got])
				hs = hs[:got]
			case 3:
				k := rnd(len(hs) + 1)
				c.touchChain(slices.Clone(hs[:k]), slices.Clone(hs[k:]), at)
			}
			ref.touch(hs)
			prev = hs
			if got := c.order(); !slices.Equal(got, ref.order) {
				t.Fatalf("cap %d step %d: order %v, want %v", capacity, step, got, ref.order)
			}
			if c.len() != len(ref.order) || c.index.count != len(ref.order) {
				t.Fatalf("cap %d step %d: %d nodes, %d indexed, want %d", capacity, step, c.len(), c.index.count, len(ref.order))
			}
			probe := []BlockHash{hash(), hash()}
			if got, want := c.lookup(probe), ref.lookup(probe); got != want {
				t.Fatalf("cap %d step %d: lookup %d, want %d", capacity, step, got, want)
			}
		}
	}
}

func TestBlockTableAgainstMap(t *testing.T) {
	const maxNodes = 6000
	var x blockTable
	x.init(maxNodes)
	ref := map[BlockHash]int32{}
	var free []int32
	for i := range maxNodes {
		free = append(free, int32(i))
	}
	s := uint64(1)
	for i := range 30000 {
		s = mix64(s + uint64(i))
		h := BlockHash(s % 500) // small keys: one tag, long probe runs and wrap-around
		switch i % 3 {
		case 1:
			h = BlockHash(s)
		case 2:
			h = BlockHash(s&0xffffffff_00000000 | s%7) // equal tags, distinct hashes
		}
		n, inRef := ref[h]
		switch {
		case s>>62 < 2 && !inRef && len(free) > 0:
			n, free = free[len(free)-1], free[:len(free)-1]
			x.insert(h, n)
			ref[h] = n
		case s>>62 == 2 && inRef:
			x.del(h)
			delete(ref, h)
			free = append(free, n)
		}
		if i%3000 == 0 {
			if x.count != len(ref) {
				t.Fatalf("step %d: count %d, want %d", i, x.count, len(ref))
			}
			for k, v := range ref {
				if got, ok := x.get(k); !ok || got != v {
					t.Fatalf("step %d: get(%d) = %d %v, want %d", i, k, got, ok, v)
				}
			}
			if k := BlockHash(s | 1<<63); true {
				_, in := ref[k]
				if _, ok := x.get(k); ok != in {
					t.Fatalf("step %d: get(%d) found %v, want %v", i, k, ok, in)
				}
			}
		}
	}
	if len(x.slots) > x.max {
		t.Fatalf("table grew to %d slots, bound %d", len(x.slots), x.max)
	}
}
