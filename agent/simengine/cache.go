package simengine

// blockCache is an LRU set of block hashes with a fixed capacity. Nodes live
// in one slice linked by index, so a full cache costs about 37 bytes per
// block (16 in the list, 21 in the index) and no allocation once it has filled.
//
// Chains are touched tail first, so a chain's head ends up most recent and
// its tail is evicted first, as vLLM frees a finished request's blocks in
// reverse order: evicting a middle block would strand every block after it.
type blockCache struct {
	capacity   int
	index      blockIndex
	nodes      []cacheNode
	head, tail int32 // most and least recently used; -1 when empty
}

type cacheNode struct {
	hash       BlockHash
	prev, next int32 // towards head, towards tail; -1 at the ends
}

func newBlockCache(capacity int) *blockCache {
	return &blockCache{capacity: capacity, head: -1, tail: -1}
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
// at[i], so that a later touchAt need not search the map again.
func (c *blockCache) lookupInto(hs []BlockHash, at []int32) int {
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
// hash, which saves the map lookup on the hot path; at is updated.
func (c *blockCache) touchAt(hs []BlockHash, at []int32) {
	if len(hs) > c.capacity {
		hs = hs[:c.capacity]
	}
	for i := len(hs) - 1; i >= 0; i-- {
		h := hs[i]
		if at != nil {
			if n := at[i]; n >= 0 && int(n) < len(c.nodes) && c.nodes[n].hash == h {
				c.moveToFront(n)
				continue
			}
		}
		if n, ok := c.index.get(h); ok {
			c.moveToFront(n)
			if at != nil {
				at[i] = n
			}
			continue
		}
		var n int32
		if len(c.nodes) < c.capacity {
			n = int32(len(c.nodes))
			c.nodes = append(c.nodes, cacheNode{})
		} else {
			n = c.tail
			c.unlink(n)
			c.index.del(c.nodes[n].hash)
		}
		c.nodes[n].hash = h
		c.index.put(h, n)
		c.pushFront(n)
		if at != nil {
			at[i] = n
		}
	}
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
