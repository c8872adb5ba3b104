package scheduler

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"
)

func TestEWMA(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"))
	samples := []time.Duration{100, 200, 100, 200, 10000, 100}
	// What the formula gives, step by step, in milliseconds.
	pinned := []float64{100, 130, 121, 144.7, 3101.29, 2200.903}
	var want float64
	for i, ms := range samples {
		d := ms * time.Millisecond
		if i == 0 {
			want = float64(d)
		} else {
			want = (1-0.3)*want + 0.3*float64(d)
		}
		do(t, s, Request{Model: "m"}, Outcome{Status: 200, Latency: d})
		got := status(t, s, "a").EWMALatency
		if got != time.Duration(want) {
			t.Fatalf("after sample %d (%v): EWMA %v, formula gives %v", i, d, got, time.Duration(want))
		}
		if math.Abs(float64(got)/1e6-pinned[i]) > 1e-6 {
			t.Fatalf("after sample %d: EWMA %v ms, want %v ms", i, float64(got)/1e6, pinned[i])
		}
	}
}

func TestEWMAFailureLatency(t *testing.T) {
	tests := []struct {
		name    string
		outcome Outcome
		want    time.Duration
	}{
		{"slow timeout raises the average", Outcome{Err: context.DeadlineExceeded, Latency: 1100 * time.Millisecond}, 400 * time.Millisecond},
		{"fast error leaves it", Outcome{Status: 502, Latency: time.Millisecond}, 100 * time.Millisecond},
		{"unmeasured success leaves it", Outcome{Status: 200}, 100 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := newTest(t, Config{}, ep("a"))
			do(t, s, Request{Model: "m"}, Outcome{Status: 200, Latency: 100 * time.Millisecond})
			do(t, s, Request{Model: "m"}, tt.outcome)
			if got := status(t, s, "a").EWMALatency; got != tt.want {
				t.Fatalf("EWMA %v, want %v", got, tt.want)
			}
		})
	}
}

func TestColdStart(t *testing.T) {
	s, _ := newTest(t, Config{}, Endpoint{ID: "a", Models: []string{"m"}, Weight: 2})
	for i := 1; i <= 25; i++ {
		do(t, s, Request{Model: "m"}, Outcome{Status: 200, Latency: 500 * time.Millisecond})
		st := status(t, s, "a")
		if st.Requests != uint64(i) {
			t.Fatalf("Requests = %d after %d requests", st.Requests, i)
		}
		if i < 20 {
			if !st.ColdStart || st.Score != 2 {
				t.Fatalf("after %d requests: cold %v score %v, want cold start with score = weight 2", i, st.ColdStart, st.Score)
			}
			continue
		}
		// weight × successRate × loadFactor / latencyFactor with
		// successRate (i+1)/(i+1), loadFactor 1/(1+0), latency 1+0.5s/1s.
		want := 2 * 1.0 * 1.0 / 1.5
		if st.ColdStart || math.Abs(st.Score-want) > 1e-12 {
			t.Fatalf("after %d requests: cold %v score %v, want %v", i, st.ColdStart, st.Score, want)
		}
	}
}

func TestScoreFactors(t *testing.T) {
	tests := []struct {
		name     string
		capacity int
		inFlight int
		health   Health
		fails    int // endpoint failures among 20 requests
		want     float64
	}{
		{"idle", 0, 0, Health{}, 0, 1 / 1.1},
		{"two in flight, unlimited", 0, 2, Health{}, 0, 1.0 / 3 / 1.1},
		{"two of eight in flight", 8, 2, Health{}, 0, 0.75 / 1.1},
		{"gossip running above ours", 8, 1, Health{Running: 3, Waiting: 1}, 0, 0.5 / 1.1},
		{"KV cache full", 0, 0, Health{KVCacheUsage: 1}, 0, 0.5 / 1.1},
		{"four failures", 0, 0, Health{}, 4, 17.0 / 21 / 1.1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := newTest(t, Config{FailureThreshold: 100, FailureRateMinSamples: 100},
				Endpoint{ID: "a", Models: []string{"m"}, Capacity: tt.capacity})
			for i := range 20 {
				o := Outcome{Status: 200, Latency: 100 * time.Millisecond}
				if i < tt.fails {
					o = Outcome{Status: 500}
				}
				do(t, s, Request{Model: "m"}, o)
			}
			for range tt.inFlight {
				mustPick(t, s.Begin(Request{Model: "m"}))
			}
			s.SetHealth("a", tt.health)
			if got := status(t, s, "a").Score; math.Abs(got-tt.want) > 1e-9 {
				t.Fatalf("score %v, want %v", got, tt.want)
			}
		})
	}
}

func TestSuccessRateRecovers(t *testing.T) {
	s, clk := newTest(t, Config{FailureThreshold: 100, FailureRateMinSamples: 1000}, ep("a"))
	for range 20 {
		do(t, s, Request{Model: "m"}, fail500)
	}
	if got := status(t, s, "a").SuccessRate; math.Abs(got-1.0/21) > 1e-12 {
		t.Fatalf("success rate after 20 failures %v, want 1/21", got)
	}
	clk.Advance(time.Minute) // one half-life
	if got := status(t, s, "a").SuccessRate; math.Abs(got-1.0/11) > 1e-12 {
		t.Fatalf("success rate one half-life later %v, want 1/11", got)
	}
	clk.Advance(10 * time.Minute)
	if got := status(t, s, "a").SuccessRate; got < 0.95 {
		t.Fatalf("success rate after 11 idle minutes %v, want it back near 1", got)
	}
}

func TestDecayRebase(t *testing.T) {
	s, clk := newTest(t, Config{FailureThreshold: 1000, FailureRateMinSamples: 1000}, ep("a"))
	for range 10 {
		clk.Advance(5 * time.Hour) // 300 half-lives: the stored units are rebased
		for range 20 {
			do(t, s, Request{Model: "m"}, fail500)
		}
		if got := status(t, s, "a").SuccessRate; math.Abs(got-1.0/21) > 1e-9 {
			t.Fatalf("success rate %v after 20 fresh failures, want 1/21", got)
		}
	}
	clk.Advance(time.Minute)
	if got := status(t, s, "a").SuccessRate; math.Abs(got-1.0/11) > 1e-9 {
		t.Fatalf("success rate %v one half-life later, want 1/11", got)
	}
}

func TestAffinity(t *testing.T) {
	sess := Request{Model: "m", SessionKey: "s1"}
	type step struct {
		advance time.Duration
		outcome Outcome
		want    Affinity
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"no key is none", nil},
		{"first turn is a miss, next a hit", []step{{0, ok200, AffinityHit}}},
		{"hit at 4m59s idle", []step{{4*time.Minute + 59*time.Second, ok200, AffinityHit}}},
		{"expired at exactly the TTL", []step{{5 * time.Minute, ok200, AffinityMiss}}},
		{"miss at 5m01s idle", []step{{5*time.Minute + time.Second, ok200, AffinityMiss}}},
		{"success refreshes", []step{
			{4 * time.Minute, ok200, AffinityHit},
			{4*time.Minute + 59*time.Second, ok200, AffinityHit},
		}},
		{"client fault does not refresh", []step{
			{4 * time.Minute, Outcome{Status: 400}, AffinityHit},
			{2 * time.Minute, ok200, AffinityMiss},
		}},
		{"connection error evicts", []step{{time.Second, connErr, AffinityHit}, {0, ok200, AffinityMiss}}},
		{"5xx evicts", []step{{time.Second, fail500, AffinityHit}, {0, ok200, AffinityMiss}}},
		{"dead key keeps", []step{{time.Second, Outcome{Status: 401}, AffinityHit}, {0, ok200, AffinityHit}}},
		{"remapped after eviction", []step{
			{time.Second, connErr, AffinityHit},
			{0, ok200, AffinityMiss},
			{0, ok200, AffinityHit},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, clk := newTest(t, Config{}, ep("a"), ep("b"), ep("c"))
			if tt.steps == nil {
				if c := do(t, s, Request{Model: "m"}, ok200); c.Affinity != AffinityNone {
					t.Fatalf("affinity %v without a session key, want none", c.Affinity)
				}
				return
			}
			first := do(t, s, sess, ok200)
			if first.Affinity != AffinityMiss {
				t.Fatalf("first turn affinity %v, want miss", first.Affinity)
			}
			prev := first.EndpointID
			for i, st := range tt.steps {
				clk.Advance(st.advance)
				c := do(t, s, sess, st.outcome)
				if c.Affinity != st.want {
					t.Fatalf("step %d: affinity %v, want %v", i, c.Affinity, st.want)
				}
				if st.want == AffinityHit && c.EndpointID != prev {
					t.Fatalf("step %d: hit on %s, session was on %s", i, c.EndpointID, prev)
				}
				if Classify(st.outcome.Status, st.outcome.Err) == ClassSuccess {
					prev = c.EndpointID
				}
			}
		})
	}
}

func TestAffinityStaysOnBusierEndpoint(t *testing.T) {
	for _, capacity := range []int{0, 10} {
		t.Run(fmt.Sprintf("capacity=%d", capacity), func(t *testing.T) {
			s, _ := newTest(t, Config{ColdStartSamples: 1},
				Endpoint{ID: "a", Models: []string{"m"}, Capacity: capacity},
				Endpoint{ID: "b", Models: []string{"m"}, Capacity: capacity})
			home := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200).EndpointID
			for range 5 { // load up the session's endpoint only
				s.mu.Lock()
				s.endpoints[home].inFlight++
				s.mu.Unlock()
			}
			s.SetHealth(home, Health{Running: 5, Waiting: 2, KVCacheUsage: 0.9})
			c := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200)
			if c.EndpointID != home || c.Affinity != AffinityHit {
				t.Fatalf("got %+v, want a hit on the busier home endpoint %s", c, home)
			}
			// A new session goes to the idle endpoint.
			if c := do(t, s, Request{Model: "m", SessionKey: "new"}, ok200); c.EndpointID == home {
				t.Fatalf("new session placed on the busy endpoint %s", home)
			}
		})
	}
}

func TestAffinityLeavesUnavailableEndpoint(t *testing.T) {
	tests := []struct {
		name   string
		break_ func(t *testing.T, s *Scheduler, home string)
	}{
		{"disabled", func(t *testing.T, s *Scheduler, home string) {
			s.Upsert(Endpoint{ID: home, Models: []string{"m"}, Disabled: true})
		}},
		{"draining", func(t *testing.T, s *Scheduler, home string) { s.SetHealth(home, Health{Draining: true}) }},
		{"suspect", func(t *testing.T, s *Scheduler, home string) { s.SetHealth(home, Health{Suspect: true}) }},
		{"engine saturated", func(t *testing.T, s *Scheduler, home string) {
			s.SetHealth(home, Health{Waiting: 1, KVCacheUsage: 0.99})
		}},
		{"model dropped", func(t *testing.T, s *Scheduler, home string) { s.Upsert(Endpoint{ID: home, Models: []string{"other"}}) }},
		{"at twice its capacity", func(t *testing.T, s *Scheduler, home string) {
			s.Upsert(Endpoint{ID: home, Models: []string{"m"}, Capacity: 1})
			for range 2 {
				if c := mustPick(t, s.Begin(Request{Model: "m", SessionKey: "s"})); c.EndpointID != home {
					t.Fatalf("left %s below twice its capacity: %+v", home, c)
				}
			}
		}},
		{"breaker open", func(t *testing.T, s *Scheduler, home string) {
			a := s.Begin(Request{Model: "m", SessionKey: "s"})
			c, _ := a.Pick()
			a.Report(c, Outcome{Status: 503})
		}},
		{"removed", func(t *testing.T, s *Scheduler, home string) { s.Remove(home) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := newTest(t, Config{}, ep("a"), ep("b"))
			home := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200).EndpointID
			tt.break_(t, s, home)
			c := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200)
			if c.EndpointID == home || c.Affinity != AffinityMiss {
				t.Fatalf("got %+v, want a miss away from %s", c, home)
			}
			// The success re-mapped the session.
			if c2 := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200); c2.EndpointID != c.EndpointID || c2.Affinity != AffinityHit {
				t.Fatalf("after re-mapping got %+v, want a hit on %s", c2, c.EndpointID)
			}
		})
	}
}

func TestAffinityCapacity(t *testing.T) {
	for _, tt := range []struct {
		factor   float64
		capacity int
		hits     int // affinity hits admitted with nothing reported
	}{
		{0, 2, 4}, {1, 2, 2}, {1.5, 3, 5}, {0, 0, 50},
	} {
		t.Run(fmt.Sprintf("factor=%v/capacity=%d", tt.factor, tt.capacity), func(t *testing.T) {
			s, _ := newTest(t, Config{AffinityCapacity: tt.factor},
				Endpoint{ID: "a", Models: []string{"m"}, Capacity: tt.capacity},
				Endpoint{ID: "b", Models: []string{"m"}, Capacity: 1000})
			s.Upsert(Endpoint{ID: "b", Models: []string{"m"}, Disabled: true})
			do(t, s, Request{Model: "m", SessionKey: "s"}, ok200)
			s.Upsert(Endpoint{ID: "b", Models: []string{"m"}, Capacity: 1000})
			for i := range tt.hits {
				c := mustPick(t, s.Begin(Request{Model: "m", SessionKey: "s"}))
				if c.EndpointID != "a" || c.Affinity != AffinityHit {
					t.Fatalf("request %d: %+v, want a hit on a", i, c)
				}
				// New sessions never go beyond the capacity itself.
				if n := status(t, s, "a").InFlight; tt.capacity > 0 && n >= tt.capacity {
					if c := mustPick(t, s.Begin(Request{Model: "m", SessionKey: fmt.Sprint("new", i)})); c.EndpointID != "b" {
						t.Fatalf("new session placed on a with %d in flight of %d", n, tt.capacity)
					}
				}
			}
			if tt.capacity == 0 {
				return
			}
			if c := mustPick(t, s.Begin(Request{Model: "m", SessionKey: "s"})); c.EndpointID != "b" || c.Affinity != AffinityMiss {
				t.Fatalf("beyond the affinity capacity: %+v, want a miss on b", c)
			}
		})
	}
}

func TestEngineBusyButNotSaturatedKeepsAffinity(t *testing.T) {
	for _, h := range []Health{{KVCacheUsage: 0.99}, {Waiting: 10, KVCacheUsage: 0.5}} {
		s, _ := newTest(t, Config{}, ep("a"), ep("b"))
		home := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200).EndpointID
		s.SetHealth(home, h)
		if c := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200); c.Affinity != AffinityHit {
			t.Fatalf("health %+v: got %+v, want a hit", h, c)
		}
	}
}

func TestLRUBound(t *testing.T) {
	s, clk := newTest(t, Config{MaxSessions: 3}, ep("a"), ep("b"))
	for _, k := range []string{"k1", "k2", "k3"} {
		do(t, s, Request{Model: "m", SessionKey: k}, ok200)
		clk.Advance(time.Second)
	}
	do(t, s, Request{Model: "m", SessionKey: "k1"}, ok200) // k1 is now the most recent
	do(t, s, Request{Model: "m", SessionKey: "k4"}, ok200) // evicts k2
	if n := s.Sessions(); n != 3 {
		t.Fatalf("%d sessions held, want the bound 3", n)
	}
	for k, want := range map[string]Affinity{"k1": AffinityHit, "k2": AffinityMiss, "k3": AffinityHit, "k4": AffinityHit} {
		c, err := s.Begin(Request{Model: "m", SessionKey: k}).Pick()
		if err != nil || c.Affinity != want {
			t.Errorf("%s: %+v %v, want %v", k, c, err, want)
		}
	}
	for i := range 100 {
		do(t, s, Request{Model: "m", SessionKey: fmt.Sprint("x", i)}, ok200)
		if n := s.Sessions(); n > 3 {
			t.Fatalf("%d sessions held, bound is 3", n)
		}
	}
}

func TestExpiredSessionsArePurged(t *testing.T) {
	s, clk := newTest(t, Config{}, ep("a"))
	for i := range 10 {
		do(t, s, Request{Model: "m", SessionKey: fmt.Sprint(i)}, ok200)
	}
	clk.Advance(5 * time.Minute)
	do(t, s, Request{Model: "m"}, ok200)
	if n := s.Sessions(); n != 0 {
		t.Fatalf("%d sessions held after all expired, want 0", n)
	}
}

func TestRemoveDropsSessionsAndStats(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"))
	do(t, s, Request{Model: "m", SessionKey: "s"}, ok200)
	s.Remove("a")
	if _, err := s.Begin(Request{Model: "m"}).Pick(); !errors.Is(err, ErrUnknownModel) {
		t.Fatalf("pick after removing the only endpoint: %v, want ErrUnknownModel", err)
	}
	s.Upsert(ep("a"))
	c := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200)
	if c.Affinity != AffinityMiss {
		t.Fatalf("session survived Remove: %+v", c)
	}
	if st := status(t, s, "a"); st.Requests != 1 {
		t.Fatalf("stats survived Remove: %+v", st)
	}
}

func TestUpsertKeepsState(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"))
	c := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200)
	s.SetHealth(c.EndpointID, Health{Running: 3})
	s.Upsert(Endpoint{ID: c.EndpointID, Models: []string{"m", "m2"}, Weight: 3, Capacity: 4})
	st := status(t, s, c.EndpointID)
	if st.Requests != 1 || st.Successes != 1 || st.EWMALatency != 100*time.Millisecond || st.Health.Running != 3 {
		t.Fatalf("Upsert lost state: %+v", st)
	}
	if st.Weight != 3 || st.Capacity != 4 || len(st.Models) != 2 {
		t.Fatalf("Upsert did not update: %+v", st)
	}
	if c2 := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200); c2.Affinity != AffinityHit {
		t.Fatalf("Upsert lost the session: %+v", c2)
	}
	if c3 := do(t, s, Request{Model: "m2"}, ok200); c3.EndpointID != c.EndpointID {
		t.Fatalf("new model not indexed: %+v", c3)
	}
}

func TestBreaker(t *testing.T) {
	r := Request{Model: "m"}
	s, clk := newTest(t, Config{}, ep("a"))
	for i := 1; i <= 5; i++ {
		do(t, s, r, fail500)
		want := BreakerClosed
		if i == 5 {
			want = BreakerOpen
		}
		if got := status(t, s, "a").Breaker; got != want {
			t.Fatalf("after %d consecutive failures breaker %v, want %v", i, got, want)
		}
	}
	if until := status(t, s, "a").BreakerUntil; !until.Equal(clk.Now().Add(30 * time.Second)) {
		t.Fatalf("open until %v, want now+30s", until)
	}

	// Stays open through the cooldown.
	clk.Advance(30*time.Second - time.Nanosecond)
	_, err := s.Begin(r).Pick()
	if ue := wantUnavailable(t, err); ue.RateLimited || ue.RetryAfter != time.Nanosecond {
		t.Fatalf("open breaker: %+v, want 503 with RetryAfter 1ns", ue)
	}

	// Half-open: exactly 3 concurrent probes.
	clk.Advance(time.Nanosecond)
	var probes []Choice
	var attempts []*Attempt
	for i := range 3 {
		a := s.Begin(r)
		c := mustPick(t, a)
		if !c.Probe {
			t.Fatalf("probe %d not marked as a probe", i)
		}
		probes, attempts = append(probes, c), append(attempts, a)
	}
	if got := status(t, s, "a"); got.Breaker != BreakerHalfOpen || got.Probes != 3 {
		t.Fatalf("after 3 probes: %v with %d probes", got.Breaker, got.Probes)
	}
	if _, err := s.Begin(r).Pick(); err == nil {
		t.Fatal("a 4th concurrent probe was admitted")
	}

	// A failed probe re-opens with a fresh cooldown; the others' late
	// successes do not close it.
	clk.Advance(time.Second)
	attempts[0].Report(probes[0], fail500)
	if got := status(t, s, "a"); got.Breaker != BreakerOpen || !got.BreakerUntil.Equal(clk.Now().Add(30*time.Second)) {
		t.Fatalf("after a failed probe: %v until %v, want open until now+30s", got.Breaker, got.BreakerUntil)
	}
	attempts[1].Report(probes[1], ok200)
	attempts[2].Report(probes[2], ok200)
	if got := status(t, s, "a"); got.Breaker != BreakerOpen || got.InFlight != 0 {
		t.Fatalf("stale probe successes: %v in flight %d, want open and 0", got.Breaker, got.InFlight)
	}
	clk.Advance(29 * time.Second)
	if _, err := s.Begin(r).Pick(); err == nil {
		t.Fatal("admitted during the fresh cooldown")
	}

	// Successful probes close it: two are not enough, the third is.
	clk.Advance(time.Second)
	for i := 1; i <= 3; i++ {
		c := do(t, s, r, ok200)
		want := BreakerHalfOpen
		if i == 3 {
			want = BreakerClosed
		}
		if got := status(t, s, "a").Breaker; !c.Probe || got != want {
			t.Fatalf("after successful probe %d: probe=%v breaker %v, want %v", i, c.Probe, got, want)
		}
	}
	// Closed again: the old failures are forgotten, so it takes 5 new ones.
	for range 4 {
		do(t, s, r, fail500)
	}
	if got := status(t, s, "a").Breaker; got != BreakerClosed {
		t.Fatalf("re-opened on old failures: %v", got)
	}
}

func TestFailureRateRule(t *testing.T) {
	r := Request{Model: "m"}
	t.Run("never on a first request", func(t *testing.T) {
		s, _ := newTest(t, Config{FailureThreshold: 100, FailureRateMinSamples: 2}, ep("a"))
		do(t, s, r, fail500)
		if got := status(t, s, "a").Breaker; got != BreakerClosed {
			t.Fatalf("breaker %v after one failure", got)
		}
		do(t, s, r, fail500)
		if got := status(t, s, "a").Breaker; got != BreakerOpen {
			t.Fatalf("breaker %v after two failures in two, want open", got)
		}
	})
	t.Run("half failures over ten", func(t *testing.T) {
		s, _ := newTest(t, Config{}, ep("a"))
		for i := 1; i <= 10; i++ {
			o := ok200
			if i%2 == 0 {
				o = fail500
			}
			do(t, s, r, o)
			want := BreakerClosed
			if i == 10 {
				want = BreakerOpen
			}
			if got := status(t, s, "a").Breaker; got != want {
				t.Fatalf("after %d alternating outcomes breaker %v, want %v", i, got, want)
			}
		}
	})
	t.Run("a third failures stays closed", func(t *testing.T) {
		s, _ := newTest(t, Config{}, ep("a"))
		for i := 1; i <= 60; i++ {
			o := ok200
			if i%3 == 0 {
				o = fail500
			}
			do(t, s, r, o)
		}
		if got := status(t, s, "a").Breaker; got != BreakerClosed {
			t.Fatalf("breaker %v", got)
		}
	})
}

func TestRateLimitAnd503(t *testing.T) {
	tests := []struct {
		name        string
		outcome     Outcome
		open        time.Duration
		rateLimited bool
	}{
		{"429 with Retry-After", Outcome{Status: 429, RetryAfter: 10 * time.Second}, 10 * time.Second, true},
		{"429 without Retry-After", Outcome{Status: 429}, time.Minute, true},
		{"429 with a huge Retry-After is capped", Outcome{Status: 429, RetryAfter: 24 * time.Hour}, 10 * time.Minute, true},
		{"503 opens for the cooldown", Outcome{Status: 503, RetryAfter: 5 * time.Minute}, 30 * time.Second, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, clk := newTest(t, Config{}, ep("a"), ep("b"))
			a := s.Begin(Request{Model: "m"})
			c := mustPick(t, a)
			a.Report(c, tt.outcome)
			st := status(t, s, c.EndpointID)
			if st.Breaker != BreakerOpen || !st.BreakerUntil.Equal(clk.Now().Add(tt.open)) {
				t.Fatalf("%v until %v, want open for %v", st.Breaker, st.BreakerUntil, tt.open)
			}
			// The same request moves on to the other endpoint.
			c2 := mustPick(t, a)
			if c2.EndpointID == c.EndpointID {
				t.Fatalf("retry went back to %s", c.EndpointID)
			}
			a.Report(c2, tt.outcome)
			_, err := a.Pick()
			ue := wantUnavailable(t, err)
			if ue.RateLimited != tt.rateLimited || ue.RetryAfter != tt.open {
				t.Fatalf("got %+v, want RateLimited=%v RetryAfter=%v", ue, tt.rateLimited, tt.open)
			}
			// A new request is refused too, until the breaker half-opens.
			clk.Advance(tt.open - time.Second)
			if _, err := s.Begin(Request{Model: "m"}).Pick(); err == nil {
				t.Fatal("admitted before the breaker half-opened")
			}
			clk.Advance(time.Second)
			if c := mustPick(t, s.Begin(Request{Model: "m"})); !c.Probe {
				t.Fatalf("first pick after the cooldown %+v, want a probe", c)
			}
		})
	}
}

func TestMixedUnavailableIs503(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"))
	a := s.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	a.Report(c, Outcome{Status: 429})
	c = mustPick(t, a)
	a.Report(c, Outcome{Status: 401})
	_, err := a.Pick()
	if ue := wantUnavailable(t, err); ue.RateLimited {
		t.Fatalf("%+v: one candidate only had a dead key, want 503", ue)
	}
}

func TestExclusionOrder(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"))
	a := s.Begin(Request{Model: "m"})
	c1, c2 := mustPick(t, a), mustPick(t, a)
	check := func(want Exclusion) {
		t.Helper()
		if got := a.Excluded("a"); got != want {
			t.Fatalf("Excluded = %v, want %v", got, want)
		}
	}
	check(ExclusionNone)
	s.Upsert(ep("a", "other"))
	check(ExclusionModel)
	a.Report(c1, Outcome{Status: 429})
	check(ExclusionUsedKey)
	a.Report(c2, Outcome{Status: 403})
	check(ExclusionDeadKey)
	s.Upsert(Endpoint{ID: "a", Models: []string{"other"}, Disabled: true})
	check(ExclusionDisabled)
	if got := a.Excluded("nobody"); got != ExclusionDisabled {
		t.Fatalf("unknown endpoint: %v", got)
	}
	// None of it leaks into another request.
	s.Upsert(ep("a"))
	if got := s.Begin(Request{Model: "m"}).Excluded("a"); got != ExclusionNone {
		t.Fatalf("new attempt sees %v", got)
	}
}

func TestDeadKeyIsPerRequest(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"))
	for range 10 {
		a := s.Begin(Request{Model: "m"})
		a.Report(mustPick(t, a), Outcome{Status: 401})
		if _, err := a.Pick(); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("dead key retried within the request: %v", err)
		}
	}
	if st := status(t, s, "a"); st.Breaker != BreakerClosed || st.DeadKeys != 10 {
		t.Fatalf("%+v: dead keys must not touch the breaker", st)
	}
	do(t, s, Request{Model: "m"}, ok200)
}

func TestClientFaultLeavesEndpointAlone(t *testing.T) {
	tests := []Outcome{
		{Status: 400}, {Status: 404}, {Status: 413}, {Status: 422}, {Err: context.Canceled},
	}
	for _, o := range tests {
		t.Run(fmt.Sprintf("%d %v", o.Status, o.Err), func(t *testing.T) {
			s, _ := newTest(t, Config{FailureRateMinSamples: 2, FailureThreshold: 1}, ep("a"), ep("b"))
			home := do(t, s, Request{Model: "m", SessionKey: "s"}, ok200).EndpointID
			for range 30 {
				a := s.Begin(Request{Model: "m", SessionKey: "s"})
				c := mustPick(t, a)
				if cl := a.Report(c, o); cl != ClassClientFault || cl.Retryable() {
					t.Fatalf("class %v retryable %v", cl, cl.Retryable())
				}
				if c.EndpointID != home {
					t.Fatalf("left home endpoint %s for %s", home, c.EndpointID)
				}
			}
			st := status(t, s, home)
			if st.Breaker != BreakerClosed || st.SuccessRate != 1 || st.Failures != 0 || st.ClientFaults != 30 || st.InFlight != 0 {
				t.Fatalf("client faults counted against the endpoint: %+v", st)
			}
		})
	}
}

func TestRetryAvoidsFailedEndpoint(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"))
	a := s.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	a.Report(c, fail500)
	if c2 := mustPick(t, a); c2.EndpointID == c.EndpointID {
		t.Fatalf("retry went back to the failed endpoint %s", c.EndpointID)
	}
	// With a single endpoint, a retry may go back to it.
	s2, _ := newTest(t, Config{}, ep("a"))
	a = s2.Begin(Request{Model: "m"})
	a.Report(mustPick(t, a), fail500)
	if c := mustPick(t, a); c.EndpointID != "a" {
		t.Fatalf("got %+v", c)
	}
}

func TestDrainingAndSuspect(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"))
	s.SetHealth("a", Health{Suspect: true})
	for range 20 {
		if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "b" {
			t.Fatalf("picked suspect %s while b was allowed", c.EndpointID)
		}
	}
	s.SetHealth("b", Health{Draining: true})
	for range 20 {
		if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "a" {
			t.Fatalf("picked %s, want the suspect a as the only choice", c.EndpointID)
		}
	}
	s.SetHealth("a", Health{Draining: true})
	if _, err := s.Begin(Request{Model: "m"}).Pick(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("all draining: %v", err)
	}
	if m := s.Models(); len(m) != 0 {
		t.Fatalf("Models() = %v with every endpoint draining", m)
	}
}

func TestCapacity(t *testing.T) {
	s, _ := newTest(t, Config{}, Endpoint{ID: "a", Models: []string{"m"}, Capacity: 2}, Endpoint{ID: "b", Models: []string{"m"}, Capacity: 1})
	var held []Choice
	for range 3 {
		held = append(held, mustPick(t, s.Begin(Request{Model: "m"})))
	}
	if _, err := s.Begin(Request{Model: "m"}).Pick(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("picked beyond capacity: %v (held %+v)", err, held)
	}
	if a, b := status(t, s, "a").InFlight, status(t, s, "b").InFlight; a != 2 || b != 1 {
		t.Fatalf("in flight a=%d b=%d", a, b)
	}
}

func TestNoHerding(t *testing.T) {
	for _, warm := range []bool{false, true} {
		t.Run(fmt.Sprintf("warm=%v", warm), func(t *testing.T) {
			eps := []Endpoint{ep("a"), ep("b"), ep("c"), ep("d")}
			s, _ := newTest(t, Config{}, eps...)
			if warm {
				for range 100 {
					do(t, s, Request{Model: "m"}, ok200)
				}
			}
			// 100 new sessions arrive together; none has finished yet.
			count := map[string]int{}
			for i := range 100 {
				c := mustPick(t, s.Begin(Request{Model: "m", SessionKey: fmt.Sprint("s", i)}))
				count[c.EndpointID]++
			}
			for _, e := range eps {
				if count[e.ID] != 25 {
					t.Fatalf("new sessions per endpoint %v, want 25 each", count)
				}
			}
		})
	}
}

func TestMappedSessionsCountAsLoad(t *testing.T) {
	s, _ := newTest(t, Config{ColdStartSamples: 1}, ep("a"), ep("b"), ep("c", "x"))
	place := func(id, key string) {
		t.Helper()
		other := map[string]string{"a": "b", "b": "a"}[id]
		s.Upsert(Endpoint{ID: other, Models: []string{"m"}, Disabled: true})
		do(t, s, Request{Model: "m", SessionKey: key}, ok200)
		s.Upsert(ep(other))
	}
	for i := range 9 {
		place("a", fmt.Sprint("a", i))
	}
	place("b", "b0")
	if a, b := status(t, s, "a").Sessions, status(t, s, "b").Sessions; a != 9 || b != 1 {
		t.Fatalf("sessions a=%d b=%d, want 9 and 1", a, b)
	}
	for range 5 { // five requests in flight over ten sessions: duty 0.5
		mustPick(t, s.Begin(Request{Model: "x"}))
	}
	// a's expected load is at least 4.5 (duty only grows as requests are
	// picked), b's 0.5: new sessions go to b while its in-flight count
	// stays below that, though both endpoints have nothing in flight.
	for i := range 4 {
		if c := mustPick(t, s.Begin(Request{Model: "m", SessionKey: fmt.Sprint("new", i)})); c.EndpointID != "b" {
			t.Fatalf("new session %d went to %s, want b", i, c.EndpointID)
		}
	}
}

func TestTiesBrokenRandomly(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"), ep("c"))
	count := map[string]int{}
	for range 300 {
		count[do(t, s, Request{Model: "m"}, Outcome{Status: 200}).EndpointID]++
	}
	for _, id := range []string{"a", "b", "c"} {
		if count[id] < 60 {
			t.Fatalf("choices %v: equal endpoints must share load", count)
		}
	}
}

func TestWeight(t *testing.T) {
	s, _ := newTest(t, Config{}, Endpoint{ID: "a", Models: []string{"m"}, Weight: 2}, ep("b"))
	for range 10 {
		if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "a" {
			t.Fatalf("cold start: picked %s over the heavier a", c.EndpointID)
		}
	}
}

func TestUnknownModel(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a", "m1"), Endpoint{ID: "b", Models: []string{"m2"}, Disabled: true})
	if _, err := s.Begin(Request{Model: "nope"}).Pick(); !errors.Is(err, ErrUnknownModel) {
		t.Fatalf("got %v, want ErrUnknownModel", err)
	}
	_, err := s.Begin(Request{Model: "m2"}).Pick()
	if ue := wantUnavailable(t, err); ue.RateLimited {
		t.Fatalf("disabled endpoint: %+v", ue)
	}
	if got := fmt.Sprint(s.Models()); got != "[m1]" {
		t.Fatalf("Models() = %s", got)
	}
}

func TestReportTwiceAndForeignChoice(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"))
	a := s.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	a.Report(c, ok200)
	if cl := a.Report(c, fail500); cl != ClassEndpointFailure {
		t.Fatalf("class %v", cl)
	}
	s.Begin(Request{Model: "m"}).Report(c, fail500)
	s.Begin(Request{Model: "m"}).Report(Choice{EndpointID: "a"}, fail500)
	if st := status(t, s, "a"); st.InFlight != 0 || st.Failures != 0 || st.Successes != 1 {
		t.Fatalf("%+v", st)
	}
}

func TestReportAfterRemove(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"))
	a := s.Begin(Request{Model: "m", SessionKey: "s"})
	c := mustPick(t, a)
	s.Remove("a")
	s.Upsert(ep("a"))
	a.Report(c, ok200)
	if st := status(t, s, "a"); st.InFlight != 0 || st.Successes != 0 {
		t.Fatalf("report for the removed endpoint landed on its successor: %+v", st)
	}
	if s.Sessions() != 0 {
		t.Fatal("session mapped to a removed endpoint")
	}
}

func TestClassify(t *testing.T) {
	tests := []struct {
		status    int
		err       error
		want      Class
		retryable bool
	}{
		{200, nil, ClassSuccess, false},
		{204, nil, ClassSuccess, false},
		{401, nil, ClassDeadKey, true},
		{403, nil, ClassDeadKey, true},
		{429, nil, ClassRateLimited, true},
		{400, nil, ClassClientFault, false},
		{404, nil, ClassClientFault, false},
		{413, nil, ClassClientFault, false},
		{422, nil, ClassClientFault, false},
		{500, nil, ClassEndpointFailure, true},
		{502, nil, ClassEndpointFailure, true},
		{503, nil, ClassEndpointFailure, true},
		{504, nil, ClassEndpointFailure, true},
		{0, nil, ClassEndpointFailure, true},
		{0, errors.New("connection reset"), ClassEndpointFailure, true},
		{0, context.DeadlineExceeded, ClassEndpointFailure, true},
		{200, fmt.Errorf("stream: %w", errors.New("eof")), ClassEndpointFailure, true},
		{0, fmt.Errorf("client gone: %w", context.Canceled), ClassClientFault, false},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%d/%v", tt.status, tt.err), func(t *testing.T) {
			got := Classify(tt.status, tt.err)
			if got != tt.want || got.Retryable() != tt.retryable {
				t.Fatalf("Classify = %v (retryable %v), want %v (%v)", got, got.Retryable(), tt.want, tt.retryable)
			}
		})
	}
}

func TestStrings(t *testing.T) {
	for _, tt := range []struct{ got, want string }{
		{AffinityHit.String(), "hit"}, {AffinityMiss.String(), "miss"}, {AffinityNone.String(), "none"},
		{BreakerHalfOpen.String(), "half-open"}, {ClassDeadKey.String(), "dead-key"},
		{ExclusionUsedKey.String(), "used-key"}, {PolicyConsistentHash.String(), "consistent-hash"},
	} {
		if tt.got != tt.want {
			t.Errorf("got %q, want %q", tt.got, tt.want)
		}
	}
}
