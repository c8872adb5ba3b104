package scheduler

// sessionTable maps session keys to the endpoint that last served them
// successfully. It is an LRU list ordered by last success, which is also
// expiry order, so expired entries are always at the tail. Entries live in
// one slice linked by index to keep the garbage collector's work small at a
// million sessions. Guarded by Scheduler.mu.
type sessionTable struct {
	ttl   int64
	max   int
	index map[string]int32
	ents  []sessionEntry
	head  int32 // most recently used, -1 when empty
	tail  int32 // least recently used, -1 when empty
	free  int32 // free list through next, -1 when empty
}

type sessionEntry struct {
	key        string
	ep         *endpoint
	last       int64 // last success, nanoseconds since Scheduler.epoch
	prev, next int32
}

// maxPurge bounds the expired entries dropped by one operation, so a pick
// after a long idle period does not pay for the whole table at once.
const maxPurge = 64

func newSessionTable(ttl int64, max int) *sessionTable {
	return &sessionTable{ttl: ttl, max: max, index: make(map[string]int32), head: -1, tail: -1, free: -1}
}

func (t *sessionTable) len() int { return len(t.index) }

// lookup returns the endpoint a live session maps to, or nil.
func (t *sessionTable) lookup(key string, now int64) *endpoint {
	i, ok := t.index[key]
	if !ok {
		return nil
	}
	en := &t.ents[i]
	if now-en.last >= t.ttl {
		return nil
	}
	if en.ep.removed {
		t.delete(i)
		return nil
	}
	return en.ep
}

// touch maps key to ep as of now and makes it the most recent entry.
func (t *sessionTable) touch(key string, ep *endpoint, now int64) {
	if i, ok := t.index[key]; ok {
		en := &t.ents[i]
		if en.ep != ep {
			en.ep.sessions--
			ep.sessions++
		}
		en.ep = ep
		en.last = now
		t.unlink(i)
		t.pushFront(i)
		return
	}
	t.purge(now)
	for len(t.index) >= t.max && t.tail >= 0 {
		t.delete(t.tail)
	}
	var i int32
	if t.free >= 0 {
		i = t.free
		t.free = t.ents[i].next
	} else {
		t.ents = append(t.ents, sessionEntry{})
		i = int32(len(t.ents) - 1)
	}
	t.ents[i] = sessionEntry{key: key, ep: ep, last: now}
	ep.sessions++
	t.index[key] = i
	t.pushFront(i)
}

// evictIf forgets key if it maps to ep.
func (t *sessionTable) evictIf(key string, ep *endpoint) {
	if i, ok := t.index[key]; ok && t.ents[i].ep == ep {
		t.delete(i)
	}
}

// purge drops up to maxPurge expired entries from the tail.
func (t *sessionTable) purge(now int64) {
	for n := 0; n < maxPurge && t.tail >= 0; n++ {
		en := &t.ents[t.tail]
		if now-en.last < t.ttl && !en.ep.removed {
			return
		}
		t.delete(t.tail)
	}
}

func (t *sessionTable) delete(i int32) {
	t.unlink(i)
	t.ents[i].ep.sessions--
	delete(t.index, t.ents[i].key)
	t.ents[i] = sessionEntry{next: t.free, prev: -1}
	t.free = i
}

func (t *sessionTable) unlink(i int32) {
	en := &t.ents[i]
	if en.prev >= 0 {
		t.ents[en.prev].next = en.next
	} else {
		t.head = en.next
	}
	if en.next >= 0 {
		t.ents[en.next].prev = en.prev
	} else {
		t.tail = en.prev
	}
	en.prev, en.next = -1, -1
}

func (t *sessionTable) pushFront(i int32) {
	en := &t.ents[i]
	en.prev = -1
	en.next = t.head
	if t.head >= 0 {
		t.ents[t.head].prev = i
	}
	t.head = i
	if t.tail < 0 {
		t.tail = i
	}
}
