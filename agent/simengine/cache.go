package simengine

import "github.com/computeflux/computeflux/scheduler/slab"

// blockCache is an LRU set of block hashes with a fixed capacity. Hashes
// live in one slab ordered by a slab.List and a blockTable finds them by
// hash, so a full cache costs about 39 bytes per block (8 in the slab, 8 in
// its links, about 23 in the table) and no allocation once it has filled.
//
// Chains are touched tail first, so a chain's head ends up most recent and
// its tail is evicted first, as vLLM frees a finished request's blocks in
// reverse order: evicting a middle block would strand every block after it.
type blockCache struct {
	capacity int
	index    blockTable
	hashes   []BlockHash // by node
	list     slab.List   // the nodes, most recently used first
	sink     uint64
}

func newBlockCache(capacity int) *blockCache {
	c := &blockCache{capacity: capacity, list: slab.New()}
	c.index.init(capacity)
	return c
}

// len returns the number of cached blocks.
func (c *blockCache) len() int { return len(c.hashes) }

// lookup returns how many leading hashes of hs are cached, without changing
// recency.
func (c *blockCache) lookup(hs []BlockHash) int {
	for i, h := range hs {
		if _, ok := c.index.get(h); !ok {
			return i
		}
	}
	return len(hs)
}

// lookupInto is lookup that also records where each found block lives in
// at[i], so that a later touchAt need not search the table again.
func (c *blockCache) lookupInto(hs []BlockHash, at []int32) int {
	c.prefetch(hs, nil)
	for i, h := range hs {
		n, ok := c.index.get(h)
		if !ok {
			return i
		}
		at[i] = n
	}
	return len(hs)
}

// touch makes every hash of the chain hs cached and most recently used, the
// first one most recent. A chain longer than the cache keeps its head.
func (c *blockCache) touch(hs []BlockHash) { c.touchAt(hs, nil) }

// touchAt is touch with hints: at[i] (when at is not nil) is where hs[i]
// was last seen, or -1. A hint is used only if that node still holds the
// hash, which saves the table lookup on the hot path; at is updated.
func (c *blockCache) touchAt(hs []BlockHash, at []int32) { c.touchChain(hs, nil, at) }

// touchChain is touchAt of the chain hs followed by ext, without building
// it: at (when not nil) holds len(hs)+len(ext) hints.
func (c *blockCache) touchChain(hs, ext []BlockHash, at []int32) {
	if len(hs) >= c.capacity {
		hs, ext = hs[:c.capacity], nil
	} else if len(hs)+len(ext) > c.capacity {
		ext = ext[:c.capacity-len(hs)]
	}
	var atHs, atExt []int32
	if at != nil {
		atHs, atExt = at[:len(hs)], at[len(hs):len(hs)+len(ext)]
	}
	c.prefetch(hs, atHs)
	c.prefetch(ext, atExt)
	for i := len(ext) - 1; i >= 0; i-- {
		c.touchOne(ext[i], atExt, i)
	}
	for i := len(hs) - 1; i >= 0; i-- {
		c.touchOne(hs[i], atHs, i)
	}
}

// touchOne makes h cached and most recently used; at[i] (when at is not
// nil) is its hint, updated.
func (c *blockCache) touchOne(h BlockHash, at []int32, i int) {
	if at != nil {
		if n := at[i]; n >= 0 && int(n) < len(c.hashes) && c.hashes[n] == h {
			c.list.Touch(n)
			return
		}
	}
	n, ok := c.index.get(h)
	if ok {
		c.list.Touch(n)
	} else {
		n = c.alloc()
		c.hashes[n] = h
		c.index.insert(h, n)
	}
	if at != nil {
		at[i] = n
	}
}

// prefetch reads, for every hash of hs, the cache line that touching or
// looking it up reads first: the node of a hint in range, else the hash's
// home slot in the table. It changes nothing. With a thousand engines the
// caches are far larger than the processor's, so each of those reads is a
// miss to memory; here they do not depend on one another and the
// processor overlaps them, where the touch itself, whose every step
// depends on the previous one, would wait for each in turn.
func (c *blockCache) prefetch(hs []BlockHash, at []int32) {
	if len(c.index.slots) == 0 {
		return
	}
	var sink uint64
	for i, h := range hs {
		if at != nil {
			if n := at[i]; n >= 0 && int(n) < len(c.hashes) {
				sink += uint64(c.hashes[n])
				continue
			}
		}
		sink += uint64(c.index.slots[c.index.home(h)].h)
	}
	c.sink = sink
}

// alloc returns a node at the front of the list, out of the table: a new
// one while the cache has room, else the least recently used one, evicted.
func (c *blockCache) alloc() int32 {
	if len(c.hashes) < c.capacity {
		if len(c.hashes) == cap(c.hashes) {
			// Grow by doubling, but never past the capacity: the slab
			// is the largest part of a full cache.
			nc := min(c.capacity, max(2*cap(c.hashes), 256))
			c.hashes = append(make([]BlockHash, 0, nc), c.hashes...)
			c.list.Grow(nc - len(c.hashes))
		}
		n, _ := c.list.Alloc()
		c.hashes = append(c.hashes, 0)
		return n
	}
	n := c.list.Tail()
	c.list.Touch(n)
	c.index.del(c.hashes[n])
	return n
}

// order returns the cached hashes from most to least recently used (tests).
func (c *blockCache) order() []BlockHash {
	var out []BlockHash
	for n := c.list.Head(); n >= 0; n = c.list.Next(n) {
		out = append(out, c.hashes[n])
	}
	return out
}
