package scheduler

import (
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"
)

func seqChain(base uint64, n int) []uint64 {
	c := make([]uint64, n)
	for i := range c {
		c[i] = base + uint64(i)
	}
	return c
}

func TestBlockLRUInsertEvictsTailFirst(t *testing.T) {
	l := NewBlockLRU(5)
	_, added, evicted := l.Insert(seqChain(100, 3), nil, nil)
	slices.Sort(added)
	if !slices.Equal(added, seqChain(100, 3)) || len(evicted) != 0 || l.Len() != 3 {
		t.Fatalf("added %v evicted %v len %d", added, evicted, l.Len())
	}
	_, added, evicted = l.Insert(seqChain(200, 3), nil, nil)
	slices.Sort(added)
	// The first chain's tail (102) goes first.
	if !slices.Equal(added, seqChain(200, 3)) || !slices.Equal(evicted, []uint64{102}) {
		t.Fatalf("added %v evicted %v", added, evicted)
	}
	if l.Lookup(seqChain(100, 3)) != 2 || l.Lookup(seqChain(200, 3)) != 3 {
		t.Fatalf("lookups %d %d", l.Lookup(seqChain(100, 3)), l.Lookup(seqChain(200, 3)))
	}
	// Touching a held chain adds nothing.
	held, added, evicted := l.Insert(seqChain(200, 2), nil, nil)
	if held != 2 {
		t.Fatalf("re-insert predicted %d held, want 2", held)
	}
	if len(added)+len(evicted) != 0 {
		t.Fatalf("re-insert added %v evicted %v", added, evicted)
	}
	snap := l.Snapshot(nil)
	if len(snap) != 5 || snap[0] != 200 {
		t.Fatalf("snapshot %v", snap)
	}
	// A chain longer than the capacity keeps its head.
	l2 := NewBlockLRU(4)
	l2.Insert(seqChain(1, 10), nil, nil)
	if l2.Lookup(seqChain(1, 10)) != 4 {
		t.Fatalf("long chain kept %d", l2.Lookup(seqChain(1, 10)))
	}
	if ev := l2.SetCapacity(2, nil); !slices.Equal(ev, []uint64{4, 3}) || l2.Len() != 2 {
		t.Fatalf("SetCapacity evicted %v", ev)
	}
}

func TestBlockLRUCorrect(t *testing.T) {
	t.Run("correct without its insert drops what the engine lost", func(t *testing.T) {
		l := NewBlockLRU(100)
		l.Insert(seqChain(1, 20), nil, nil)
		// The engine had only the first 5 blocks.
		dropped := l.Correct(seqChain(1, 20), NoPrediction, 5, nil)
		if len(dropped) != 15 || l.Lookup(seqChain(1, 20)) != 5 {
			t.Fatalf("dropped %d, holds %d", len(dropped), l.Lookup(seqChain(1, 20)))
		}
		if l.Capacity() != 85 {
			t.Fatalf("capacity %d, want 100 less the 15 blocks believed in error", l.Capacity())
		}
	})
	t.Run("correct after insert keeps the fresh chain", func(t *testing.T) {
		l := NewBlockLRU(100)
		l.Insert(seqChain(1, 10), nil, nil)
		c := append(seqChain(1, 10), seqChain(50, 10)...)
		p, _, _ := l.Insert(c, nil, nil)
		if p != 10 {
			t.Fatalf("predicted %d, want 10", p)
		}
		dropped := l.Correct(c, p, 10, nil)
		if len(dropped) != 0 || l.Lookup(c) != 20 || l.Capacity() != 100 {
			t.Fatalf("dropped %v, holds %d, capacity %d", dropped, l.Lookup(c), l.Capacity())
		}
		// The engine held more than predicted: capacity grows by the error.
		c2 := seqChain(500, 30)
		p, _, _ = l.Insert(c2, nil, nil)
		l.Correct(c2, p, 20, nil)
		if l.Capacity() != 120 {
			t.Fatalf("capacity %d, want 120", l.Capacity())
		}
	})
	// The engine held more of a chain than the index predicted, with many
	// requests between the Insert and the answer (a busy engine): this
	// sliced the chain backwards when predictions lived in a ring of 64.
	t.Run("engine held more than predicted, many requests in flight", func(t *testing.T) {
		l := NewBlockLRU(1000)
		chain := seqChain(1, 10)
		l.Insert(chain[:3], nil, nil)
		for i := range 70 {
			l.Insert(seqChain(uint64(1000+100*i), 2), nil, nil)
		}
		if dropped := l.Correct(chain, NoPrediction, 8, nil); len(dropped) != 0 {
			t.Fatalf("dropped %v", dropped)
		}
		if l.Lookup(chain) != 3 || l.Capacity() != 1005 {
			t.Fatalf("holds %d, capacity %d; want 3 and 1005", l.Lookup(chain), l.Capacity())
		}
	})
	t.Run("out of range answers count as the whole chain", func(t *testing.T) {
		l := NewBlockLRU(100)
		c := seqChain(1, 4)
		p, _, _ := l.Insert(c, nil, nil)
		l.Correct(c, p, 1<<30, nil)
		l.Correct(c, 1<<30, -5, nil)
		if l.Len() != 4 || l.Capacity() != 100 {
			t.Fatalf("len %d capacity %d", l.Len(), l.Capacity())
		}
	})
}

func TestIndexOverlapsAndDrop(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"), ep("c"))
	shared := seqChain(1000, 50)
	s.IndexReset("a", shared)
	s.IndexApply("b", shared[:20], nil)
	s.IndexApply("c", append(slices.Clone(shared[:5]), 77, 78), nil)
	chain := append(slices.Clone(shared), 9, 9)
	s.mu.Lock()
	s.pickGen++
	best := s.index.overlaps(chain, s.pickGen, s.now())
	got := map[string]int{}
	for _, id := range []string{"a", "b", "c"} {
		if x := s.index.byID[id]; x.gen == s.pickGen {
			got[id] = x.overlap
		}
	}
	s.mu.Unlock()
	if best != 50 || got["a"] != 50 || got["b"] != 20 || got["c"] != 5 {
		t.Fatalf("best %d overlaps %v", best, got)
	}
	st := s.IndexStats()
	if st.Endpoints != 3 || st.Entries != 50+20+7 || st.Blocks != 52 {
		t.Fatalf("stats %+v", st)
	}
	s.IndexApply("a", nil, shared[10:])
	s.Remove("b")
	s.IndexDrop("c")
	st = s.IndexStats()
	if st.Endpoints != 1 || st.Entries != 10 || st.Blocks != 10 || st.Sets != 1 {
		t.Fatalf("after drops: %+v", st)
	}
}

func TestPickFollowsPrefix(t *testing.T) {
	s, clk := newTest(t, Config{ColdStartSamples: 1}, ep("a"), ep("b"), ep("c"), ep("d"))
	chain := seqChain(1, 200)
	s.IndexReset("c", chain[:150])
	a := s.Begin(Request{Model: "m", Prefix: chain})
	c := mustPick(t, a)
	if c.EndpointID != "c" || c.CachedBlocks != 150 {
		t.Fatalf("picked %s with %d cached, want c with 150", c.EndpointID, c.CachedBlocks)
	}
	a.Report(c, Outcome{Status: 200, Latency: time.Millisecond})

	// A new prefix: the same endpoint for every relay (rendezvous), and
	// a burst follows the first pick before any agent update.
	fresh := seqChain(5000, 100)
	var first string
	for i := range 3 {
		s2, _ := newTest(t, Config{ColdStartSamples: 1, Seed: int64(i + 7)}, ep("a"), ep("b"), ep("c"), ep("d"))
		c := mustPick(t, s2.Begin(Request{Model: "m", Prefix: fresh}))
		if i == 0 {
			first = c.EndpointID
		} else if c.EndpointID != first {
			t.Fatalf("relay %d placed a new prefix on %s, relay 0 on %s", i, c.EndpointID, first)
		}
	}
	c1 := mustPick(t, s.Begin(Request{Model: "m", Prefix: fresh}))
	c2 := mustPick(t, s.Begin(Request{Model: "m", Prefix: fresh}))
	if c2.EndpointID != c1.EndpointID || c2.CachedBlocks != 100 {
		t.Fatalf("burst scattered: %s then %s (%d cached)", c1.EndpointID, c2.EndpointID, c2.CachedBlocks)
	}
	// A routed record expires when the agent never confirms it.
	clk.Advance(time.Minute)
	if st := s.IndexStats(); st.Routes != 0 {
		t.Fatalf("%d routes after a minute", st.Routes)
	}
}

func TestPickPrefixHotSpotSpreads(t *testing.T) {
	s, _ := newTest(t, Config{ColdStartSamples: 1}, ep("a"), ep("b"), ep("c"), ep("d"))
	chain := seqChain(1, 100)
	s.IndexReset("a", chain)
	per := map[string]int{}
	for range 40 {
		c := mustPick(t, s.Begin(Request{Model: "m", Prefix: chain}))
		per[c.EndpointID]++ // never reported: load piles up
	}
	if per["a"] == 40 || per["a"] < 10 {
		t.Fatalf("hot prefix placement %v", per)
	}
}

func TestPickSessionRulesKeptWithPrefix(t *testing.T) {
	s, clk := newTest(t, Config{ColdStartSamples: 1}, ep("a"), ep("b"))
	chain := seqChain(1, 100)
	s.IndexReset("b", chain)
	// A live mapping wins over the prefix.
	a := s.Begin(Request{Model: "m", SessionKey: "k"})
	c := mustPick(t, a)
	a.Report(c, Outcome{Status: 200, Latency: time.Millisecond})
	home := c.EndpointID
	other := "a"
	if home == "a" {
		other = "b"
	}
	// The prefix is cached on the other endpoint.
	s.IndexReset(home, nil)
	s.IndexReset(other, chain)
	c = mustPick(t, s.Begin(Request{Model: "m", SessionKey: "k", Prefix: chain}))
	if c.EndpointID != home || c.Affinity != AffinityHit {
		t.Fatalf("live session went to %s (%s), home %s", c.EndpointID, c.Affinity, home)
	}
	// After the TTL the session goes where its prefix is.
	clk.Advance(6 * time.Minute)
	c = mustPick(t, s.Begin(Request{Model: "m", SessionKey: "k", Prefix: chain}))
	if c.EndpointID != other {
		t.Fatalf("expired session went to %s, prefix held by %s", c.EndpointID, other)
	}
}

// A session's endpoint that publishes its cache competes on the prefix
// cost: it keeps its session while it is as good as any (ties go to it),
// and a request is sent where it starts sooner once a backlog builds there,
// as a request without a key would be.
func TestPickSessionEndpointCompetesOnCost(t *testing.T) {
	s, _ := newTest(t, Config{ColdStartSamples: 1}, ep("a"), ep("b"))
	chain := seqChain(1, 100)
	a := s.Begin(Request{Model: "m", SessionKey: "k"})
	c := mustPick(t, a)
	a.Report(c, Outcome{Status: 200, Latency: time.Millisecond})
	home, other := c.EndpointID, "a"
	if home == "a" {
		other = "b"
	}
	s.IndexReset(home, chain)
	s.IndexReset(other, chain)
	for range 3 {
		a := s.Begin(Request{Model: "m", SessionKey: "k", Prefix: chain})
		c := mustPick(t, a)
		if c.EndpointID != home || c.Affinity != AffinityHit || c.CachedBlocks != 100 {
			t.Fatalf("equal endpoints: the session went to %s (%s, %d cached), home %s", c.EndpointID, c.Affinity, c.CachedBlocks, home)
		}
		a.Report(c, Outcome{Status: 200, Latency: time.Millisecond})
	}
	// Home holds the prefix alone: a request or two in flight there
	// do not move the session.
	s.IndexReset(other, nil)
	onHome := func(base uint64) Choice {
		return mustPick(t, s.Begin(Request{Model: "m", Prefix: seqChain(base, 50),
			Allow: func(id string) bool { return id == home }}))
	}
	onHome(10_000)
	if c := mustPick(t, s.Begin(Request{Model: "m", SessionKey: "k", Prefix: chain})); c.EndpointID != home {
		t.Fatalf("home holds the prefix with one request ahead; the session went to %s", c.EndpointID)
	}
	// Both hold it again and home has prompts to prefill ahead: the
	// session goes where it starts at once.
	s.IndexReset(other, chain)
	for i := range 4 {
		onHome(uint64(20_000 + 1000*i))
	}
	c = mustPick(t, s.Begin(Request{Model: "m", SessionKey: "k", Prefix: chain}))
	if c.EndpointID != other || c.Affinity != AffinityMiss || c.CachedBlocks != 100 {
		t.Fatalf("home has a prefill backlog, the other endpoint the same prefix: the session went to %s (%s, %d cached)",
			c.EndpointID, c.Affinity, c.CachedBlocks)
	}
}

// BenchmarkIndexMemory measures the merged index at 1,000 endpoints of
// 16,384 blocks each, a quarter of them a prefix every endpoint shares, and
// reports its heap bytes per (block, endpoint) entry.
func BenchmarkIndexMemory(b *testing.B) {
	const agents, blocks = 1000, 16384
	for b.Loop() {
		s, err := New(Config{})
		if err != nil {
			b.Fatal(err)
		}
		runtime.GC()
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		buf := make([]uint64, blocks)
		for a := range agents {
			for i := range buf {
				if i < blocks/4 {
					buf[i] = uint64(i) + 1
				} else {
					buf[i] = 1<<63 | uint64(a)<<32 | uint64(i)
				}
			}
			s.IndexReset("agent-"+strconv.Itoa(a), buf)
		}
		runtime.GC()
		runtime.ReadMemStats(&m1)
		st := s.IndexStats()
		if st.Entries != agents*blocks {
			b.Fatalf("%d entries", st.Entries)
		}
		b.ReportMetric(float64(m1.HeapAlloc-m0.HeapAlloc)/float64(st.Entries), "heap-B/entry")
		b.ReportMetric(float64(st.Bytes)/float64(st.Entries), "estimated-B/entry")
		b.ReportMetric(float64(st.Entries), "entries")
		runtime.KeepAlive(s)
	}
}

// TestIndexTransitionAfterSetReuse: a cached transition belongs to the set
// it started from, not to its id. Here b's block moves a set from {a} to
// {a, b}, the set {a} is freed, its id goes to c's new set {c}, and b then
// publishes c's block: the block is held by b and c, not by a and b.
func TestIndexTransitionAfterSetReuse(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"), ep("c"))
	s.IndexApply("a", []uint64{1}, nil)
	s.IndexApply("b", []uint64{1}, nil)
	s.IndexApply("c", []uint64{2}, nil)
	s.IndexApply("b", []uint64{2}, nil)
	s.mu.Lock()
	var holders []string
	for _, sl := range s.index.sets[s.index.blocks[2]].members {
		holders = append(holders, s.index.slots[sl].id)
	}
	s.mu.Unlock()
	if !slices.Equal(holders, []string{"b", "c"}) {
		t.Fatalf("block 2 held by %v, want [b c]", holders)
	}
}
