package scheduler

// slabList orders the slots of a slab (a slice the owner keeps in step by
// index) most recently used first, and keeps a free list of released slots.
// Links live apart from the owner's payload so one list serves every slab.
type slabList struct {
	links      []slabLink
	head, tail int32 // most and least recently used; -1 when empty
	free       int32 // free list through next; -1 when empty
}

type slabLink struct {
	prev, next int32 // towards head, towards tail
}

func newSlabList() slabList { return slabList{head: -1, tail: -1, free: -1} }

// alloc returns a slot at the front of the list, reusing a released one if
// any. grew reports that the slot is new: the owner appends its payload.
func (l *slabList) alloc() (n int32, grew bool) {
	if l.free >= 0 {
		n = l.free
		l.free = l.links[n].next
	} else {
		l.links = append(l.links, slabLink{})
		n, grew = int32(len(l.links)-1), true
	}
	l.links[n] = slabLink{prev: -1, next: -1}
	l.pushFront(n)
	return n, grew
}

// release unlinks slot n and puts it on the free list.
func (l *slabList) release(n int32) {
	l.unlink(n)
	l.links[n] = slabLink{prev: -1, next: l.free}
	l.free = n
}

// touch makes slot n the most recent.
func (l *slabList) touch(n int32) {
	if l.head == n {
		return
	}
	l.unlink(n)
	l.pushFront(n)
}

// moveAfter moves slot n to just behind slot p (towards the tail).
func (l *slabList) moveAfter(n, p int32) {
	if n == p {
		return
	}
	l.unlink(n)
	nx := l.links[p].next
	l.links[n] = slabLink{prev: p, next: nx}
	l.links[p].next = n
	if nx >= 0 {
		l.links[nx].prev = n
	} else {
		l.tail = n
	}
}

func (l *slabList) unlink(n int32) {
	lk := &l.links[n]
	if lk.prev >= 0 {
		l.links[lk.prev].next = lk.next
	} else {
		l.head = lk.next
	}
	if lk.next >= 0 {
		l.links[lk.next].prev = lk.prev
	} else {
		l.tail = lk.prev
	}
	lk.prev, lk.next = -1, -1
}

func (l *slabList) pushFront(n int32) {
	lk := &l.links[n]
	lk.prev, lk.next = -1, l.head
	if l.head >= 0 {
		l.links[l.head].prev = n
	}
	l.head = n
	if l.tail < 0 {
		l.tail = n
	}
}
