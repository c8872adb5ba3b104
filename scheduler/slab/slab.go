// Package slab orders the slots of a slab (a slice its owner keeps in step
// by index) most recently used first, with a free list of released slots.
// The links live apart from the owner's payload, so one list serves every
// slab: the scheduler's session, binding and block tables, and the
// simulated engine's cache.
package slab

// List is the order of a slab's slots and its free list. Slots are int32
// indexes; -1 stands for none. Its zero value is not ready: use New. A List
// is not safe for concurrent use.
type List struct {
	links      []link
	head, tail int32 // most and least recently used; -1 when empty
	free       int32 // free list through next; -1 when empty
}

type link struct {
	prev, next int32 // towards head, towards tail
}

// New returns an empty List.
func New() List { return List{head: -1, tail: -1, free: -1} }

// Head returns the most recently used slot, or -1.
func (l *List) Head() int32 { return l.head }

// Tail returns the least recently used slot, or -1.
func (l *List) Tail() int32 { return l.tail }

// Next returns the slot used just before n (towards the tail), or -1.
func (l *List) Next(n int32) int32 { return l.links[n].next }

// Prev returns the slot used just after n (towards the head), or -1.
func (l *List) Prev(n int32) int32 { return l.links[n].prev }

// Grow makes room for n more new slots without reallocating, as
// slices.Grow does: for owners that size their slab themselves.
func (l *List) Grow(n int) {
	if n > cap(l.links)-len(l.links) {
		l.links = append(make([]link, 0, len(l.links)+n), l.links...)
	}
}

// Alloc returns a slot at the front of the list, reusing a released one if
// any. grew reports that the slot is new: the owner appends its payload.
func (l *List) Alloc() (n int32, grew bool) {
	if l.free >= 0 {
		n = l.free
		l.free = l.links[n].next
	} else {
		l.links = append(l.links, link{})
		n, grew = int32(len(l.links)-1), true
	}
	l.links[n] = link{prev: -1, next: -1}
	l.pushFront(n)
	return n, grew
}

// Release unlinks slot n and puts it on the free list.
func (l *List) Release(n int32) {
	l.unlink(n)
	l.links[n] = link{prev: -1, next: l.free}
	l.free = n
}

// Touch makes slot n the most recent.
func (l *List) Touch(n int32) {
	if l.head == n {
		return
	}
	l.unlink(n)
	l.pushFront(n)
}

// MoveAfter moves slot n to just behind slot p (towards the tail).
func (l *List) MoveAfter(n, p int32) {
	if n == p {
		return
	}
	l.unlink(n)
	nx := l.links[p].next
	l.links[n] = link{prev: p, next: nx}
	l.links[p].next = n
	if nx >= 0 {
		l.links[nx].prev = n
	} else {
		l.tail = n
	}
}

func (l *List) unlink(n int32) {
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

func (l *List) pushFront(n int32) {
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
