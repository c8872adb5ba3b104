package scheduler

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
	list     slabList

	// recent remembers, for the last chains inserted, how many of their
	// leading blocks were held before the insert, so that Correct can
	// compare the engine's answer with the prediction whichever of the two
	// calls comes first.
	recent    [recentInserts]recentInsert
	recentPos int
}

type recentInsert struct {
	last      uint64 // the chain's last hash; 0 when unused
	n         int32  // the chain's length
	predicted int32  // leading blocks held before the insert
}

const recentInserts = 64

// NewBlockLRU returns an empty BlockLRU of capacity blocks (at least 1).
func NewBlockLRU(capacity int) *BlockLRU {
	capacity = max(capacity, 1)
	return &BlockLRU{
		capacity: capacity, initial: capacity,
		index: make(map[uint64]int32), list: newSlabList(),
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
// evicted. A chain longer than the capacity keeps its head.
func (l *BlockLRU) Insert(chain []uint64, added, evicted []uint64) (addedOut, evictedOut []uint64) {
	if len(chain) == 0 {
		return added, evicted
	}
	l.remember(chain, l.Lookup(chain))
	if len(chain) > l.capacity {
		chain = chain[:l.capacity]
	}
	// Tail first, so the head ends most recent.
	for i := len(chain) - 1; i >= 0; i-- {
		h := chain[i]
		if n, ok := l.index[h]; ok {
			l.list.touch(n)
			continue
		}
		for len(l.index) >= l.capacity && l.list.tail >= 0 {
			evicted = append(evicted, l.hashes[l.list.tail])
			l.remove(l.list.tail)
		}
		l.add(h)
		added = append(added, h)
	}
	return added, evicted
}

func (l *BlockLRU) remember(chain []uint64, predicted int) {
	l.recent[l.recentPos] = recentInsert{last: chain[len(chain)-1], n: int32(len(chain)), predicted: int32(predicted)}
	l.recentPos = (l.recentPos + 1) % recentInserts
}

// recalled returns the prediction remembered for chain by a recent Insert,
// and forgets it.
func (l *BlockLRU) recalled(chain []uint64) (int, bool) {
	last := chain[len(chain)-1]
	for i := range l.recent {
		r := &l.recent[i]
		if r.last == last && int(r.n) == len(chain) {
			p := int(r.predicted)
			*r = recentInsert{}
			return p, true
		}
	}
	return 0, false
}

// Correct is called with the engine's own answer for a request of chain:
// its first cachedBlocks blocks really were cached (see CachedBlocks). The
// LRU's prediction is what it held of chain before the request's Insert
// (or now, if Correct comes first). Blocks it predicted beyond cachedBlocks
// had been evicted by the engine: unless an Insert already re-added them
// for this request, they are dropped. The capacity then moves by the error
// (shrinking when the LRU believed too much, growing when too little,
// within 1/16 and 4 times the capacity given to NewBlockLRU or
// SetCapacity), evicting from the tail if it shrinks. Every hash dropped is
// appended to dropped, to be published as evicted.
func (l *BlockLRU) Correct(chain []uint64, cachedBlocks int, dropped []uint64) []uint64 {
	if len(chain) == 0 {
		return dropped
	}
	cachedBlocks = min(max(cachedBlocks, 0), len(chain))
	predicted, inserted := l.recalled(chain)
	if !inserted {
		predicted = l.Lookup(chain)
		for _, h := range chain[cachedBlocks:predicted] {
			if n, ok := l.index[h]; ok {
				dropped = append(dropped, h)
				l.remove(n)
			}
		}
	}
	// A block of slack: converting tokens to blocks is approximate.
	switch d := cachedBlocks - predicted; {
	case d < -1:
		l.capacity = max(l.capacity+d, max(l.initial/16, 1))
	case d > 1:
		l.capacity = min(l.capacity+d, 4*l.initial)
	}
	for len(l.index) > l.capacity && l.list.tail >= 0 {
		dropped = append(dropped, l.hashes[l.list.tail])
		l.remove(l.list.tail)
	}
	return dropped
}

// SetCapacity sets the capacity (at least 1) as if given to NewBlockLRU,
// appending the hashes it evicts to evicted.
func (l *BlockLRU) SetCapacity(n int, evicted []uint64) []uint64 {
	n = max(n, 1)
	l.capacity, l.initial = n, n
	for len(l.index) > l.capacity && l.list.tail >= 0 {
		evicted = append(evicted, l.hashes[l.list.tail])
		l.remove(l.list.tail)
	}
	return evicted
}

// Snapshot appends every held hash to dst, most recent first.
func (l *BlockLRU) Snapshot(dst []uint64) []uint64 {
	for n := l.list.head; n >= 0; n = l.list.links[n].next {
		dst = append(dst, l.hashes[n])
	}
	return dst
}

func (l *BlockLRU) add(h uint64) {
	n, grew := l.list.alloc()
	if grew {
		l.hashes = append(l.hashes, h)
	} else {
		l.hashes[n] = h
	}
	l.index[h] = n
}

func (l *BlockLRU) remove(n int32) {
	l.list.release(n)
	delete(l.index, l.hashes[n])
	l.hashes[n] = 0
}
