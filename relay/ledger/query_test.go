package ledger

import (
	"testing"
	"time"
)

func TestSpanOf(t *testing.T) {
	now := utc("2026-03-10T14:37:00Z")
	const hourly, daily = 90 * 24, 730
	h := func(s string) int64 { return hourOf(utc(s)) }
	d := func(s string) int64 { return dayOf(utc(s)) }
	cases := []struct {
		name          string
		since         time.Time
		start         string
		h0, hourlyEnd int64
		d0            int64
	}{
		{"7 days: a partial day of hours, then days", now.Add(-7 * 24 * time.Hour), "2026-03-03T14:00:00Z",
			h("2026-03-03T14:00:00Z"), h("2026-03-04T00:00:00Z"), d("2026-03-04T00:00:00Z")},
		{"2 hours: hours only", now.Add(-2 * time.Hour), "2026-03-10T12:00:00Z",
			h("2026-03-10T12:00:00Z"), h("2026-03-11T00:00:00Z"), d("2026-03-11T00:00:00Z")},
		{"from a midnight: days only", utc("2026-03-03T00:00:00Z"), "2026-03-03T00:00:00Z",
			h("2026-03-03T00:00:00Z"), h("2026-03-03T00:00:00Z"), d("2026-03-03T00:00:00Z")},
		{"past the hourly rows: from that midnight", now.Add(-100 * 24 * time.Hour), "2025-11-30T00:00:00Z",
			h("2025-11-30T00:00:00Z"), h("2025-11-30T00:00:00Z"), d("2025-11-30T00:00:00Z")},
		{"past the daily rows: from the oldest kept day", now.Add(-3 * 365 * 24 * time.Hour), "2024-03-11T00:00:00Z",
			h("2024-03-11T00:00:00Z"), h("2024-03-11T00:00:00Z"), d("2024-03-11T00:00:00Z")},
		{"in the future: this hour", now.Add(time.Hour), "2026-03-10T14:00:00Z",
			h("2026-03-10T14:00:00Z"), h("2026-03-11T00:00:00Z"), d("2026-03-11T00:00:00Z")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sp := spanOf(c.since, now, hourly, daily)
			if got := sp.start.Format(time.RFC3339); got != c.start || sp.h0 != c.h0 || sp.hourlyEnd != c.hourlyEnd || sp.d0 != c.d0 || sp.dEnd != d("2026-03-11T00:00:00Z") {
				t.Fatalf("span %+v (start %s), want start %s h0 %d hourly end %d d0 %d", sp, got, c.start, c.h0, c.hourlyEnd, c.d0)
			}
		})
	}
}

func TestGrouper(t *testing.T) {
	rows := []struct {
		kind        Kind
		name, model string
		c           Counts
	}{
		{KindClient, "alice", "llama", Counts{Requests: 2, PromptTokens: 100, CompletionTokens: 10}},
		{KindClient, "alice", "qwen", Counts{Requests: 1, PromptTokens: 1000, CachedTokens: 900}},
		{KindClient, "bob", "llama", Counts{Requests: 1, PromptTokens: 50}},
		{KindAgent, "gpu-1", "llama", Counts{Requests: 3, PromptTokens: 150, CompletionTokens: 10}},
		{KindProvider, "openai", "qwen", Counts{Requests: 1, PromptTokens: 1000, CachedTokens: 900, Cost: 7, Saved: 3}},
	}
	cases := []struct {
		by   By
		keys []string
		reqs []int64
	}{
		{ByClient, []string{"alice", "bob"}, []int64{3, 1}},
		{ByModel, []string{"qwen", "llama"}, []int64{1, 3}},
		{ByAgent, []string{"gpu-1"}, []int64{3}},
		{ByProvider, []string{"openai"}, []int64{1}},
	}
	for _, c := range cases {
		t.Run(c.by.String(), func(t *testing.T) {
			g := newGrouper(c.by)
			for _, r := range rows {
				g.add(r.kind, r.name, r.model, r.c)
			}
			got := g.rows()
			if len(got) != len(c.keys) {
				t.Fatalf("rows %+v, want keys %v", got, c.keys)
			}
			for i := range got {
				if got[i].Key != c.keys[i] || got[i].Requests != c.reqs[i] {
					t.Fatalf("row %d: %+v, want %s with %d requests", i, got[i], c.keys[i], c.reqs[i])
				}
			}
			if g.total.Requests != 4 || g.total.PromptTokens != 1150 || g.total.CachedTokens != 900 {
				t.Fatalf("total %+v: want the clients' rows only", g.total)
			}
		})
	}
}

func TestParseSinceAndBy(t *testing.T) {
	now := utc("2026-03-10T12:00:00Z")
	good := map[string]string{
		"7d":                   "2026-03-03T12:00:00Z",
		"1.5d":                 "2026-03-09T00:00:00Z",
		"36h":                  "2026-03-09T00:00:00Z",
		"90m":                  "2026-03-10T10:30:00Z",
		"2026-03-01T00:00:00Z": "2026-03-01T00:00:00Z",
	}
	for in, want := range good {
		got, err := ParseSince(in, now)
		if err != nil || got.UTC().Format(time.RFC3339) != want {
			t.Errorf("ParseSince(%q) = %v, %v; want %s", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "7", "-1d", "xd", "1y", "-5h", "2027-01-01T00:00:00Z", "4000d", "NaNd"} {
		if _, err := ParseSince(bad, now); err == nil {
			t.Errorf("ParseSince(%q) accepted", bad)
		}
	}
	for _, s := range []string{"client", "agent", "model", "provider"} {
		if b, err := ParseBy(s); err != nil || b.String() != s {
			t.Errorf("ParseBy(%q) = %v, %v", s, b, err)
		}
	}
	if _, err := ParseBy("key"); err == nil {
		t.Error("ParseBy accepted key")
	}
}
