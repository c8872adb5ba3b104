package ledger

import (
	"fmt"
	"math"
	"strconv"
	"time"
)

// Budget bounds what a client may use. Zero fields are unlimited; the zero
// Budget bounds nothing. It has the fields of the clients file's budget.
type Budget struct {
	// TokensPerDay bounds prompt plus completion tokens per UTC day.
	TokensPerDay int64
	// TokensPerMonth bounds them per UTC calendar month.
	TokensPerMonth int64
	// CostPerMonth bounds the cost per UTC calendar month, in the prices'
	// currency.
	CostPerMonth float64
}

// Unlimited reports whether b bounds nothing.
func (b Budget) Unlimited() bool { return b == Budget{} }

// Spent is a client's use in one UTC day and the UTC month that contains
// it: what budgets are checked against. The zero value is nothing spent on
// day 0.
type Spent struct {
	// Day is the UTC day number (days since 1970-01-01) DayTokens count.
	Day int64 `json:"day"`
	// Month is the UTC month (year*12 + month - 1) MonthTokens and
	// MonthCost count.
	Month int32 `json:"month"`
	// DayTokens and MonthTokens are prompt plus completion tokens.
	DayTokens   int64 `json:"day_tokens"`
	MonthTokens int64 `json:"month_tokens"`
	// MonthCost is the cost of the month's requests served by priced
	// endpoints.
	MonthCost Money `json:"month_cost"`
}

// In returns s as seen at now: counts of another day or month than now's
// count for nothing (a peer's report from yesterday does not spend today).
func (s Spent) In(now time.Time) Spent { return s.in(dayOf(now), monthOf(now)) }

// in is In for day d of month m.
func (s Spent) in(d int64, m int32) Spent {
	out := Spent{Day: d, Month: m}
	if s.Day == d {
		out.DayTokens = s.DayTokens
	}
	if s.Month == m {
		out.MonthTokens, out.MonthCost = s.MonthTokens, s.MonthCost
	}
	return out
}

// Plus returns the sum of s and o, both seen at now.
func (s Spent) Plus(o Spent, now time.Time) Spent {
	return s.plus(o, dayOf(now), monthOf(now))
}

func (s Spent) plus(o Spent, d int64, m int32) Spent {
	s, o = s.in(d, m), o.in(d, m)
	s.DayTokens += o.DayTokens
	s.MonthTokens += o.MonthTokens
	s.MonthCost += o.MonthCost
	return s
}

// Limit names the bound a Verdict is about.
type Limit uint8

// The bounds.
const (
	// LimitNone: nothing is over.
	LimitNone Limit = iota
	// LimitDay: Budget.TokensPerDay.
	LimitDay
	// LimitMonth: Budget.TokensPerMonth.
	LimitMonth
	// LimitCost: Budget.CostPerMonth.
	LimitCost
	// LimitUnavailable: the ledger cannot count and the operator chose to
	// fail closed.
	LimitUnavailable
)

// String returns the budget field's name.
func (l Limit) String() string {
	switch l {
	case LimitDay:
		return "tokens_per_day"
	case LimitMonth:
		return "tokens_per_month"
	case LimitCost:
		return "cost_per_month"
	case LimitUnavailable:
		return "ledger_unavailable"
	}
	return "none"
}

// Verdict is Check's answer.
type Verdict struct {
	// Over is true when the request must be refused.
	Over bool
	// Limit is the bound that refuses it: the one that resets last when
	// several are used up.
	Limit Limit
	// Used and Max are the refusing bound's use and limit, in tokens or in
	// currency for LimitCost.
	Used, Max float64
	// Reset is when the refusing bound's period ends (UTC midnight, or the
	// first of the next month), or when to try again for
	// LimitUnavailable.
	Reset time.Time
}

// RetryAfter returns the wait until v.Reset from now in whole seconds,
// rounded up, at least 1 s: the 429's Retry-After.
func (v Verdict) RetryAfter(now time.Time) time.Duration {
	d := v.Reset.Sub(now)
	s := (d + time.Second - 1) / time.Second
	return max(s, 1) * time.Second
}

// Message says why a request is refused, for the 429's error message; it
// names no key. Empty when v is not Over.
func (v Verdict) Message() string {
	reset := v.Reset.UTC().Format(time.RFC3339)
	switch v.Limit {
	case LimitDay:
		return fmt.Sprintf("Daily token budget used up (%.0f of %.0f tokens); it resets at %s", v.Used, v.Max, reset)
	case LimitMonth:
		return fmt.Sprintf("Monthly token budget used up (%.0f of %.0f tokens); it resets at %s", v.Used, v.Max, reset)
	case LimitCost:
		return fmt.Sprintf("Monthly cost budget used up (%.2f of %.2f); it resets at %s", v.Used, v.Max, reset)
	case LimitUnavailable:
		return "The usage ledger is unavailable and budgets fail closed; try again after " + reset
	}
	return ""
}

// unavailableRetry is when a client refused by a failed-closed ledger may
// try again.
const unavailableRetry = time.Minute

// Check says whether a request may start under budget b when its client
// has used used (its own use plus its peers', summed with Spent.Plus) at
// now. A request is refused once a bound is reached, so the request that
// crosses it is served: a budget is overshot by at most the requests in
// flight when it is reached. Used counts of another day or month than
// now's count for nothing.
func Check(b Budget, used Spent, now time.Time) Verdict {
	return check(b, used.In(now))
}

// check is Check for used already seen at now.
func check(b Budget, used Spent) Verdict {
	var v Verdict
	over := func(l Limit, u, m float64, reset time.Time) {
		if !v.Over || reset.After(v.Reset) {
			v = Verdict{Over: true, Limit: l, Used: u, Max: m, Reset: reset}
		}
	}
	if b.TokensPerDay > 0 && used.DayTokens >= b.TokensPerDay {
		over(LimitDay, float64(used.DayTokens), float64(b.TokensPerDay), dayTime(used.Day+1))
	}
	next := monthTime(used.Month + 1)
	if b.TokensPerMonth > 0 && used.MonthTokens >= b.TokensPerMonth {
		over(LimitMonth, float64(used.MonthTokens), float64(b.TokensPerMonth), next)
	}
	if b.CostPerMonth > 0 && used.MonthCost >= moneyOf(b.CostPerMonth) {
		over(LimitCost, used.MonthCost.Float64(), b.CostPerMonth, next)
	}
	return v
}

// Money is an amount in billionths of the prices' currency unit (the
// endpoints file's prices are per million tokens, so a token at 0.075 per
// million costs 75): integer, so sums are exact and the same everywhere.
type Money int64

// Float64 returns m in currency units.
func (m Money) Float64() float64 { return float64(m) / 1e9 }

// MarshalJSON writes m in currency units.
func (m Money) MarshalJSON() ([]byte, error) {
	return strconv.AppendFloat(nil, m.Float64(), 'f', -1, 64), nil
}

// UnmarshalJSON reads an amount in currency units.
func (m *Money) UnmarshalJSON(b []byte) error {
	f, err := strconv.ParseFloat(string(b), 64)
	if err != nil || !(f >= -9e9 && f <= 9e9) {
		return fmt.Errorf("ledger: amount %s: want a number of at most 9e9", b)
	}
	*m = moneyOf(f)
	return nil
}

// moneyOf converts currency units to Money, saturating.
func moneyOf(f float64) Money { return roundMoney(f * 1e9) }

// roundMoney rounds billionths to Money, saturating.
func roundMoney(x float64) Money {
	x = math.Round(x)
	switch {
	case x >= math.MaxInt64:
		return math.MaxInt64
	case x <= math.MinInt64:
		return math.MinInt64
	}
	return Money(x)
}
