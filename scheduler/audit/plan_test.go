package audit

import (
	"math/rand/v2"
	"testing"
	"time"
)

func keys(model string, agents ...string) []Key {
	var out []Key
	for _, a := range agents {
		out = append(out, Key{Agent: a, Model: model})
	}
	return out
}

func TestNext(t *testing.T) {
	type setup func(b *Book)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	tests := []struct {
		name       string
		setup      setup
		now        time.Duration
		live       []Key
		affordable bool
		want       string // agent, or "" for none
		why        Why
	}{
		{name: "new pairs first, first seen first", setup: func(b *Book) {
			b.Seen(at(2*time.Second), Key{"b", "m"})
			b.Seen(at(time.Second), Key{"c", "m"})
		}, live: keys("m", "a", "b", "c"), now: 3 * time.Second, want: "c", why: WhyNew},
		{name: "new pairs need no budget", live: keys("m", "a"), want: "a", why: WhyNew},
		{name: "nothing due without budget", setup: func(b *Book) {
			b.Record(at(0), "x", Key{"a", "m"}, v(Agree))
		}, live: keys("m", "a"), now: time.Minute, want: ""},
		{name: "budget picks the least recently audited", setup: func(b *Book) {
			b.Record(at(0), "x", Key{"a", "m"}, v(Agree))
			b.Record(at(-time.Second), "x", Key{"b", "m"}, v(Agree))
		}, live: keys("m", "a", "b"), now: time.Minute, affordable: true, want: "b", why: WhyBudget},
		{name: "suspected before the least recently audited", setup: func(b *Book) {
			b.Record(at(0), "x", Key{"a", "m"}, v(Agree))
			b.Record(at(-time.Second), "x", Key{"b", "m"}, v(Agree))
			b.Violation(at(0), Key{"a", "m"}, "cached", "x")
		}, live: keys("m", "a", "b"), now: time.Minute, affordable: true, want: "a", why: WhySuspected},
		{name: "floor overdue without budget", setup: func(b *Book) {
			b.Record(at(0), "x", Key{"a", "m"}, v(Agree))
			b.Record(at(5*time.Minute), "x", Key{"b", "m"}, v(Agree))
		}, live: keys("m", "a", "b"), now: DefaultFloorEvery, want: "a", why: WhyFloor},
		{name: "quarantine re-audit before anything", setup: func(b *Book) {
			b.Record(at(0), "x", Key{"q", "m"}, v(Disagree))
			b.Record(at(0), "x", Key{"q", "m"}, v(Disagree))
		}, live: keys("m", "a", "q"), now: DefaultBackoffMin, want: "q", why: WhyRecheck},
		{name: "quarantine re-audit waits for its time", setup: func(b *Book) {
			b.Record(at(0), "x", Key{"q", "m"}, v(Disagree))
			b.Record(at(0), "x", Key{"q", "m"}, v(Disagree))
		}, live: keys("m", "q"), now: DefaultBackoffMin - time.Second, affordable: true, want: ""},
		{name: "gone pairs are not audited", setup: func(b *Book) {
			b.Seen(at(0), Key{"gone", "m"})
		}, live: nil, affordable: true, want: ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := NewBook(Policy{})
			if tc.setup != nil {
				tc.setup(b)
			}
			k, why, ok := b.Next(at(tc.now), tc.live, tc.affordable)
			if tc.want == "" {
				if ok {
					t.Fatalf("picked %v (%v), want none", k, why)
				}
				return
			}
			if !ok || k.Agent != tc.want || why != tc.why {
				t.Fatalf("picked %v (%v, %v), want %s (%v)", k, why, ok, tc.want, tc.why)
			}
			if why.Mandatory() != (why <= WhyFloor) {
				t.Errorf("%v mandatory %v", why, why.Mandatory())
			}
		})
	}
}

func TestReferences(t *testing.T) {
	b := NewBook(Policy{})
	live := append(keys("m", "a", "b", "c", "d", "q"), Key{"x", "other"})
	b.Record(t0, "x", Key{"b", "m"}, v(Agree))
	b.Record(t0.Add(time.Second), "x", Key{"c", "m"}, v(Agree))
	b.Quarantine(t0, Key{"q", "m"}, "hand")
	got := b.References(t0, Key{"a", "m"}, live, 2, nil)
	// d was never audited, then b before c; never the subject, a
	// quarantined agent or another model's.
	if len(got) != 2 || got[0].Agent != "d" || got[1].Agent != "b" {
		t.Errorf("references %v, want d, b", got)
	}
	if all := b.References(t0, Key{"a", "m"}, live, 10, nil); len(all) != 3 {
		t.Errorf("all references %v, want b, c, d", all)
	}
	// Ties are drawn: over many rounds, every ordered pair of the three
	// tied references (q is quarantined) comes up.
	ties := keys("m", "s", "p", "q", "r", "t")
	seen := map[string]bool{}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 50 {
		got := b.References(t0, Key{"s", "m"}, ties, 2, rng)
		seen[got[0].Agent+got[1].Agent] = true
	}
	if len(seen) != 6 || seen["pq"] || seen["qr"] {
		t.Errorf("50 draws of 2 of 3 tied references gave %d pairs: %v", len(seen), seen)
	}
}

func TestBudget(t *testing.T) {
	b := NewBudget(0, 0)
	if b.Fraction() != DefaultFraction {
		t.Fatalf("fraction %v", b.Fraction())
	}
	if b.Afford(1) {
		t.Fatal("an empty budget affords an audit")
	}
	b.Served(10000) // 200 tokens of credit
	if !b.Afford(200) || b.Afford(201) {
		t.Fatal("credit is not 2% of served")
	}
	b.Spend(200)
	// A mandatory audit goes into debt; traffic repays it first.
	b.Spend(300)
	b.Served(15000)
	if b.Afford(1) {
		t.Fatal("debt not repaid first")
	}
	b.Served(50)
	if !b.Afford(1) {
		t.Fatal("repaid debt leaves no credit")
	}
	served, spent := b.Totals()
	if served != 25050 || spent != 500 {
		t.Errorf("totals %d %d", served, spent)
	}
	// Credit is capped at the burst.
	c := NewBudget(0.5, 100)
	c.Served(1 << 20)
	if !c.Afford(100) || c.Afford(101) {
		t.Error("credit past the burst")
	}
	// Debt too.
	c.Spend(1 << 20)
	c.Served(400)
	if !c.Afford(100) {
		t.Error("debt past the burst")
	}
	// A negative fraction: no budget, only mandatory audits.
	n := NewBudget(-1, 0)
	n.Served(1 << 20)
	if n.Afford(1) {
		t.Error("a disabled budget affords an audit")
	}
}

// TestBudgetShare runs a fleet's traffic and audits through the budget
// and checks the share of audit tokens stays at the fraction: 10,000
// requests of 500 tokens, each followed by an audit of 2,000 tokens when
// the budget affords it.
func TestBudgetShare(t *testing.T) {
	b := NewBudget(0, 0)
	for range 10000 {
		b.Served(500)
		if b.Afford(2000) {
			b.Spend(2000)
		}
	}
	served, spent := b.Totals()
	share := float64(spent) / float64(served)
	if share > 0.02 || share < 0.019 {
		t.Errorf("audit share %.4f, want within [0.019, 0.02]", share)
	}
}
