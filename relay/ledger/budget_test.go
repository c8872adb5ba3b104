package ledger

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

func utc(s string) time.Time {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return t
}

// spentAt is a Spent of now's day and month.
func spentAt(now time.Time, day, month int64, cost float64) Spent {
	return Spent{Day: dayOf(now), Month: monthOf(now), DayTokens: day, MonthTokens: month, MonthCost: moneyOf(cost)}
}

func TestCheck(t *testing.T) {
	day := Budget{TokensPerDay: 100}
	month := Budget{TokensPerMonth: 1000}
	both := Budget{TokensPerDay: 100, TokensPerMonth: 1000, CostPerMonth: 2.5}
	cases := []struct {
		name   string
		b      Budget
		used   Spent
		now    time.Time
		over   bool
		limit  Limit
		reset  string
		retry  time.Duration
		inMesg string
	}{
		{name: "unlimited", b: Budget{}, used: spentAt(utc("2026-03-10T12:00:00Z"), 1e9, 1e9, 1e9), now: utc("2026-03-10T12:00:00Z")},
		{name: "day under", b: day, used: spentAt(utc("2026-03-10T12:00:00Z"), 99, 99, 0), now: utc("2026-03-10T12:00:00Z")},
		{name: "day reached", b: day, used: spentAt(utc("2026-03-10T12:00:00Z"), 100, 100, 0), now: utc("2026-03-10T12:00:00Z"),
			over: true, limit: LimitDay, reset: "2026-03-11T00:00:00Z", retry: 12 * time.Hour, inMesg: "100 of 100 tokens"},
		{name: "last second of the year", b: day, used: spentAt(utc("2025-12-31T23:59:59Z"), 150, 150, 0), now: utc("2025-12-31T23:59:59Z"),
			over: true, limit: LimitDay, reset: "2026-01-01T00:00:00Z", retry: time.Second},
		{name: "a fraction of a second rounds up", b: day, used: spentAt(utc("2025-12-31T23:59:58.2Z"), 150, 150, 0), now: utc("2025-12-31T23:59:58.2Z"),
			over: true, limit: LimitDay, reset: "2026-01-01T00:00:00Z", retry: 2 * time.Second},
		{name: "yesterday's use does not count today", b: day, used: spentAt(utc("2026-03-09T23:00:00Z"), 500, 500, 0), now: utc("2026-03-10T00:00:00Z")},
		{name: "leap day: the day resets on Feb 29", b: day, used: spentAt(utc("2024-02-28T10:00:00Z"), 100, 100, 0), now: utc("2024-02-28T10:00:00Z"),
			over: true, limit: LimitDay, reset: "2024-02-29T00:00:00Z", retry: 14 * time.Hour},
		{name: "leap year: the month resets on Mar 1 after Feb 29", b: month, used: spentAt(utc("2024-02-29T23:00:00Z"), 0, 1000, 0), now: utc("2024-02-29T23:00:00Z"),
			over: true, limit: LimitMonth, reset: "2024-03-01T00:00:00Z", retry: time.Hour},
		{name: "common year: Feb 28 is the month's last day", b: month, used: spentAt(utc("2023-02-28T12:00:00Z"), 0, 1000, 0), now: utc("2023-02-28T12:00:00Z"),
			over: true, limit: LimitMonth, reset: "2023-03-01T00:00:00Z", retry: 12 * time.Hour},
		{name: "December resets in January", b: month, used: spentAt(utc("2026-12-15T00:00:00Z"), 0, 2000, 0), now: utc("2026-12-15T00:00:00Z"),
			over: true, limit: LimitMonth, reset: "2027-01-01T00:00:00Z", retry: 17 * 24 * time.Hour},
		{name: "last month's use does not count", b: month, used: spentAt(utc("2026-02-28T23:59:59Z"), 0, 5000, 0), now: utc("2026-03-01T00:00:00Z")},
		{name: "day and month used up: the later reset", b: both, used: spentAt(utc("2026-03-10T12:00:00Z"), 100, 1000, 0), now: utc("2026-03-10T12:00:00Z"),
			over: true, limit: LimitMonth, reset: "2026-04-01T00:00:00Z", retry: (21*24 + 12) * time.Hour},
		{name: "cost used up", b: both, used: spentAt(utc("2026-03-10T12:00:00Z"), 10, 10, 2.5), now: utc("2026-03-10T12:00:00Z"),
			over: true, limit: LimitCost, reset: "2026-04-01T00:00:00Z", retry: (21*24 + 12) * time.Hour, inMesg: "2.50 of 2.50"},
		{name: "day and cost used up: cost resets later", b: both, used: spentAt(utc("2026-03-10T12:00:00Z"), 100, 100, 3), now: utc("2026-03-10T12:00:00Z"),
			over: true, limit: LimitCost, reset: "2026-04-01T00:00:00Z", retry: (21*24 + 12) * time.Hour},
		{name: "cost under", b: both, used: spentAt(utc("2026-03-10T12:00:00Z"), 10, 10, 2.4999), now: utc("2026-03-10T12:00:00Z")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v := Check(c.b, c.used, c.now)
			if v.Over != c.over || v.Limit != c.limit {
				t.Fatalf("verdict %+v, want over=%v limit=%v", v, c.over, c.limit)
			}
			if !c.over {
				if v.Message() != "" {
					t.Fatalf("message %q for a request under budget", v.Message())
				}
				return
			}
			if got := v.Reset.UTC().Format(time.RFC3339); got != c.reset {
				t.Fatalf("reset %s, want %s", got, c.reset)
			}
			if got := v.RetryAfter(c.now); got != c.retry {
				t.Fatalf("retry after %v, want %v", got, c.retry)
			}
			if m := v.Message(); !strings.Contains(m, c.reset) || !strings.Contains(m, c.inMesg) {
				t.Fatalf("message %q does not say %q and the reset", m, c.inMesg)
			}
		})
	}
}

// A peer's report counts when it is of now's day and month, and only the
// part that is.
func TestSpentPlus(t *testing.T) {
	now := utc("2026-03-10T12:00:00Z")
	own := spentAt(now, 10, 100, 1)
	cases := []struct {
		name       string
		peer       Spent
		day, month int64
		cost       float64
	}{
		{"same day", spentAt(now, 5, 50, 0.5), 15, 150, 1.5},
		{"yesterday, same month", spentAt(now.Add(-24*time.Hour), 5, 50, 0.5), 10, 150, 1.5},
		{"last month", spentAt(utc("2026-02-27T12:00:00Z"), 5, 50, 0.5), 10, 100, 1},
		{"a day ahead (clock skew)", spentAt(now.Add(24*time.Hour), 5, 50, 0.5), 10, 150, 1.5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := own.Plus(c.peer, now)
			if s.DayTokens != c.day || s.MonthTokens != c.month || s.MonthCost != moneyOf(c.cost) || s.Day != dayOf(now) || s.Month != monthOf(now) {
				t.Fatalf("got %+v, want day %d month %d cost %v", s, c.day, c.month, c.cost)
			}
		})
	}
}

func TestPeriods(t *testing.T) {
	cases := []struct {
		t           string
		hour, day   int64
		month       string
		monthNumber int32
	}{
		{"1970-01-01T00:00:00Z", 0, 0, "1970-01-01T00:00:00Z", 1970 * 12},
		{"1969-12-31T23:59:59Z", -1, -1, "1969-12-01T00:00:00Z", 1969*12 + 11},
		{"2024-02-29T13:30:00+02:00", 474779, 19782, "2024-02-01T00:00:00Z", 2024*12 + 1},
	}
	for _, c := range cases {
		tm := utc(c.t)
		if hourOf(tm) != c.hour || dayOf(tm) != c.day || monthOf(tm) != c.monthNumber {
			t.Errorf("%s: hour %d day %d month %d, want %d %d %d", c.t, hourOf(tm), dayOf(tm), monthOf(tm), c.hour, c.day, c.monthNumber)
		}
		if got := monthTime(monthOf(tm)).Format(time.RFC3339); got != c.month {
			t.Errorf("%s: month starts %s, want %s", c.t, got, c.month)
		}
		if !hourTime(c.hour).Equal(tm.Truncate(time.Hour)) || !dayTime(c.day).Equal(tm.UTC().Truncate(24*time.Hour)) {
			t.Errorf("%s: period starts %s %s", c.t, hourTime(c.hour), dayTime(c.day))
		}
	}
}

func TestPricesCost(t *testing.T) {
	p := Prices{Input: 2.5, CachedInput: 1.25, Output: 10}
	cases := []struct {
		name                       string
		p                          Prices
		prompt, cached, completion int64
		cost, saved                float64
	}{
		{"cold", p, 1_000_000, 0, 0, 2.5, 0},
		{"all cached", p, 1_000_000, 1_000_000, 0, 1.25, 1.25},
		{"mixed", p, 2000, 1500, 300, (500*2.5 + 1500*1.25 + 300*10) / 1e6, 1500 * 1.25 / 1e6},
		{"one cheap token", Prices{Input: 0.075}, 1, 0, 0, 0.075e-6, 0},
		{"no discount saves nothing", Prices{Input: 1, CachedInput: 1}, 100, 100, 0, 100e-6, 0},
		{"a dearer cache saves nothing", Prices{Input: 1, CachedInput: 2}, 100, 100, 0, 200e-6, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cost, saved := c.p.Cost(c.prompt, c.cached, c.completion)
			if cost != moneyOf(c.cost) || saved != moneyOf(c.saved) {
				t.Fatalf("cost %d saved %d, want %d %d", cost, saved, moneyOf(c.cost), moneyOf(c.saved))
			}
		})
	}
	for _, bad := range []Prices{{Input: -1}, {CachedInput: -0.1}, {Output: 2e6}} {
		if bad.Validate() == nil {
			t.Errorf("%+v validated", bad)
		}
	}
	if p.Validate() != nil {
		t.Error("good prices refused")
	}
}

func TestMoneyJSON(t *testing.T) {
	for _, m := range []Money{0, 1, 75, 1_250_000_000, -3} {
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var back Money
		if err := json.Unmarshal(b, &back); err != nil || back != m {
			t.Fatalf("%d -> %s -> %d (%v)", m, b, back, err)
		}
	}
	var m Money
	if json.Unmarshal([]byte("1e300"), &m) == nil {
		t.Fatal("an absurd amount was accepted")
	}
}
