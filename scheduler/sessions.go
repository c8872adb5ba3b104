package scheduler

import "github.com/computeflux/computeflux/scheduler/slab"

// sessionTable maps session keys to the endpoint that last served them
// successfully. It is an LRU list ordered by last success, which is also
// expiry order, so expired entries are always at the tail. Entries live in
// one slice linked by index to keep the garbage collector's work small at a
// million sessions. Guarded by Scheduler.mu.
type sessionTable struct {
	ttl   int64
	max   int
	index map[string]int32
	ents  []sessionEntry // by slot of list
	list  slab.List
}

type sessionEntry struct {
	key  string
	ep   *endpoint
	last int64 // last success, nanoseconds since Scheduler.epoch
}

// maxPurge bounds the expired entries dropped by one operation, so a pick
// after a long idle period does not pay for the whole table at once.
const maxPurge = 64

func newSessionTable(ttl int64, max int) *sessionTable {
	return &sessionTable{ttl: ttl, max: max, index: make(map[string]int32), list: slab.New()}
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

// touch maps key to ep as of now and makes it the most recent entry, or,
// for a success older than the newest (a binding learned from a peer),
// places it in order of last success (see place).
func (t *sessionTable) touch(key string, ep *endpoint, now int64) {
	i, ok := t.index[key]
	if ok {
		en := &t.ents[i]
		if en.ep != ep {
			en.ep.sessions--
			ep.sessions++
		}
		en.ep = ep
		en.last = now
		t.list.Touch(i)
	} else {
		t.purge(now)
		for len(t.index) >= t.max && t.list.Tail() >= 0 {
			t.delete(t.list.Tail())
		}
		var grew bool
		i, grew = t.list.Alloc()
		if grew {
			t.ents = append(t.ents, sessionEntry{key: key, ep: ep, last: now})
		} else {
			t.ents[i] = sessionEntry{key: key, ep: ep, last: now}
		}
		ep.sessions++
		t.index[key] = i
	}
	if next := t.list.Next(i); next >= 0 && t.ents[next].last > now {
		t.place(i, next) // out of order; in order is the common case, a local success
	}
}

// place moves entry i, just put at the front before next, which has a later
// success, back behind the entries with a later success, so that the list
// stays in expiry order. It searches from the end nearer in time, at most
// maxPurge steps; past that the entry stays where the search stopped, and
// it or a neighbour expires a little late, never early (lookup checks the
// TTL itself).
func (t *sessionTable) place(i, next int32) {
	last := t.ents[i].last
	p := next // the entry i goes behind: the last one with a later success
	if tail := t.list.Tail(); last-t.ents[tail].last < t.ents[next].last-last {
		p = tail
		for n := 0; n < maxPurge && p != next && t.ents[p].last <= last; n++ {
			p = t.list.Prev(p)
		}
	} else {
		for n := 0; n < maxPurge; n++ {
			q := t.list.Next(p)
			if q < 0 || t.ents[q].last <= last {
				break
			}
			p = q
		}
	}
	t.list.MoveAfter(i, p)
}

// evictIf forgets key if it maps to ep.
func (t *sessionTable) evictIf(key string, ep *endpoint) {
	if i, ok := t.index[key]; ok && t.ents[i].ep == ep {
		t.delete(i)
	}
}

// purge drops up to maxPurge expired entries from the tail.
func (t *sessionTable) purge(now int64) {
	for n := 0; n < maxPurge && t.list.Tail() >= 0; n++ {
		en := &t.ents[t.list.Tail()]
		if now-en.last < t.ttl && !en.ep.removed {
			return
		}
		t.delete(t.list.Tail())
	}
}

func (t *sessionTable) delete(i int32) {
	t.list.Release(i)
	t.ents[i].ep.sessions--
	delete(t.index, t.ents[i].key)
	t.ents[i] = sessionEntry{}
}
