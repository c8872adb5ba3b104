package scheduler

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"
)

// sessionMachine drives a session table and its model: each key's
// endpoint and last success, as touched. The table may drop a session only
// for a reason the model can check: it expired or its endpoint was removed
// (purge, lookup), the table was full (the least recent goes), or evictIf
// asked. In exact mode the table is smaller than one purge (maxPurge), so
// it is kept in expiry order exactly; larger tables may keep a binding
// learned out of order a little late, never early.
type sessionMachine struct {
	t     *testing.T
	tb    *sessionTable
	now   int64
	eps   []*endpoint // the current endpoint of each of sessionEPs
	gone  []*endpoint // removed endpoints
	exact bool

	model map[string]sessionEntry
}

const sessionEPs = 3

var sessionTTL = int64(5 * time.Minute)

func newSessionMachine(t *testing.T, o *opBytes) *sessionMachine {
	exact := o.intn(2) == 0
	size := 1 + o.intn(maxPurge)
	if !exact {
		size = maxPurge + 1 + o.intn(3*maxPurge)
	}
	m := &sessionMachine{t: t, tb: newSessionTable(sessionTTL, size), exact: exact, now: 1e12, model: map[string]sessionEntry{}}
	for i := range sessionEPs {
		m.eps = append(m.eps, &endpoint{id: fmt.Sprint("e", i)})
	}
	return m
}

// key returns a session key: from a pool somewhat larger than the table.
func (m *sessionMachine) key(o *opBytes) string {
	return fmt.Sprint("s", int(o.next())%(m.tb.max+m.tb.max/2+2))
}

// live reports whether the model's entry for a session is in force.
func (m *sessionMachine) live(en sessionEntry) bool {
	return m.now-en.last < m.tb.ttl && !en.ep.removed
}

func (m *sessionMachine) step(o *opBytes) {
	t := m.t
	before := maps.Clone(m.model)
	var evictable string // the one key evictIf may drop
	full := false        // a new key arrived, maybe with the table full
	var fresh string     // that key
	switch op := o.intn(16); {
	case op < 6: // a local success: now
		k, e := m.key(o), m.eps[o.intn(sessionEPs)]
		full, fresh = m.model[k].ep == nil, k
		m.tb.touch(k, e, m.now)
		m.model[k] = sessionEntry{key: k, ep: e, last: m.now}
	case op < 8: // a binding learned from a peer: a success up to a TTL ago
		k, e := m.key(o), m.eps[o.intn(sessionEPs)]
		at := m.now - int64(o.next())*m.tb.ttl/256
		full, fresh = m.model[k].ep == nil, k
		m.tb.touch(k, e, at)
		m.model[k] = sessionEntry{key: k, ep: e, last: at}
	case op < 10:
		k := m.key(o)
		got := m.tb.lookup(k, m.now)
		en, ok := m.model[k]
		var want *endpoint
		if ok && m.live(en) {
			want = en.ep
		}
		if got != want {
			t.Fatalf("lookup(%s) = %s, model %s at %d (now %d, TTL %d)", k, epName(got), epName(en.ep), en.last, m.now, m.tb.ttl)
		}
	case op < 11:
		k, e := m.key(o), m.eps[o.intn(sessionEPs)]
		m.tb.evictIf(k, e)
		if m.model[k].ep == e {
			evictable = k
		}
	case op < 12:
		m.tb.purge(m.now)
	case op < 13 && o.intn(4) == 0: // an endpoint removed, another in its place
		i := o.intn(sessionEPs)
		m.eps[i].removed = true
		m.gone = append(m.gone, m.eps[i])
		m.eps[i] = &endpoint{id: m.eps[i].id}
	default:
		m.now += int64(o.next()) * m.tb.ttl / 64
	}
	// Every session the table dropped had to go.
	var bound []string
	for k, en := range before {
		if _, ok := m.tb.index[k]; ok || m.model[k].ep != en.ep {
			continue
		}
		switch {
		case k == evictable, !m.live(en):
		case full:
			bound = append(bound, k)
		default:
			t.Fatalf("session %s (%s at %d) lost at %d", k, epName(en.ep), en.last, m.now)
		}
		delete(m.model, k)
	}
	if len(bound) > 1 || len(bound) == 1 && m.tb.len() != m.tb.max {
		t.Fatalf("one new session evicted %d live ones (%v), leaving %d of %d", len(bound), bound, m.tb.len(), m.tb.max)
	}
	if len(bound) == 1 && m.exact {
		// The least recent success goes.
		for k, en := range m.model {
			if k != fresh && m.live(en) && en.last < before[bound[0]].last {
				t.Fatalf("full table evicted %s (last %d), kept %s (last %d)", bound[0], before[bound[0]].last, k, en.last)
			}
		}
	}
	m.check()
}

// check compares the table with the model: the same sessions, on the same
// endpoints, none twice, within the bound, each endpoint's count of
// sessions right, and (exact) the list in expiry order.
func (m *sessionMachine) check() {
	t, tb := m.t, m.tb
	for k, en := range m.model {
		i, ok := tb.index[k]
		if !ok {
			// Dropped by the table; it must have had a reason, checked
			// in step. Keys the model holds but the table dropped can
			// only be ones not live any more.
			if m.live(en) {
				t.Fatalf("live session %s missing", k)
			}
			delete(m.model, k)
			continue
		}
		if got := tb.ents[i]; got.key != k || got.ep != en.ep || got.last != en.last {
			t.Fatalf("session %s is %s at %d, model %s at %d", k, epName(got.ep), got.last, epName(en.ep), en.last)
		}
	}
	if len(tb.index) != len(m.model) || tb.len() > tb.max {
		t.Fatalf("%d sessions (bound %d), model %d", tb.len(), tb.max, len(m.model))
	}
	var keys []string
	var lasts []int64
	for i := tb.list.Head(); i >= 0 && len(keys) <= len(tb.ents); i = tb.list.Next(i) {
		keys = append(keys, tb.ents[i].key)
		lasts = append(lasts, tb.ents[i].last)
		if tb.index[tb.ents[i].key] != i {
			t.Fatalf("slot %d holds %s, indexed at %d", i, tb.ents[i].key, tb.index[tb.ents[i].key])
		}
	}
	if len(keys) != len(tb.index) {
		t.Fatalf("list of %d sessions, index of %d", len(keys), len(tb.index))
	}
	if m.exact && !slices.IsSortedFunc(lasts, func(a, b int64) int { return int(b - a) }) {
		t.Fatalf("list not in expiry order: %v", lasts)
	}
	count := map[*endpoint]int{}
	for _, en := range m.model {
		count[en.ep]++
	}
	for _, e := range append(slices.Clone(m.eps), m.gone...) {
		if e.sessions != count[e] {
			t.Fatalf("%s (removed %v) counts %d sessions, maps %d", e.id, e.removed, e.sessions, count[e])
		}
	}
}

// TestSessionTableProperties: random local successes, bindings learned
// out of order, lookups, evictions, purges, endpoint removals and clock
// moves keep the session table equal to its model: lookups answer the
// last success while it lives and never after its TTL or its endpoint's
// removal, a session is dropped only when it expired, its endpoint went,
// the table was full (the least recent one) or evictIf asked, the table
// stays within its bound and each endpoint counts its sessions right.
func TestSessionTableProperties(t *testing.T) { checkProperty(t, 200, 600, newSessionMachine) }

// FuzzSessionTable is TestSessionTableProperties on the fuzzer's operation sequences.
func FuzzSessionTable(f *testing.F) {
	f.Add([]byte{0, 4, 0, 1, 1, 0, 2, 2, 6, 3, 100, 0, 9, 1, 13, 70, 8, 2, 11})
	f.Add([]byte{1, 20, 6, 9, 1, 7, 200, 2, 0, 3, 0, 12, 0, 1, 0, 4, 1, 10, 2, 0, 11})
	fuzzMachine(f, 2048, newSessionMachine)
}

// epName names an endpoint in a failure message.
func epName(e *endpoint) string {
	switch {
	case e == nil:
		return "none"
	case e.removed:
		return e.id + " (removed)"
	}
	return e.id
}
