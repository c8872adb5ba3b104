package scheduler

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// bindMachine drives a BindingTable and its model: a slice of bindings in
// order of last touch (most recent first), with the rules of Local and
// Merge written out plainly.
type bindMachine struct {
	t   *testing.T
	tb  *BindingTable
	ttl int64
	max int
	now time.Time

	model []bindNode
}

func newBindMachine(t *testing.T, o *opBytes) *bindMachine {
	ttl, max := time.Minute, 1+o.intn(12)
	return &bindMachine{t: t, tb: NewBindingTable(ttl, max), ttl: int64(ttl), max: max, now: t0}
}

func (m *bindMachine) find(key string) int {
	return slices.IndexFunc(m.model, func(n bindNode) bool { return n.b.Key == key })
}

func (m *bindMachine) expired(b Binding, ns int64) bool { return ns-b.Last >= m.ttl }

// front moves the model's node i to the front.
func (m *bindMachine) front(i int) {
	n := m.model[i]
	m.model = slices.Insert(slices.Delete(m.model, i, i+1), 0, n)
}

// purge drops up to maxPurge expired bindings from the tail.
func (m *bindMachine) purge(ns int64) {
	for i := 0; i < maxPurge && len(m.model) > 0 && m.expired(m.model[len(m.model)-1].b, ns); i++ {
		m.model = m.model[:len(m.model)-1]
	}
}

func (m *bindMachine) insert(n bindNode) {
	if len(m.model) >= m.max {
		m.model = m.model[:m.max-1]
	}
	m.model = slices.Insert(m.model, 0, n)
}

// local is Local's rule: a success on the bound endpoint refreshes the
// binding (shared again once ttl/10 passed since it was last shared);
// anything else binds anew, one generation above the binding replaced.
func (m *bindMachine) local(key, endpoint string, ns int64) (Binding, bool) {
	m.purge(ns)
	i := m.find(key)
	if i >= 0 && m.model[i].b.Endpoint == endpoint && !m.expired(m.model[i].b, ns) {
		n := &m.model[i]
		n.b.Last = max(n.b.Last, ns)
		share := ns-n.sent >= m.ttl/10
		if share {
			n.sent = ns
		}
		b := n.b
		m.front(i)
		return b, share
	}
	b := Binding{Key: key, Endpoint: endpoint, Gen: 1, Since: ns, Last: ns}
	if i >= 0 {
		b.Gen = m.model[i].b.Gen + 1
		m.model[i] = bindNode{b: b, sent: ns}
		m.front(i)
		return b, true
	}
	m.insert(bindNode{b: b, sent: ns})
	return b, true
}

// merge is Merge's rule: a higher Gen wins, then the earlier Since, then
// the smaller endpoint; the same binding merges to its latest Last; an
// expired binding is replaced by any.
func (m *bindMachine) merge(b Binding, ns int64) bool {
	if b.Key == "" || b.Endpoint == "" || b.Gen == 0 || b.Last < b.Since || m.expired(b, ns) {
		return false
	}
	i := m.find(b.Key)
	if i < 0 {
		m.purge(ns)
		m.insert(bindNode{b: b, sent: b.Last})
		return true
	}
	cur := m.model[i].b
	wins := b.Gen > cur.Gen || b.Gen == cur.Gen && (b.Since < cur.Since || b.Since == cur.Since && b.Endpoint < cur.Endpoint)
	switch {
	case cur.Endpoint == b.Endpoint && cur.Gen == b.Gen && cur.Since == b.Since:
		if b.Last <= cur.Last {
			return false
		}
		m.model[i].b.Last = b.Last
		m.model[i].sent = max(m.model[i].sent, b.Last)
	case wins || m.expired(cur, ns):
		m.model[i] = bindNode{b: b, sent: b.Last}
	default:
		return false
	}
	m.front(i)
	return true
}

var bindEPs = []string{"", "e0", "e1", "e2"}

func (m *bindMachine) step(o *opBytes) {
	t := m.t
	key := fmt.Sprint("s", o.intn(m.max+4))
	ns := m.now.UnixNano()
	switch op := o.intn(8); {
	case op < 3:
		ep := bindEPs[1+o.intn(3)]
		got, share := m.tb.Local(key, ep, m.now)
		want, wantShare := m.local(key, ep, ns)
		if got != want || share != wantShare {
			t.Fatalf("Local(%s, %s) = %+v %v, model %+v %v", key, ep, got, share, want, wantShare)
		}
	case op < 6:
		// A peer's binding: any generation, made up to a TTL ago, last
		// used since, sometimes malformed.
		since := ns - int64(o.next())*m.ttl/128
		b := Binding{Key: key, Endpoint: bindEPs[o.intn(4)], Gen: uint32(o.intn(4)),
			Since: since, Last: since + int64(o.next())*m.ttl/256 - m.ttl/64}
		if o.intn(16) == 0 {
			b.Key = ""
		}
		if got, want := m.tb.Merge(b, m.now), m.merge(b, ns); got != want {
			t.Fatalf("Merge(%+v) = %v, model %v", b, got, want)
		}
	default:
		m.now = m.now.Add(time.Duration(int64(o.next()) * m.ttl / 64))
	}
	m.check()
}

// check compares the table with the model: the same bindings, live ones
// in the same order, within the bound, none twice.
func (m *bindMachine) check() {
	t, ns := m.t, m.now.UnixNano()
	if n := m.tb.Len(); n != len(m.model) || n > m.max {
		t.Fatalf("table holds %d bindings (bound %d), model %d", n, m.max, len(m.model))
	}
	var want []Binding
	for _, n := range m.model {
		got, ok := m.tb.Lookup(n.b.Key, m.now)
		if live := !m.expired(n.b, ns); ok != live || live && got != n.b {
			t.Fatalf("Lookup(%s) = %+v %v, model %+v (live %v)", n.b.Key, got, ok, n.b, live)
		}
		if ok {
			want = append(want, n.b)
		}
	}
	if got := m.tb.Live(m.now, 0); !slices.Equal(got, want) {
		t.Fatalf("Live %+v, model %+v", got, want)
	}
	if limit := len(want) / 2; limit > 0 {
		if got := m.tb.Live(m.now, limit); !slices.Equal(got, want[:limit]) {
			t.Fatalf("Live(limit %d) %+v, model %+v", limit, got, want[:limit])
		}
	}
}

// TestBindingTableProperties: random local successes, peers' bindings (of
// any generation and age, some malformed) and clock moves keep the table
// equal to its model: Local's binding and whether to share it, Merge's
// verdict, every lookup, live bindings most recent first, the bound, and
// expiry (never a binding past its TTL).
func TestBindingTableProperties(t *testing.T) { checkProperty(t, 400, 500, newBindMachine) }

// FuzzBindingTable is TestBindingTableProperties on the fuzzer's operation sequences.
func FuzzBindingTable(f *testing.F) {
	f.Add([]byte{3, 0, 0, 1, 1, 3, 2, 4, 30, 40, 6, 60, 0, 2, 0, 5, 7, 1, 1, 1})
	f.Add([]byte{0, 1, 3, 0, 0, 4, 9, 100, 2, 2, 6, 255, 1, 0, 1, 3, 5, 0, 0, 7})
	fuzzMachine(f, 2048, newBindMachine)
}
