package ledger

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// By is how a usage report groups its rows.
type By uint8

// The groupings.
const (
	// ByClient groups the clients' rows by client.
	ByClient By = iota
	// ByAgent groups the agents' rows by agent: what each served.
	ByAgent
	// ByModel groups the clients' rows by model.
	ByModel
	// ByProvider groups the provider endpoints' rows by endpoint.
	ByProvider
)

// String returns the grouping's name.
func (b By) String() string {
	switch b {
	case ByAgent:
		return "agent"
	case ByModel:
		return "model"
	case ByProvider:
		return "provider"
	}
	return "client"
}

// ParseBy parses client, agent, model or provider.
func ParseBy(s string) (By, error) {
	for _, b := range []By{ByClient, ByAgent, ByModel, ByProvider} {
		if s == b.String() {
			return b, nil
		}
	}
	return 0, fmt.Errorf("by %q: want client, agent, model or provider", s)
}

// maxSince bounds how far back a query may ask.
const maxSince = 10 * 366 * 24 * time.Hour

// ParseSince reads a query's start: a duration back from now ("7d",
// "36h", "90m", days as "d"), or an RFC 3339 time.
func ParseSince(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		if t.After(now) || now.Sub(t) > maxSince {
			return time.Time{}, fmt.Errorf("since %q: not within the last 10 years", s)
		}
		return t, nil
	}
	var d time.Duration
	if n, ok := strings.CutSuffix(s, "d"); ok {
		days, err := strconv.ParseFloat(n, 64)
		if err != nil || !(days >= 0) || days > float64(maxSince/(24*time.Hour)) {
			return time.Time{}, fmt.Errorf("since %q: want a duration such as 7d, 36h or 90m, or an RFC 3339 time", s)
		}
		d = time.Duration(days * float64(24*time.Hour))
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil || d < 0 || d > maxSince {
			return time.Time{}, fmt.Errorf("since %q: want a duration such as 7d, 36h or 90m, or an RFC 3339 time", s)
		}
	}
	return now.Add(-d), nil
}

// Report is a usage report.
type Report struct {
	// Since is where the report starts: the query's start rounded down to
	// the hour, or to the day where only daily rows remain.
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
	By    string    `json:"by"`
	// Rows are the groups, most tokens first.
	Rows []ReportRow `json:"rows"`
	// Total counts every request (the clients' rows), whatever the
	// grouping: agents' and providers' rows together may count fewer.
	Total Counts `json:"total"`
	// Ledger is the ledger's state when the report was made.
	Ledger Health `json:"ledger"`
}

// ReportRow is one group of a Report.
type ReportRow struct {
	Key string `json:"key"`
	Counts
}

// grouper sums rows into a report's groups.
type grouper struct {
	by    By
	agent string // set: only this agent's rows, by model, and their total
	m     map[string]*Counts
	total Counts
}

func newGrouper(by By) *grouper { return &grouper{by: by, m: map[string]*Counts{}} }

// add counts one row.
func (g *grouper) add(kind Kind, name, model string, c Counts) {
	if g.agent != "" {
		if kind != KindAgent || name != g.agent {
			return
		}
		g.total.Add(c)
	} else if kind == KindClient {
		g.total.Add(c)
	}
	var key string
	switch {
	case g.agent != "":
		key = model
	case g.by == ByClient && kind == KindClient:
		key = name
	case g.by == ByModel && kind == KindClient:
		key = model
	case g.by == ByAgent && kind == KindAgent, g.by == ByProvider && kind == KindProvider:
		key = name
	default:
		return
	}
	s := g.m[key]
	if s == nil {
		s = &Counts{}
		g.m[key] = s
	}
	s.Add(c)
}

// rows returns the groups, most tokens first, then by key.
func (g *grouper) rows() []ReportRow {
	out := make([]ReportRow, 0, len(g.m))
	for k, c := range g.m {
		out = append(out, ReportRow{Key: k, Counts: *c})
	}
	slices.SortFunc(out, func(a, b ReportRow) int {
		if c := cmp.Compare(b.Tokens(), a.Tokens()); c != 0 {
			return c
		}
		return strings.Compare(a.Key, b.Key)
	})
	return out
}

// span is which rows cover a query from since to now: hourly rows for
// hours [h0, d0*24), daily rows for days [d0, dEnd), and pending deltas
// from hour h0 on.
type span struct {
	start     time.Time
	h0, d0    int64
	dEnd      int64
	hourlyEnd int64
}

// spanOf plans a query: hourly rows up to the first midnight after since,
// daily rows after it, so a month reads about 30 rows per entity. Where
// hourly rows are gone (hourlyKeep hours), it starts at since's midnight;
// where daily rows are gone too (dailyKeep days), at the oldest kept day.
func spanOf(since, now time.Time, hourlyKeep, dailyKeep int64) span {
	hNow, dNow := hourOf(now), dayOf(now)
	h0 := hourOf(since)
	if h0 > hNow {
		h0 = hNow
	}
	sp := span{dEnd: dNow + 1}
	if h0 <= hNow-hourlyKeep {
		sp.d0 = max(floorDiv(h0, hoursPerDay), dNow-dailyKeep+1)
		sp.h0, sp.hourlyEnd = sp.d0*hoursPerDay, sp.d0*hoursPerDay
		sp.start = dayTime(sp.d0)
		return sp
	}
	sp.h0 = h0
	sp.d0 = floorDiv(h0+hoursPerDay-1, hoursPerDay)
	sp.hourlyEnd = sp.d0 * hoursPerDay
	sp.start = hourTime(h0)
	return sp
}

// Usage reports the use since since, grouped by by: what the file holds
// plus what waits in memory. It fails while the file cannot be read.
func (l *Ledger) Usage(since time.Time, by By) (Report, error) {
	return l.usage(since, newGrouper(by))
}

// AgentUsage reports what agent served since since, by model, and
// nothing about anyone else: what an agent's owner may see.
func (l *Ledger) AgentUsage(since time.Time, agent string) (Report, error) {
	if agent == "" {
		return Report{}, fmt.Errorf("agent usage: no agent name")
	}
	return l.usage(since, &grouper{by: ByModel, agent: agent, m: map[string]*Counts{}})
}

func (l *Ledger) usage(since time.Time, g *grouper) (Report, error) {
	l.viewMu.RLock()
	defer l.viewMu.RUnlock()
	now := l.cfg.Now()
	sp := spanOf(since, now, int64(l.cfg.HourlyRetention/time.Hour), int64(l.cfg.DailyRetention/(24*time.Hour)))
	add := func(r Row) { g.add(r.Kind, r.Name, r.Model, r.Counts) }
	if sp.h0 < sp.hourlyEnd {
		if err := l.store.Scan(Hourly, sp.h0, sp.hourlyEnd, add); err != nil {
			return Report{}, err
		}
	}
	if sp.d0 < sp.dEnd {
		if err := l.store.Scan(Daily, sp.d0, sp.dEnd, add); err != nil {
			return Report{}, err
		}
	}
	pending := func(k Key, c Counts) {
		if k.Hour >= sp.h0 {
			g.add(k.Kind, k.Name, k.Model, c)
		}
	}
	l.acc.each(pending)
	if b := l.carry; b != nil {
		// A failed commit may have reached the file after all: then its
		// batch is counted there, not here.
		if seq, err := l.store.Seq(); err == nil && seq < b.seq {
			for _, d := range b.deltas {
				pending(d.Key, d.Counts)
			}
		}
	}
	return Report{Since: sp.start, Until: now.UTC(), By: g.by.String(), Rows: g.rows(), Total: g.total, Ledger: l.Health()}, nil
}
