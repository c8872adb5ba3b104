package scheduler

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)

func TestBindingTableConcurrentBindsConverge(t *testing.T) {
	// Three tables bind one session at once, to three endpoints, and then
	// hear of each other's bindings in every order: all keep the first.
	a := Binding{Key: "s", Endpoint: "x", Gen: 1, Since: t0.UnixNano(), Last: t0.UnixNano()}
	b := Binding{Key: "s", Endpoint: "y", Gen: 1, Since: t0.Add(time.Millisecond).UnixNano(), Last: t0.Add(time.Millisecond).UnixNano()}
	c := Binding{Key: "s", Endpoint: "w", Gen: 1, Since: t0.Add(time.Millisecond).UnixNano(), Last: t0.Add(time.Millisecond).UnixNano()}
	now := t0.Add(time.Second)
	orders := [][]Binding{{a, b, c}, {a, c, b}, {b, a, c}, {b, c, a}, {c, a, b}, {c, b, a}}
	for i, order := range orders {
		tb := NewBindingTable(0, 0)
		for _, x := range order {
			tb.Merge(x, now)
		}
		got, ok := tb.Lookup("s", now)
		if !ok || got.Endpoint != "x" {
			t.Errorf("order %d: binding %+v %v, want the first (x)", i, got, ok)
		}
	}
	// Same Gen and Since: the smaller endpoint ID, everywhere.
	tb := NewBindingTable(0, 0)
	tb.Merge(b, now)
	tb.Merge(c, now)
	if got, _ := tb.Lookup("s", now); got.Endpoint != "w" {
		t.Errorf("tie: %+v", got)
	}
}

func TestBindingTableMoveWins(t *testing.T) {
	local := NewBindingTable(0, 0)
	b1, share := local.Local("s", "x", t0)
	if !share || b1.Gen != 1 {
		t.Fatalf("first binding %+v share=%v", b1, share)
	}
	// A refresh on the same endpoint is not shared again until ttl/10.
	if _, share := local.Local("s", "x", t0.Add(time.Second)); share {
		t.Error("a refresh within ttl/10 was to be shared")
	}
	if b, share := local.Local("s", "x", t0.Add(31*time.Second)); !share || b.Last != t0.Add(31*time.Second).UnixNano() {
		t.Errorf("refresh after ttl/10: %+v share=%v", b, share)
	}
	// A peer hears the binding, then the move to y made elsewhere later
	// but with a higher Gen: the move wins even though it is younger.
	peer := NewBindingTable(0, 0)
	peer.Merge(b1, t0.Add(time.Second))
	moved, share := local.Local("s", "y", t0.Add(40*time.Second))
	if !share || moved.Gen != 2 || moved.Endpoint != "y" {
		t.Fatalf("move %+v share=%v", moved, share)
	}
	if !peer.Merge(moved, t0.Add(41*time.Second)) {
		t.Fatal("move not applied")
	}
	if peer.Merge(b1, t0.Add(42*time.Second)) {
		t.Error("the older binding replaced the move")
	}
	if got, _ := peer.Lookup("s", t0.Add(42*time.Second)); got.Endpoint != "y" {
		t.Errorf("peer holds %+v", got)
	}
}

func TestBindingTableExpiryAndBound(t *testing.T) {
	tb := NewBindingTable(time.Minute, 100)
	for i := range 250 {
		tb.Local(fmt.Sprint("s", i), "x", t0.Add(time.Duration(i)*time.Millisecond))
	}
	if n := tb.Len(); n != 100 {
		t.Fatalf("len %d, want the bound 100", n)
	}
	if _, ok := tb.Lookup("s0", t0.Add(time.Second)); ok {
		t.Error("evicted session still bound")
	}
	if _, ok := tb.Lookup("s249", t0.Add(time.Second)); !ok {
		t.Error("newest session lost")
	}
	if _, ok := tb.Lookup("s249", t0.Add(2*time.Minute)); ok {
		t.Error("expired session still bound")
	}
	if tb.Merge(Binding{Key: "old", Endpoint: "x", Gen: 1, Since: t0.UnixNano(), Last: t0.UnixNano()}, t0.Add(2*time.Minute)) {
		t.Error("an expired binding was merged")
	}
	if live := tb.Live(t0.Add(time.Second), 10); len(live) != 10 || live[0].Key != "s249" {
		t.Errorf("live %d, first %+v", len(live), live)
	}
	// A binding whose local copy expired is replaced by a fresh one of any
	// generation.
	tb.Merge(Binding{Key: "s249", Endpoint: "y", Gen: 1, Since: t0.Add(3 * time.Minute).UnixNano(), Last: t0.Add(3 * time.Minute).UnixNano()}, t0.Add(3*time.Minute))
	if got, _ := tb.Lookup("s249", t0.Add(3*time.Minute)); got.Endpoint != "y" {
		t.Errorf("after expiry: %+v", got)
	}
}

// TestBindingTableRandomOrder merges random updates of many sessions into
// several tables in different orders: every table ends with the same
// bindings.
func TestBindingTableRandomOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var updates []Binding
	for range 2000 {
		k := fmt.Sprint("s", rng.IntN(50))
		at := t0.Add(time.Duration(rng.IntN(1000)) * time.Millisecond).UnixNano()
		updates = append(updates, Binding{Key: k, Endpoint: fmt.Sprint("e", rng.IntN(4)), Gen: uint32(1 + rng.IntN(3)), Since: at, Last: at + int64(rng.IntN(1000))})
	}
	now := t0.Add(10 * time.Second)
	var ref map[string]Binding
	for trial := range 5 {
		tb := NewBindingTable(0, 0)
		perm := rng.Perm(len(updates))
		for _, i := range perm {
			tb.Merge(updates[i], now)
		}
		got := map[string]Binding{}
		for _, b := range tb.Live(now, 0) {
			got[b.Key] = b
		}
		if trial == 0 {
			ref = got
			continue
		}
		for k, b := range ref {
			if got[k] != b {
				t.Fatalf("trial %d: %s is %+v, first table %+v", trial, k, got[k], b)
			}
		}
	}
}

func TestSchedulerBind(t *testing.T) {
	s, clk := newTest(t, Config{}, ep("a"), ep("b"))
	if s.Bind("s1", "zzz", clk.Now()) {
		t.Error("bound to an unknown endpoint")
	}
	if s.Bind("s1", "a", clk.Now().Add(-10*time.Minute)) {
		t.Error("bound an expired binding")
	}
	if !s.Bind("s1", "b", clk.Now()) {
		t.Fatal("Bind failed")
	}
	att := s.Begin(Request{Model: "m", SessionKey: "s1"})
	c, err := att.Pick()
	if err != nil || c.EndpointID != "b" || c.Affinity != AffinityHit {
		t.Fatalf("pick after Bind: %+v %v", c, err)
	}
	att.Report(c, ok200)
	// A peer's older success does not move a fresher local mapping back.
	clk.Advance(time.Second)
	if !s.Bind("s1", "b", clk.Now().Add(-time.Minute)) {
		t.Error("same endpoint, older success: should report mapped")
	}
	if id, last, ok := s.Binding("s1"); !ok || id != "b" || !last.Equal(clk.Now().Add(-time.Second)) {
		t.Errorf("binding %s %v %v", id, last, ok)
	}
	// A move learned from a peer takes effect.
	if !s.Bind("s1", "a", clk.Now()) {
		t.Fatal("move not bound")
	}
	if id, _, _ := s.Binding("s1"); id != "a" {
		t.Errorf("after the move: %s", id)
	}
	st := s.Snapshot()
	if st[0].Sessions != 1 || st[1].Sessions != 0 {
		t.Errorf("session counts %d %d after the move", st[0].Sessions, st[1].Sessions)
	}
	s.Remove("a")
	if s.Bind("s2", "a", clk.Now()) {
		t.Error("bound to a removed endpoint")
	}
}

// TestSchedulerBindExpiryOrder checks that bindings learned with an older
// success (a peer's snapshot, most recent first) take their place in the
// session table's expiry order, so that they expire on time and stop
// counting towards their endpoint's load.
func TestSchedulerBindExpiryOrder(t *testing.T) {
	s, clk := newTest(t, Config{SessionTTL: 5 * time.Minute}, ep("a"), ep("b"))
	att := s.Begin(Request{Model: "m", SessionKey: "local"})
	c, err := att.Pick()
	if err != nil {
		t.Fatal(err)
	}
	att.Report(c, ok200)
	other := "a"
	if c.EndpointID == "a" {
		other = "b"
	}
	if !s.Bind("old", other, clk.Now().Add(-4*time.Minute)) {
		t.Fatal("Bind old failed")
	}
	for i := 1; i <= 5; i++ {
		if !s.Bind(fmt.Sprint("peer", i), c.EndpointID, clk.Now().Add(-time.Duration(i)*time.Second)) {
			t.Fatal("Bind failed")
		}
	}
	var order []string
	prev := int64(1 << 62)
	for i := s.sessions.list.Head(); i >= 0; i = s.sessions.list.Next(i) {
		en := s.sessions.ents[i]
		order = append(order, en.key)
		if en.last > prev {
			t.Errorf("session table out of expiry order: %v", order)
		}
		prev = en.last
	}
	clk.Advance(2 * time.Minute)
	att = s.Begin(Request{Model: "m"})
	c2, err := att.Pick() // purges the expired tail
	if err != nil {
		t.Fatal(err)
	}
	att.Report(c2, ok200)
	if n := s.sessions.len(); n != 6 {
		t.Errorf("%d sessions after old expired, want 6 (order %v)", n, order)
	}
	for _, st := range s.Snapshot() {
		if st.ID == other && st.Sessions != 0 {
			t.Errorf("%s still counts %d sessions after its only one expired", other, st.Sessions)
		}
	}
}

func BenchmarkBindingTableLocal(b *testing.B) {
	tb := NewBindingTable(0, 100_000)
	keys := make([]string, 100_000)
	for i := range keys {
		keys[i] = fmt.Sprint("session-", i)
	}
	now := t0
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		now = now.Add(time.Microsecond)
		tb.Local(keys[i%len(keys)], "agent-1", now)
	}
}

// TestBindingTableMemory measures the heap a full table takes
// (COMPUTEFLUX_MEMORY=1 go test -run TestBindingTableMemory -v ./scheduler/).
func TestBindingTableMemory(t *testing.T) {
	if os.Getenv("COMPUTEFLUX_MEMORY") == "" {
		t.Skip("set COMPUTEFLUX_MEMORY=1 to measure")
	}
	const n = 100_000
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("s%06d-%08x", i, uint32(i*2654435761))
	}
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	tb := NewBindingTable(0, n)
	for i, k := range keys {
		tb.Local(k, fmt.Sprint("agent-", i%100), t0.Add(time.Duration(i)*time.Microsecond))
	}
	after := heap()
	// A flood of new keys past the bound keeps it at the bound.
	for i := range 3 * n {
		tb.Local(fmt.Sprint("flood-", i), "agent-1", t0.Add(time.Second+time.Duration(i)*time.Microsecond))
	}
	flooded := heap()
	runtime.KeepAlive(keys)
	t.Logf("%d bindings: %.1f MiB, %d bytes each (keys included); after %d more keys: %d held, %.1f MiB",
		n, float64(after-before)/(1<<20), (after-before)/n, 3*n, tb.Len(), float64(flooded-before)/(1<<20))
	if tb.Len() != n {
		t.Errorf("len %d after the flood, want %d", tb.Len(), n)
	}
}
