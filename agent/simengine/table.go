package simengine

// blockTable maps block hashes to nodes of a blockCache: open addressing
// with linear probing and backward-shift deletion. A slot holds the full
// hash, so a lookup reads one slot and no node. The upper 32 bits of the
// hash pick the home slot by multiply-shift, so the size need not be a
// power of two: the table grows to at most maxLoadDen/maxLoadNum slots per
// block of capacity (about 23 bytes per block), where a power-of-two table
// at a full cache would be half empty (32 bytes per block).
type blockTable struct {
	slots []tableSlot
	count int
	limit int // count at which the table grows
	max   int // slots for a full cache; 0 means no bound
}

type tableSlot struct {
	h BlockHash
	n int32 // node index plus one; 0 marks an empty slot
}

// The table's load stays at or below maxLoadNum/maxLoadDen.
const (
	maxLoadNum = 7
	maxLoadDen = 10
)

// minTableSlots is the size of a new table.
const minTableSlots = 1024

// init bounds the table for a cache of capacity blocks.
func (x *blockTable) init(capacity int) {
	x.max = max(capacity*maxLoadDen/maxLoadNum+1, 8)
}

// home returns the first slot probed for h.
func (x *blockTable) home(h BlockHash) int {
	return int((uint64(h) >> 32) * uint64(len(x.slots)) >> 32)
}

// get returns the node holding h.
func (x *blockTable) get(h BlockHash) (int32, bool) {
	if len(x.slots) == 0 {
		return 0, false
	}
	for i := x.home(h); ; {
		s := &x.slots[i]
		if s.n == 0 {
			return 0, false
		}
		if s.h == h {
			return s.n - 1, true
		}
		if i++; i == len(x.slots) {
			i = 0
		}
	}
}

// insert records that node n holds h, which the table must not hold.
func (x *blockTable) insert(h BlockHash, n int32) {
	if x.count >= x.limit {
		x.grow()
	}
	x.place(tableSlot{h: h, n: n + 1})
	x.count++
}

// place puts s into the first empty slot from its home.
func (x *blockTable) place(s tableSlot) {
	for i := x.home(s.h); ; {
		if x.slots[i].n == 0 {
			x.slots[i] = s
			return
		}
		if i++; i == len(x.slots) {
			i = 0
		}
	}
}

// del removes h.
func (x *blockTable) del(h BlockHash) {
	if len(x.slots) == 0 {
		return
	}
	size := len(x.slots)
	i := x.home(h)
	for x.slots[i].h != h || x.slots[i].n == 0 {
		if x.slots[i].n == 0 {
			return
		}
		if i++; i == size {
			i = 0
		}
	}
	// Shift back every later entry of the run whose home slot is not
	// between the hole and itself, so that probes never stop early.
	for j := i; ; {
		if j++; j == size {
			j = 0
		}
		s := x.slots[j]
		if s.n == 0 {
			break
		}
		home := x.home(s.h)
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			x.slots[i] = s
			i = j
		}
	}
	x.slots[i] = tableSlot{}
	x.count--
}

func (x *blockTable) grow() {
	old := x.slots
	size := max(minTableSlots, len(old)*2)
	if x.max > 0 {
		size = min(size, max(x.max, len(old)+1))
	}
	x.slots = make([]tableSlot, size)
	x.limit = size * maxLoadNum / maxLoadDen
	if x.limit >= size { // tiny tables: keep one slot empty
		x.limit = size - 1
	}
	for _, s := range old {
		if s.n != 0 {
			x.place(s)
		}
	}
}
