package simengine

// blockCache is an LRU set of block hashes with a fixed capacity. Nodes live
// in one slab linked by int32 index and a blockTable finds them by hash, so
// a full cache costs about 39 bytes per block (16 in the slab, about 23 in
// the table) and no allocation once it has filled.
//
// Chains are touched tail first, so a chain's head ends up most recent and
// its tail is evicted first, as vLLM frees a finished request's blocks in
// reverse order: evicting a middle block would strand every block after it.
type blockCache struct {
	capacity   int
	index      blockTable
	nodes      []cacheNode
	head, tail int32 // most and least recently used; -1 when empty
	sink       uint64
}

type cacheNode struct {
	hash       BlockHash
	prev, next int32 // towards head, towards tail; -1 at the ends
}

func newBlockCache(capacity int) *blockCache {
	c := &blockCache{capacity: capacity, head: -1, tail: -1}
	c.index.init(capacity)
	return c
}

// len returns the number of cached blocks.
func (c *blockCache) len() int { return len(c.nodes) }

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
		if n := at[i]; n >= 0 && int(n) < len(c.nodes) && c.nodes[n].hash == h {
			c.moveToFront(n)
			return
		}
	}
	n, ok := c.index.get(h)
	if ok {
		c.moveToFront(n)
	} else {
		n = c.alloc()
		c.nodes[n].hash = h
		c.index.insert(h, n)
		c.pushFront(n)
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
			if n := at[i]; n >= 0 && int(n) < len(c.nodes) {
				sink += uint64(c.nodes[n].hash)
				continue
			}
		}
		sink += uint64(c.index.slots[c.index.home(h)].h)
	}
	c.sink = sink
}

// alloc returns a node out of the list and the table: a new one while the
// cache has room, else the least recently used one, evicted.
func (c *blockCache) alloc() int32 {
	if len(c.nodes) < c.capacity {
		if len(c.nodes) == cap(c.nodes) {
			// Grow by doubling, but never past the capacity: the slab
			// is the largest part of a full cache.
			nc := min(c.capacity, max(2*cap(c.nodes), 256))
			c.nodes = append(make([]cacheNode, 0, nc), c.nodes...)
		}
		c.nodes = append(c.nodes, cacheNode{})
		return int32(len(c.nodes) - 1)
	}
	n := c.tail
	c.unlink(n)
	c.index.del(c.nodes[n].hash)
	return n
}

func (c *blockCache) moveToFront(n int32) {
	if c.head == n {
		return
	}
	c.unlink(n)
	c.pushFront(n)
}

func (c *blockCache) unlink(n int32) {
	nd := &c.nodes[n]
	if nd.prev >= 0 {
		c.nodes[nd.prev].next = nd.next
	} else {
		c.head = nd.next
	}
	if nd.next >= 0 {
		c.nodes[nd.next].prev = nd.prev
	} else {
		c.tail = nd.prev
	}
	nd.prev, nd.next = -1, -1
}

func (c *blockCache) pushFront(n int32) {
	nd := &c.nodes[n]
	nd.prev, nd.next = -1, c.head
	if c.head >= 0 {
		c.nodes[c.head].prev = n
	}
	c.head = n
	if c.tail < 0 {
		c.tail = n
	}
}

// order returns the cached hashes from most to least recently used (tests).
func (c *blockCache) order() []BlockHash {
	var out []BlockHash
	for n := c.head; n >= 0; n = c.nodes[n].next {
		out = append(out, c.nodes[n].hash)
	}
	return out
}
