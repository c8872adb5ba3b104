package audit

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

var k1 = Key{Agent: "a1", Model: "m1"}

func v(o Outcome) Verdict { return Verdict{Outcome: o, Against: "ref", Reason: "r"} }

func TestBookScenarios(t *testing.T) {
	type step struct {
		dt      time.Duration
		event   string // a, d, i: verdicts; q, r: operator; x: violation
		change  Change
		score   float64
		weight  float64
		quarant bool
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{name: "clean agent keeps full weight", steps: []step{
			{event: "a", score: 1, weight: 1},
			{dt: time.Minute, event: "a", score: 1, weight: 1},
		}},
		{name: "one disagreement costs weight, clean audits bring it back", steps: []step{
			{event: "d", score: 0.5, weight: 1.0 / 3},
			{event: "a", score: 0.75, weight: 0.75},
			{event: "a", score: 0.875, weight: 0.9583333333333334},
			{event: "a", score: 0.9375, weight: 1},
		}},
		{name: "two disagreements quarantine", steps: []step{
			{event: "d", score: 0.5, weight: 1.0 / 3},
			{event: "d", score: 0.25, weight: 0, change: Quarantined, quarant: true},
		}},
		{name: "inconclusive audits are no evidence", steps: []step{
			{event: "i", score: 1, weight: 1},
			{event: "i", score: 1, weight: 1},
			{event: "i", score: 1, weight: 1},
		}},
		{name: "released after three clean re-audits, on probation", steps: []step{
			{event: "d", score: 0.5, weight: 1.0 / 3},
			{event: "d", score: 0.25, weight: 0, change: Quarantined, quarant: true},
			{dt: 30 * time.Second, event: "a", score: 0.625, weight: 0, quarant: true},
			{dt: 30 * time.Second, event: "i", score: 0.625, weight: 0, quarant: true},
			{dt: 30 * time.Second, event: "a", score: 0.8125, weight: 0, quarant: true},
			{dt: 30 * time.Second, event: "a", score: 0.90625, weight: 1, change: Released},
		}},
		{name: "a disagreement in quarantine restarts the count", steps: []step{
			{event: "d", score: 0.5, weight: 1.0 / 3}, {event: "d", score: 0.25, change: Quarantined, quarant: true},
			{event: "a", score: 0.625, quarant: true},
			{event: "a", score: 0.8125, quarant: true},
			{event: "d", score: 0.40625, quarant: true},
			{event: "a", score: 0.703125, quarant: true},
			{event: "a", score: 0.8515625, quarant: true},
			{event: "a", score: 0.92578125, weight: 1, change: Released},
		}},
		{name: "release keeps a low score at probation", steps: []step{
			{event: "d", score: 0.5, weight: 1.0 / 3}, {event: "d", change: Quarantined, quarant: true},
			{event: "d", quarant: true}, {event: "d", score: 0.0625, quarant: true},
			{event: "a", score: 0.53125, quarant: true},
			{event: "a", score: 0.765625, quarant: true},
			{event: "a", score: 0.8828125, weight: 0.9713541666666666, change: Released},
		}},
		{name: "operator quarantine holds through clean audits", steps: []step{
			{event: "q", score: 1, change: Quarantined, quarant: true},
			{event: "a", score: 1, quarant: true},
			{event: "a", score: 1, quarant: true},
			{event: "a", score: 1, quarant: true},
			{event: "a", score: 1, quarant: true},
			{event: "r", score: 1, weight: 1, change: Released},
		}},
		{name: "operator release restores the score", steps: []step{
			{event: "d", score: 0.5, weight: 1.0 / 3}, {event: "d", score: 0.25, change: Quarantined, quarant: true},
			{event: "r", score: 1, weight: 1, change: Released},
			{event: "r", score: 1, weight: 1, change: Unchanged},
		}},
		{name: "violations are evidence, not a verdict", steps: []step{
			{event: "x", score: 1, weight: 1},
			{event: "x", score: 1, weight: 1},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := NewBook(Policy{})
			now := t0
			for i, s := range tc.steps {
				now = now.Add(s.dt)
				var ch Change
				switch s.event {
				case "a":
					ch = b.Record(now, "aud", k1, v(Agree))
				case "d":
					ch = b.Record(now, "aud", k1, v(Disagree))
				case "i":
					ch = b.Record(now, "aud", k1, v(Inconclusive))
				case "q":
					ch = b.Quarantine(now, k1, "by hand")
				case "r":
					ch = b.Release(now, k1)
				case "x":
					b.Violation(now, k1, "cached", "10 > 5")
				}
				st, _ := b.Standing(k1)
				if ch != s.change {
					t.Errorf("step %d (%s): change %v, want %v", i, s.event, ch, s.change)
				}
				if s.score != 0 && math.Abs(st.Score-s.score) > 1e-9 {
					t.Errorf("step %d (%s): score %v, want %v", i, s.event, st.Score, s.score)
				}
				if math.Abs(st.Weight-s.weight) > 1e-9 {
					t.Errorf("step %d (%s): weight %v, want %v", i, s.event, st.Weight, s.weight)
				}
				if (st.Quarantine != nil) != s.quarant || b.Quarantined(k1) != s.quarant {
					t.Errorf("step %d (%s): quarantined %v, want %v", i, s.event, st.Quarantine != nil, s.quarant)
				}
			}
		})
	}
}

func TestBookEvidence(t *testing.T) {
	b := NewBook(Policy{})
	b.Record(t0, "aud-1", k1, Verdict{Outcome: Agree})
	b.Record(t0.Add(time.Second), "aud-2", k1, Verdict{Outcome: Disagree, Against: "a2", Reason: "3 agents disagree", Evidence: Comparison{Reason: "texts part at byte 0 of 40"}})
	b.Record(t0.Add(2*time.Second), "aud-3", k1, Verdict{Outcome: Disagree, Against: "a3", Reason: "3 agents disagree"})
	b.Record(t0.Add(3*time.Second), "aud-4", k1, Verdict{Outcome: Inconclusive})
	b.Violation(t0.Add(4*time.Second), k1, "model", `asked for "m1", answer names "m2"`)
	st, ok := b.Standing(k1)
	if !ok {
		t.Fatal("no standing")
	}
	if st.Audits != 3 || st.Agreements != 1 || st.Inconclusive != 1 || st.Violations != 1 {
		t.Errorf("counts %+v", st)
	}
	if st.LastDisagreement.Audit != "aud-3" || st.LastDisagreement.Against != "a3" {
		t.Errorf("last disagreement %+v", st.LastDisagreement)
	}
	q := st.Quarantine
	if q == nil || q.Convicted.Audit != "aud-3" || !q.Since.Equal(t0.Add(2*time.Second)) || q.ByOperator {
		t.Fatalf("quarantine %+v", q)
	}
	// The inconclusive re-audit at 3 s set the next one at the base pace.
	if !q.NextAudit.Equal(t0.Add(3*time.Second + DefaultBackoffMin)) {
		t.Errorf("next audit %v", q.NextAudit)
	}
	if st.LastViolation.Reason != `model: asked for "m1", answer names "m2"` {
		t.Errorf("last violation %+v", st.LastViolation)
	}
	// The copy is a copy.
	st.Quarantine.Clean = 99
	if again, _ := b.Standing(k1); again.Quarantine.Clean != 0 {
		t.Error("Standing shares its quarantine with the book")
	}
}

func TestBookBackoff(t *testing.T) {
	b := NewBook(Policy{BackoffMin: 10 * time.Second, BackoffMax: 50 * time.Second})
	now := t0
	b.Record(now, "a", k1, v(Disagree))
	b.Record(now, "a", k1, v(Disagree))
	var waits []time.Duration
	for range 5 {
		st, _ := b.Standing(k1)
		waits = append(waits, st.Quarantine.NextAudit.Sub(now))
		now = st.Quarantine.NextAudit
		b.Record(now, "a", k1, v(Disagree))
	}
	want := []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second, 50 * time.Second, 50 * time.Second}
	for i := range want {
		if waits[i] != want[i] {
			t.Fatalf("waits %v, want %v", waits, want)
		}
	}
	// A clean or inconclusive re-audit comes back at the base pace.
	b.Record(now, "a", k1, v(Inconclusive))
	if st, _ := b.Standing(k1); st.Quarantine.NextAudit.Sub(now) != 10*time.Second {
		t.Errorf("after an inconclusive re-audit: %v", st.Quarantine.NextAudit.Sub(now))
	}
}

func TestBookBounded(t *testing.T) {
	b := NewBook(Policy{MaxEntries: 4})
	q := Key{Agent: "q", Model: "m"}
	b.Quarantine(t0, q, "x")
	for i := range 20 {
		k := Key{Agent: string(rune('a' + i)), Model: "m"}
		b.Record(t0.Add(time.Duration(i)*time.Second), "a", k, v(Agree))
	}
	if b.Len() != 4 {
		t.Errorf("len %d, want 4", b.Len())
	}
	if !b.Quarantined(q) {
		t.Error("a quarantined pair was evicted")
	}
	// The most recent ones stay.
	if _, ok := b.Standing(Key{Agent: "t", Model: "m"}); !ok {
		t.Error("the latest pair was evicted")
	}
}

// model is the plain reference for the book's quarantine state machine
// under the default policy: the score as a float updated by hand, the
// quarantine as two booleans and a counter.
type model struct {
	score    float64
	quar, op bool
	clean    int
}

func (m *model) apply(ev int) {
	switch ev {
	case 0: // agree
		m.score += 0.5 * (1 - m.score)
		if m.quar {
			m.clean++
			if !m.op && m.clean >= 3 {
				m.quar, m.clean = false, 0
				m.score = math.Max(m.score, 0.6)
			}
		}
	case 1: // disagree
		m.score *= 0.5
		if m.quar {
			m.clean = 0
		} else if m.score < 0.3 {
			m.quar, m.clean = true, 0
		}
	case 2: // inconclusive
	case 3: // operator quarantine
		if !m.quar {
			m.clean = 0
		}
		m.quar, m.op = true, true
	case 4: // operator release
		m.quar, m.op, m.clean, m.score = false, false, 0, 1
	case 5: // violation
	}
	if !m.quar {
		m.op = false
	}
}

// TestBookProperty drives a book with random sequences of events over a
// few pairs and checks it against the plain model after every event, with
// the invariants: score and weight in [0, 1], weight 0 exactly when
// quarantined, counts adding up, an operator's quarantine never ended by
// audits, re-audits scheduled within the backoff bounds.
func TestBookProperty(t *testing.T) {
	keys := []Key{{"a", "m1"}, {"a", "m2"}, {"b", "m1"}}
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 7))
		b := NewBook(Policy{})
		models := map[Key]*model{}
		counts := map[Key][3]int{}
		now := t0
		for step := range 200 {
			k := keys[rng.IntN(len(keys))]
			m := models[k]
			if m == nil {
				m = &model{score: 1}
				models[k] = m
			}
			now = now.Add(time.Duration(rng.IntN(120)) * time.Second)
			ev := rng.IntN(6)
			wasOp := m.op
			switch ev {
			case 0, 1, 2:
				o := [...]Outcome{Agree, Disagree, Inconclusive}[ev]
				b.Record(now, "aud", k, v(o))
				c := counts[k]
				c[ev]++
				counts[k] = c
			case 3:
				b.Quarantine(now, k, "hand")
			case 4:
				b.Release(now, k)
			case 5:
				b.Violation(now, k, "cached", "x")
			}
			m.apply(ev)
			st, ok := b.Standing(k)
			if !ok {
				if ev == 4 {
					continue // release of an unknown pair
				}
				t.Fatalf("seed %d step %d: %v unknown after event %d", seed, step, k, ev)
			}
			fail := func(format string, args ...any) {
				t.Helper()
				t.Fatalf("seed %d step %d event %d %v: "+format+"; standing %+v model %+v", append([]any{seed, step, ev, k}, append(args, st, *m)...)...)
			}
			if math.Abs(st.Score-m.score) > 1e-9 {
				fail("score %v, model %v", st.Score, m.score)
			}
			if (st.Quarantine != nil) != m.quar {
				fail("quarantined %v, model %v", st.Quarantine != nil, m.quar)
			}
			if st.Quarantine != nil && st.Quarantine.ByOperator != m.op {
				fail("by operator %v, model %v", st.Quarantine.ByOperator, m.op)
			}
			if wasOp && ev != 4 && st.Quarantine == nil {
				fail("an operator's quarantine ended without the operator")
			}
			if st.Score < 0 || st.Score > 1 || st.Weight < 0 || st.Weight > 1 {
				fail("score %v weight %v out of range", st.Score, st.Weight)
			}
			if (st.Weight == 0) != (st.Quarantine != nil || st.Score <= DefaultQuarantineBelow) {
				fail("weight %v with quarantine %v score %v", st.Weight, st.Quarantine != nil, st.Score)
			}
			if b.Weight(k) != st.Weight || b.Quarantined(k) != m.quar {
				fail("accessors disagree with the standing")
			}
			c := counts[k]
			if st.Agreements != c[0] || st.Audits != c[0]+c[1] || st.Inconclusive != c[2] {
				fail("counts %v", c)
			}
			if q := st.Quarantine; q != nil {
				if q.Clean != m.clean {
					fail("clean %d, model %d", q.Clean, m.clean)
				}
				if q.Backoff < DefaultBackoffMin || q.Backoff > DefaultBackoffMax {
					fail("backoff %v", q.Backoff)
				}
				if d := q.NextAudit.Sub(now); d > q.Backoff || d < 0 && ev <= 2 {
					fail("next audit in %v with backoff %v", d, q.Backoff)
				}
			}
		}
	}
}

func TestBookVoice(t *testing.T) {
	b := NewBook(Policy{})
	t0 := time.Unix(1_000_000, 0)
	k := Key{Agent: "a", Model: "m"}
	for _, tc := range []struct {
		at, since time.Duration // since t0; since < 0: none given
		want      float64
	}{
		{0, -1, 0.25},
		{6 * time.Hour, -1, 0.25 + 0.75/4},
		{48 * time.Hour, -1, 1},
		{time.Hour, -24 * time.Hour, 1}, // the ledger knew it a day earlier
	} {
		var since time.Time
		if tc.since >= 0 || tc.since < -time.Second {
			since = t0.Add(tc.since)
		}
		if tc.since == -1 {
			since = time.Time{}
		}
		if got := b.Voice(t0.Add(tc.at), k, since); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("at %v, since %v: voice %.4f, want %.4f", tc.at, tc.since, got, tc.want)
		}
	}
	b.Record(t0.Add(49*time.Hour), "a1", k, Verdict{Outcome: Disagree})
	if got := b.Voice(t0.Add(49*time.Hour), k, time.Time{}); got != 0.5 {
		t.Errorf("after a conviction: voice %.2f, want 0.5 (score halved)", got)
	}
}
