package scheduler

import (
	"sync"
	"time"

	"github.com/computeflux/computeflux/scheduler/slab"
)

// Session bindings shared between schedulers (relays). Each scheduler
// keeps its own session table (sessions.go); a BindingTable beside it holds
// the versioned binding of every session as all schedulers agree on it, and
// Bind installs a binding learned from a peer into the local table.
//
// The order that makes every table converge to the same binding, whatever
// order updates arrive in:
//
//  1. A higher Gen wins: a move (the serving scheduler could not use the
//     bound endpoint and chose another) counts one more than the binding it
//     replaced, so every scheduler follows a move.
//  2. Same Gen: the earlier Since wins. Two schedulers that bind a new
//     session at once (or move it at once) keep the first binding: the
//     endpoint that served first has started building the cache.
//  3. Same Gen and Since: the smaller endpoint ID wins (any fixed rule).
//
// Updates of one binding (same Endpoint, Gen and Since) merge to the
// latest Last (last success). The table's state is thus the maximum of all
// updates in one fixed order, which is why the arrival order does not
// matter. A scheduler that adopts a peer's binding refreshes that binding
// with its own successes.

// Binding is one session's shared binding. Times are Unix nanoseconds: the
// schedulers that share bindings run on different machines (NTP-synced
// clocks; a skew only matters for bindings made within it of each other).
type Binding struct {
	// Key is the session key.
	Key string
	// Endpoint is the bound endpoint's ID.
	Endpoint string
	// Gen counts the moves since the session was first bound (1 = first
	// binding).
	Gen uint32
	// Since is when the session was bound to Endpoint.
	Since int64
	// Last is the last success on Endpoint that the table has seen.
	Last int64
}

// wins reports whether b takes precedence over o (rule above).
func (b Binding) wins(o Binding) bool {
	switch {
	case b.Gen != o.Gen:
		return b.Gen > o.Gen
	case b.Since != o.Since:
		return b.Since < o.Since
	}
	return b.Endpoint < o.Endpoint
}

// BindingTable is the versioned binding of every session, bounded by a TTL
// on Last and a size (least recently used evicted). It is pure: no I/O, no
// goroutines, times passed in. Safe for concurrent use.
type BindingTable struct {
	ttl     int64
	max     int
	refresh int64

	mu    sync.Mutex // guards the following fields
	m     map[string]int32
	nodes []bindNode // by slot of list, which is in order of last touch
	list  slab.List
	names map[string]string // interned endpoint IDs
}

type bindNode struct {
	b    Binding
	sent int64 // Last as of the last time Local asked to share it
}

// NewBindingTable returns a table whose bindings live ttl after their last
// success (0 means 5 minutes, the scheduler's SessionTTL default) and that
// holds at most max sessions (0 means 1,000,000). A binding's refresh (a
// success on the same endpoint) is worth sharing again once ttl/10 passed
// since it was last shared, so that peers do not expire a session busy
// elsewhere.
func NewBindingTable(ttl time.Duration, max int) *BindingTable {
	if ttl <= 0 {
		ttl = 5 * time.Minute
	}
	if max <= 0 {
		max = 1_000_000
	}
	return &BindingTable{ttl: int64(ttl), max: max, refresh: int64(ttl) / 10,
		m: make(map[string]int32), list: slab.New(), names: make(map[string]string)}
}

// Len returns the number of sessions held, expired ones not yet dropped
// included.
func (t *BindingTable) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// Local records a success of session key on endpoint at now, on this
// scheduler, and returns the resulting binding and whether it should be
// shared: a new binding or a move (Gen one above the binding it replaces,
// expired or not), or a refresh not shared for ttl/10.
func (t *BindingTable) Local(key, endpoint string, now time.Time) (Binding, bool) {
	ns := now.UnixNano()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.purge(ns)
	i, n := t.node(key)
	if n != nil && n.b.Endpoint == endpoint && ns-n.b.Last < t.ttl {
		n.b.Last = max(n.b.Last, ns)
		t.list.Touch(i)
		if ns-n.sent < t.refresh {
			return n.b, false
		}
		n.sent = ns
		return n.b, true
	}
	b := Binding{Key: key, Endpoint: t.intern(endpoint), Gen: 1, Since: ns, Last: ns}
	if n != nil {
		b.Gen = n.b.Gen + 1
		n.b, n.sent = b, ns
		t.list.Touch(i)
		return b, true
	}
	t.insert(bindNode{b: b, sent: ns})
	return b, true
}

// Merge applies a binding learned from a peer at now and reports whether
// the table's binding for b.Key changed (b won, or refreshed the same
// binding). Expired or malformed bindings are ignored.
func (t *BindingTable) Merge(b Binding, now time.Time) bool {
	ns := now.UnixNano()
	if b.Key == "" || b.Endpoint == "" || b.Gen == 0 || b.Last < b.Since || ns-b.Last >= t.ttl {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i, n := t.node(b.Key)
	if n == nil {
		t.purge(ns)
		b.Endpoint = t.intern(b.Endpoint)
		// Received, not ours to share again.
		t.insert(bindNode{b: b, sent: b.Last})
		return true
	}
	cur := n.b
	switch {
	case cur.Endpoint == b.Endpoint && cur.Gen == b.Gen && cur.Since == b.Since:
		// The same binding, refreshed.
		if b.Last <= cur.Last {
			return false
		}
		n.b.Last = b.Last
		n.sent = max(n.sent, b.Last)
	case b.wins(cur) || ns-cur.Last >= t.ttl:
		b.Endpoint = t.intern(b.Endpoint)
		n.b, n.sent = b, b.Last
	default:
		return false
	}
	t.list.Touch(i)
	return true
}

// Lookup returns the live binding of key at now.
func (t *BindingTable) Lookup(key string, now time.Time) (Binding, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, n := t.node(key)
	if n == nil || now.UnixNano()-n.b.Last >= t.ttl {
		return Binding{}, false
	}
	return n.b, true
}

// Live returns up to limit live bindings at now, most recent first (what a
// peer that just connected is sent). limit <= 0 means all.
func (t *BindingTable) Live(now time.Time, limit int) []Binding {
	ns := now.UnixNano()
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Binding
	for i := t.list.Head(); i >= 0 && (limit <= 0 || len(out) < limit); i = t.list.Next(i) {
		if n := &t.nodes[i]; ns-n.b.Last < t.ttl {
			out = append(out, n.b)
		}
	}
	return out
}

// purge drops up to maxPurge expired bindings from the tail. The list is in
// order of last touch, which is nearly the order of Last (merged bindings
// carry a peer's Last), so a binding out of order expires a little late,
// never early: Lookup checks the TTL itself.
func (t *BindingTable) purge(ns int64) {
	for i := 0; i < maxPurge && t.list.Tail() >= 0 && ns-t.nodes[t.list.Tail()].b.Last >= t.ttl; i++ {
		t.remove(t.list.Tail())
	}
}

// node returns key's slot and node, or a nil node.
func (t *BindingTable) node(key string) (int32, *bindNode) {
	i, ok := t.m[key]
	if !ok {
		return -1, nil
	}
	return i, &t.nodes[i]
}

func (t *BindingTable) insert(n bindNode) {
	for len(t.m) >= t.max && t.list.Tail() >= 0 {
		t.remove(t.list.Tail())
	}
	i, grew := t.list.Alloc()
	if grew {
		t.nodes = append(t.nodes, n)
	} else {
		t.nodes[i] = n
	}
	t.m[n.b.Key] = i
}

func (t *BindingTable) remove(i int32) {
	t.list.Release(i)
	delete(t.m, t.nodes[i].b.Key)
	t.nodes[i] = bindNode{}
	if len(t.m) == 0 {
		clear(t.names)
	}
}

// maxNames bounds the interned endpoint IDs; past it IDs are kept as given.
const maxNames = 1 << 16

// intern returns one shared copy of an endpoint ID: a million sessions
// over a few hundred endpoints should not hold a million copies.
func (t *BindingTable) intern(id string) string {
	if s, ok := t.names[id]; ok {
		return s
	}
	if len(t.names) < maxNames {
		t.names[id] = id
	}
	return id
}

// Bind installs a binding learned from elsewhere (a peer relay) into the
// session table: key maps to endpoint id as if it had last succeeded at
// (never later than now). It reports whether the table now maps key to id;
// false when id is unknown or removed, or at is older than the TTL. A local
// mapping to id with a later success is kept as it is. Bound sessions count
// towards the endpoint's load like local ones.
func (s *Scheduler) Bind(key, id string, at time.Time) bool {
	if key == "" {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.endpoints[id]
	if e == nil || e.removed {
		return false
	}
	now := s.now()
	ns := min(int64(at.Sub(s.epoch)), now)
	if now-ns >= s.sessions.ttl {
		return false
	}
	if i, ok := s.sessions.index[key]; ok {
		if en := &s.sessions.ents[i]; en.ep == e && en.last >= ns {
			return true
		}
	}
	s.sessions.touch(key, e, ns)
	return true
}

// Binding returns the endpoint a live session maps to in the session
// table, and its last success.
func (s *Scheduler) Binding(key string) (id string, last time.Time, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.sessions.lookup(key, now)
	if e == nil {
		return "", time.Time{}, false
	}
	return e.id, s.timeAt(s.sessions.ents[s.sessions.index[key]].last), true
}
