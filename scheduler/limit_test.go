package scheduler

import (
	"testing"
	"time"
)

func TestLimiter(t *testing.T) {
	t0 := newFakeClock().Now()
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	type step struct {
		s    LimitSample
		want int
	}
	cases := []struct {
		name  string
		cfg   LimitConfig
		steps []step
	}{
		{"fixed holds whatever the engine says", LimitConfig{Fixed: 5}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 5, Running: 2, Waiting: 3}, 5},
			{LimitSample{At: at(1), Known: true, InFlight: 5, Running: 2, Waiting: 3}, 5},
			{LimitSample{At: at(9), Known: true, InFlight: 5}, 5},
		}},
		{"one queued sample is not enough; two cut to the batch", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 8, Running: 4, Waiting: 4}, 8},
			{LimitSample{At: at(1), Known: true, InFlight: 8, Running: 3, Waiting: 5}, 4},
		}},
		{"a queued sample between two clear ones cuts nothing", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 3, Running: 2, Waiting: 1}, 8},
			{LimitSample{At: at(1), Known: true, InFlight: 3, Running: 3}, 8},
			{LimitSample{At: at(2), Known: true, InFlight: 3, Running: 2, Waiting: 1}, 8},
		}},
		{"doubles while the limit is used and the engine never queued", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 8, Running: 8}, 16},
			{LimitSample{At: at(1), Known: true, InFlight: 16, Running: 16}, 16}, // within GrowEvery
			{LimitSample{At: at(2), Known: true, InFlight: 16, Running: 16}, 32},
			{LimitSample{At: at(4), Known: true, InFlight: 6, Running: 6}, 32}, // not using it: no growth
		}},
		{"slow start ends at the first cut", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 8, Running: 8}, 16},
			{LimitSample{At: at(2), Known: true, InFlight: 16, Running: 12, Waiting: 4, KVCacheUsage: 0.95}, 16},
			{LimitSample{At: at(3), Known: true, InFlight: 16, Running: 12, Waiting: 4, KVCacheUsage: 0.95}, 12},
			{LimitSample{At: at(4), Known: true, InFlight: 12, Running: 12, KVCacheUsage: 0.5}, 12}, // within GrowEvery
			{LimitSample{At: at(5), Known: true, InFlight: 12, Running: 12, KVCacheUsage: 0.5}, 13},
		}},
		{"after a cut with the KV cache full it probes by one", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 8, Running: 6, Waiting: 2, KVCacheUsage: 0.93}, 8},
			{LimitSample{At: at(1), Known: true, InFlight: 8, Running: 6, Waiting: 2, KVCacheUsage: 0.94}, 6},
			{LimitSample{At: at(3), Known: true, InFlight: 6, Running: 6, KVCacheUsage: 0.8}, 7},
			{LimitSample{At: at(5), Known: true, InFlight: 7, Running: 7, KVCacheUsage: 0.85}, 8},
			{LimitSample{At: at(6), Known: true, InFlight: 8, Running: 6, Waiting: 2, KVCacheUsage: 0.91}, 8},
			{LimitSample{At: at(7), Known: true, InFlight: 8, Running: 6, Waiting: 2, KVCacheUsage: 0.92}, 6},
		}},
		{"after a cut with KV to spare it probes once a minute", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 8, Running: 4, Waiting: 4, KVCacheUsage: 0.2}, 8},
			{LimitSample{At: at(1), Known: true, InFlight: 8, Running: 4, Waiting: 4, KVCacheUsage: 0.2}, 4},
			{LimitSample{At: at(3), Known: true, InFlight: 4, Running: 4, KVCacheUsage: 0.2}, 4},
			{LimitSample{At: at(60), Known: true, InFlight: 4, Running: 4, KVCacheUsage: 0.2}, 4},
			{LimitSample{At: at(61), Known: true, InFlight: 4, Running: 4, KVCacheUsage: 0.2}, 5},
			{LimitSample{At: at(62), Known: true, InFlight: 5, Running: 4, Waiting: 1, KVCacheUsage: 0.2}, 5},
			{LimitSample{At: at(63), Known: true, InFlight: 5, Running: 4, Waiting: 1, KVCacheUsage: 0.2}, 4},
			{LimitSample{At: at(65), Known: true, InFlight: 4, Running: 4, KVCacheUsage: 0.2}, 4},
		}},
		{"a full KV cache stops growth", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 8, Running: 8, KVCacheUsage: 0.97}, 8},
		}},
		{"unknown samples change nothing", LimitConfig{}, []step{
			{LimitSample{At: at(0), InFlight: 8, Running: 1, Waiting: 7}, 8},
			{LimitSample{At: at(1), InFlight: 8, Running: 1, Waiting: 7}, 8},
		}},
		{"an engine queueing others' work above the limit keeps it", LimitConfig{}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 8, Running: 20, Waiting: 5}, 8},
			{LimitSample{At: at(1), Known: true, InFlight: 8, Running: 20, Waiting: 5}, 8},
			{LimitSample{At: at(3), Known: true, InFlight: 8, Running: 20}, 8},
			{LimitSample{At: at(61), Known: true, InFlight: 8, Running: 20}, 9},
		}},
		{"bounds", LimitConfig{Initial: 1000, Min: 2, Max: 10}, []step{
			{LimitSample{At: at(0), Known: true, InFlight: 10, Running: 10}, 10},
			{LimitSample{At: at(1), Known: true, InFlight: 10, Running: 1, Waiting: 9}, 10},
			{LimitSample{At: at(2), Known: true, InFlight: 10, Running: 1, Waiting: 9}, 2},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := NewLimiter(tc.cfg)
			for i, st := range tc.steps {
				if got := l.Observe(st.s); got != st.want || l.Limit() != got {
					t.Fatalf("step %d (%+v): limit %d, want %d", i, st.s, got, st.want)
				}
			}
		})
	}
}

// TestLimiterFindsBatch drives a Limiter against a model engine that batches
// 24 and checks it settles on 24 from below and from above.
func TestLimiterFindsBatch(t *testing.T) {
	const batch = 24
	for _, initial := range []int{1, 8, 200} {
		l := NewLimiter(LimitConfig{Initial: initial})
		now := newFakeClock().Now()
		atBatch, exact := 0, 0
		for i := range 200 {
			// Demand is unbounded: the agent sends up to its limit.
			n := l.Limit()
			s := LimitSample{At: now, Known: true, InFlight: n, Running: min(n, batch), Waiting: max(n-batch, 0)}
			l.Observe(s)
			now = now.Add(time.Second)
			if i >= 100 && l.Limit() >= batch-1 && l.Limit() <= batch+1 {
				atBatch++
			}
			if i >= 100 && l.Limit() == batch {
				exact++
			}
		}
		// Probing goes one above the batch for two samples a minute:
		// the limit stays within one of the batch after the first
		// hundred samples, and on it all but those.
		if atBatch != 100 || exact < 95 {
			t.Errorf("initial %d: within one of the batch in %d of the last 100 samples, on it in %d (limit now %d)", initial, atBatch, exact, l.Limit())
		}
	}
}
