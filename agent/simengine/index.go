package simengine

// blockIndex maps block hashes to cache nodes: an open-addressing table
// with linear probing and backward-shift deletion. Block hashes are already
// well mixed, so their low bits pick the slot. It replaces a Go map on the
// simulator's hottest path (a benchmark drives a thousand engines at once)
// and costs about 21 bytes per block at its maximum load of 3/4.
type blockIndex struct {
	slots []indexSlot // length is zero or a power of two
	count int
}

type indexSlot struct {
	h BlockHash
	n int32 // node index plus one; 0 marks an empty slot
}

func (x *blockIndex) get(h BlockHash) (int32, bool) {
	if len(x.slots) == 0 {
		return 0, false
	}
	mask := len(x.slots) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		s := &x.slots[i]
		if s.n == 0 {
			return 0, false
		}
		if s.h == h {
			return s.n - 1, true
		}
	}
}

func (x *blockIndex) put(h BlockHash, n int32) {
	if (x.count+1)*4 > len(x.slots)*3 {
		x.grow()
	}
	mask := len(x.slots) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		s := &x.slots[i]
		if s.n == 0 {
			*s = indexSlot{h: h, n: n + 1}
			x.count++
			return
		}
		if s.h == h {
			s.n = n + 1
			return
		}
	}
}

func (x *blockIndex) del(h BlockHash) {
	if len(x.slots) == 0 {
		return
	}
	mask := len(x.slots) - 1
	i := int(h) & mask
	for ; x.slots[i].h != h || x.slots[i].n == 0; i = (i + 1) & mask {
		if x.slots[i].n == 0 {
			return
		}
	}
	// Shift back every later entry of the run whose home slot is not
	// between the hole and itself, so that probes never stop early.
	for j := i; ; {
		j = (j + 1) & mask
		if x.slots[j].n == 0 {
			break
		}
		home := int(x.slots[j].h) & mask
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			x.slots[i] = x.slots[j]
			i = j
		}
	}
	x.slots[i] = indexSlot{}
	x.count--
}

func (x *blockIndex) grow() {
	old := x.slots
	size := max(len(old)*2, 1024)
	x.slots = make([]indexSlot, size)
	x.count = 0
	for _, s := range old {
		if s.n != 0 {
			x.put(s.h, s.n-1)
		}
	}
}
