package ledger

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

func takeAll(a *accumulator, cur int64) map[Key]Counts {
	out := map[Key]Counts{}
	for _, d := range a.take(nil, cur) {
		c := out[d.Key]
		c.Add(d.Counts)
		out[d.Key] = c
	}
	return out
}

// Past the caps, requests still count, in rows named Other; the client's
// spending is never folded.
func TestAccumulatorCaps(t *testing.T) {
	now := utc("2026-03-10T12:30:00Z")
	h := hourOf(now)
	a := newAccumulator(2, 3, 1000)
	a.curHour.Store(h)
	rec := func(client, model string) {
		a.record(&Entry{Time: now, Client: client, Model: model, PromptTokens: 10}, 0, 0)
	}
	rec("alice", "m1")
	rec("alice", "m2")
	rec("alice", "m3") // a third model: folds into (alice, Other)
	rec("alice", "m4") // and so does a fourth
	rec("bob", "m1")   // a fourth client row would pass 3: folds into (Other, Other)
	rec("carol", "m2") // likewise
	rec("alice", "m1")
	got := takeAll(a, h)
	want := map[Key]Counts{
		{h, KindClient, "alice", "m1"}:  {Requests: 2, PromptTokens: 20},
		{h, KindClient, "alice", "m2"}:  {Requests: 1, PromptTokens: 10},
		{h, KindClient, "alice", Other}: {Requests: 2, PromptTokens: 20},
		{h, KindClient, Other, Other}:   {Requests: 2, PromptTokens: 20},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("rows\n%v\nwant\n%v", got, want)
	}
	if a.folded.Load() != 4 {
		t.Fatalf("folded %d, want 4", a.folded.Load())
	}
	if s := a.spentOf("bob", now); s.DayTokens != 10 {
		t.Fatalf("bob's spending %+v: folded rows must not fold budgets", s)
	}
	// A name longer than maxNameLen is Other too.
	rec("alice", string(make([]byte, maxNameLen+1)))
	if got := takeAll(a, h); got[Key{h, KindClient, "alice", Other}].Requests != 1 {
		t.Fatalf("a long model name was not folded: %v", got)
	}
}

// The rows in memory are bounded by MaxPendingRows: past it, updates are
// dropped and counted.
func TestAccumulatorPendingBound(t *testing.T) {
	now := utc("2026-03-10T12:30:00Z")
	a := newAccumulator(1000, 1000, 10)
	a.curHour.Store(hourOf(now))
	for i := range 50 {
		a.record(&Entry{Time: now, Client: fmt.Sprint("c", i), Model: "m"}, 0, 0)
	}
	if n := a.rows.Load(); n != 10 {
		t.Fatalf("%d rows, want the bound of 10", n)
	}
	if a.dropped.Load() != 40 {
		t.Fatalf("dropped %d, want 40", a.dropped.Load())
	}
	// Taking keeps the current hour's rows (zeroed) and deletes older ones.
	takeAll(a, hourOf(now))
	if n := a.rows.Load(); n != 10 {
		t.Fatalf("%d rows after a take in the same hour, want 10", n)
	}
	takeAll(a, hourOf(now)+1)
	if n := a.rows.Load(); n != 0 {
		t.Fatalf("%d rows after the hour passed, want 0", n)
	}
}

// A client's spending follows its day and month, late records included.
func TestAccumulatorSpending(t *testing.T) {
	a := newAccumulator(100, 100, 100)
	rec := func(at string, tokens int64, cost Money) {
		tm := utc(at)
		a.curHour.Store(hourOf(tm))
		a.record(&Entry{Time: tm, Client: "c", Model: "m", PromptTokens: tokens}, cost, 0)
	}
	a.addBase("c", Spent{Day: dayOf(utc("2024-02-28T00:00:00Z")), Month: monthOf(utc("2024-02-28T00:00:00Z")), DayTokens: 7, MonthTokens: 70, MonthCost: 5})
	steps := []struct {
		at, seen   string
		tokens     int64
		day, month int64
		cost       Money
	}{
		{"2024-02-28T23:59:00Z", "2024-02-28T23:59:00Z", 10, 17, 80, 6},
		{"2024-02-29T00:00:01Z", "2024-02-29T00:00:01Z", 20, 20, 100, 7}, // leap day: a new day, same month
		{"2024-02-28T23:59:59Z", "2024-02-29T00:00:02Z", 5, 20, 105, 8},  // late record of yesterday: month only
		{"2024-03-01T00:00:00Z", "2024-03-01T00:00:00Z", 1, 1, 1, 1},     // a new month
		{"2024-02-29T23:00:00Z", "2024-03-01T00:00:01Z", 100, 1, 1, 1},   // late record of last month: nothing
		{"2024-03-01T00:00:00Z", "2024-03-02T00:00:00Z", 0, 0, 1, 2},     // seen the next day: the day is empty
	}
	for _, s := range steps {
		rec(s.at, s.tokens, 1)
		got := a.spentOf("c", utc(s.seen))
		if got.DayTokens != s.day || got.MonthTokens != s.month || got.MonthCost != s.cost {
			t.Fatalf("after %s seen at %s: %+v, want day %d month %d cost %d", s.at, s.seen, got, s.day, s.month, s.cost)
		}
	}
}

// Property: whatever the order of records and takes, the deltas taken add
// up to what was recorded, per row, and spending to the tokens recorded.
func TestAccumulatorModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	start := utc("2026-03-10T22:00:00Z")
	for round := range 20 {
		a := newAccumulator(1000, 1000, 100000)
		model := map[Key]Counts{}
		taken := map[Key]Counts{}
		now := start
		var tokens int64
		for range 2000 {
			switch rng.IntN(10) {
			case 0:
				for k, c := range takeAll(a, hourOf(now)) {
					t := taken[k]
					t.Add(c)
					taken[k] = t
				}
			case 1:
				now = now.Add(time.Duration(rng.IntN(20)) * time.Minute)
				a.curHour.Store(hourOf(now))
			default:
				e := Entry{Time: now, Client: fmt.Sprint("c", rng.IntN(5)), Model: fmt.Sprint("m", rng.IntN(3)),
					PromptTokens: int64(rng.IntN(1000)), CompletionTokens: int64(rng.IntN(100)), Error: rng.IntN(7) == 0}
				if rng.IntN(2) == 0 {
					e.Agent = fmt.Sprint("a", rng.IntN(3))
				} else {
					e.Provider = "p"
				}
				e.CachedTokens = e.PromptTokens / 2
				a.record(&e, 3, 1)
				h := hourOf(now)
				add := func(k Key, cost, saved Money) {
					c := model[k]
					c.addEntry(&e, cost, saved)
					model[k] = c
				}
				add(Key{h, KindClient, e.Client, e.Model}, 3, 1)
				if e.Agent != "" {
					add(Key{h, KindAgent, e.Agent, e.Model}, 0, 0)
				} else {
					add(Key{h, KindProvider, e.Provider, e.Model}, 3, 1)
				}
				tokens += e.PromptTokens + e.CompletionTokens
			}
		}
		for k, c := range takeAll(a, hourOf(now)) {
			t := taken[k]
			t.Add(c)
			taken[k] = t
		}
		if fmt.Sprint(taken) != fmt.Sprint(model) {
			t.Fatalf("round %d: taken\n%v\nrecorded\n%v", round, taken, model)
		}
		var month int64
		for i := range 5 {
			month += a.spentOf(fmt.Sprint("c", i), now).MonthTokens
		}
		if monthOf(now) == monthOf(start) && month != tokens {
			t.Fatalf("round %d: month spending %d, want %d", round, month, tokens)
		}
	}
}
