package simengine

// blockCache is an LRU set of block hashes with a fixed capacity. Nodes live
// in one slice linked by index, so a full cache costs one map entry and 16
// bytes per block and no allocation once it has filled.
//
// Chains are touched tail first, so a chain's head ends up most recent and
// its tail is evicted first, as vLLM frees a finished request's blocks in
// reverse order: evicting a middle block would strand every block after it.
type blockCache struct {
	capacity   int
	index      map[BlockHash]int32
	nodes      []cacheNode
	head, tail int32 // most and least recently used; -1 when empty
}

type cacheNode struct {
	hash       BlockHash
	prev, next int32 // towards head, towards tail; -1 at the ends
}

func newBlockCache(capacity int) *blockCache {
	return &blockCache{capacity: capacity, index: make(map[BlockHash]int32), head: -1, tail: -1}
}

// len returns the number of cached blocks.
func (c *blockCache) len() int { return len(c.nodes) }

// lookup returns how many leading hashes of hs are cached, without changing
// recency.
func (c *blockCache) lookup(hs []BlockHash) int {
	for i, h := range hs {
		if _, ok := c.index[h]; !ok {
			return i
		}
	}
	return len(hs)
}

// touch makes every hash of the chain hs cached and most recently used, the
// first one most recent. A chain longer than the cache keeps its head.
func (c *blockCache) touch(hs []BlockHash) {
	if len(hs) > c.capacity {
		hs = hs[:c.capacity]
	}
	for i := len(hs) - 1; i >= 0; i-- {
		h := hs[i]
		if n, ok := c.index[h]; ok {
			c.moveToFront(n)
			continue
		}
		var n int32
		if len(c.nodes) < c.capacity {
			n = int32(len(c.nodes))
			c.nodes = append(c.nodes, cacheNode{})
		} else {
			n = c.tail
			c.unlink(n)
			delete(c.index, c.nodes[n].hash)
		}
		c.nodes[n].hash = h
		c.index[h] = n
		c.pushFront(n)
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
