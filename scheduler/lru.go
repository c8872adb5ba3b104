package scheduler

import "github.com/computeflux/computeflux/scheduler/slab"

// BlockLRU is an agent's picture of what its engine holds: a bounded LRU set
// of block hashes (see PromptBlocks). Chains are touched tail first, so a
// chain's first block is its most recent and its last block is evicted
// first, as engines free a finished request's blocks. Nodes live in one slab
// linked by index. It is not safe for concurrent use.
type BlockLRU struct {
	capacity int
	initial  int // capacity as configured; Correct adapts within bounds of it
	index    map[uint64]int32
	hashes   []uint64 // by slot of list
	list     slab.List
}

// NoPrediction is the prediction to give Correct for a request whose Insert
// it does not know: the LRU compares the engine's answer with what it holds
// now.
const NoPrediction = -1

// NewBlockLRU returns an empty BlockLRU of capacity blocks (at least 1).
func NewBlockLRU(capacity int) *BlockLRU {
	capacity = max(capacity, 1)
	return &BlockLRU{
		capacity: capacity, initial: capacity,
		index: make(map[uint64]int32), list: slab.New(),
	}
}

// Len returns the number of blocks held.
func (l *BlockLRU) Len() int { return len(l.index) }

// Capacity returns the current capacity in blocks.
func (l *BlockLRU) Capacity() int { return l.capacity }

// Contains reports whether h is held, without touching it.
func (l *BlockLRU) Contains(h uint64) bool {
	_, ok := l.index[h]
	return ok
}

// Lookup returns how many leading blocks of chain are held, without
// touching them.
func (l *BlockLRU) Lookup(chain []uint64) int {
	for i, h := range chain {
		if _, ok := l.index[h]; !ok {
			return i
		}
	}
	return len(chain)
}

// Insert records that the engine now holds chain: held blocks are touched,
// new ones added, and the chain's head becomes the most recent. It appends
// the newly added hashes to added and the hashes evicted to make room to
// evicted (never the same hash to both). A chain longer than the capacity keeps its head. It returns held,
// how many leading blocks of chain were held before: the prediction the
// request's Correct compares the engine's answer with. The caller keeps it
// with the request, so that any number of requests may be in flight
// between the two calls.
func (l *BlockLRU) Insert(chain []uint64, added, evicted []uint64) (held int, addedOut, evictedOut []uint64) {
	if len(chain) == 0 {
		return 0, added, evicted
	}
	held = l.Lookup(chain)
	if len(chain) > l.capacity {
		chain = chain[:l.capacity]
	}
	// The chain's held blocks first: making room for its new blocks then
	// never evicts one of them only to add it back, so added and evicted
	// are exactly what changed (disjoint), and may be published as one
	// delta.
	fresh := false
	for i := len(chain) - 1; i >= 0; i-- {
		if n, ok := l.index[chain[i]]; ok {
			l.list.Touch(n)
		} else {
			fresh = true
		}
	}
	if !fresh {
		return held, added, evicted
	}
	// Tail first, so the head ends most recent.
	for i := len(chain) - 1; i >= 0; i-- {
		h := chain[i]
		if n, ok := l.index[h]; ok {
			l.list.Touch(n)
			continue
		}
		for len(l.index) >= l.capacity && l.list.Tail() >= 0 {
			evicted = append(evicted, l.hashes[l.list.Tail()])
			l.remove(l.list.Tail())
		}
		l.add(h)
		added = append(added, h)
	}
	return held, added, evicted
}

// Correct is called with the engine's own answer for a request of chain:
// its first cachedBlocks blocks really were cached (see CachedBlocks).
// predicted is what the request's Insert returned, or NoPrediction when
// there was none; then the prediction is what the LRU holds of chain now,
// and blocks it holds beyond cachedBlocks, which the engine had evicted,
// are dropped (after an Insert they stay: the request made the engine hold
// them again). The capacity then moves by the error (shrinking when the LRU
// believed too much, growing when too little, within 1/16 and 4 times the
// capacity given to NewBlockLRU or SetCapacity), evicting from the tail if
// it shrinks. Every hash dropped is appended to dropped, to be published as
// evicted. Any cachedBlocks and predicted are accepted: values beyond the
// chain count as the whole chain.
func (l *BlockLRU) Correct(chain []uint64, predicted, cachedBlocks int, dropped []uint64) []uint64 {
	if len(chain) == 0 {
		return dropped
	}
	cachedBlocks = min(max(cachedBlocks, 0), len(chain))
	if predicted < 0 {
		predicted = l.Lookup(chain)
		if predicted > cachedBlocks {
			for _, h := range chain[cachedBlocks:predicted] {
				if n, ok := l.index[h]; ok {
					dropped = append(dropped, h)
					l.remove(n)
				}
			}
		}
	}
	predicted = min(predicted, len(chain))
	// A block of slack: converting tokens to blocks is approximate.
	switch d := cachedBlocks - predicted; {
	case d < -1:
		l.capacity = max(l.capacity+d, max(l.initial/16, 1))
	case d > 1:
		l.capacity = min(l.capacity+d, 4*l.initial)
	}
	for len(l.index) > l.capacity && l.list.Tail() >= 0 {
		dropped = append(dropped, l.hashes[l.list.Tail()])
		l.remove(l.list.Tail())
	}
	return dropped
}

// SetCapacity sets the capacity (at least 1) as if given to NewBlockLRU,
// appending the hashes it evicts to evicted.
func (l *BlockLRU) SetCapacity(n int, evicted []uint64) []uint64 {
	n = max(n, 1)
	l.capacity, l.initial = n, n
	for len(l.index) > l.capacity && l.list.Tail() >= 0 {
		evicted = append(evicted, l.hashes[l.list.Tail()])
		l.remove(l.list.Tail())
	}
	return evicted
}

// Snapshot appends every held hash to dst, most recent first.
func (l *BlockLRU) Snapshot(dst []uint64) []uint64 {
	for n := l.list.Head(); n >= 0; n = l.list.Next(n) {
		dst = append(dst, l.hashes[n])
	}
	return dst
}

func (l *BlockLRU) add(h uint64) {
	n, grew := l.list.Alloc()
	if grew {
		l.hashes = append(l.hashes, h)
	} else {
		l.hashes[n] = h
	}
	l.index[h] = n
}

func (l *BlockLRU) remove(n int32) {
	l.list.Release(n)
	delete(l.index, l.hashes[n])
	l.hashes[n] = 0
}
