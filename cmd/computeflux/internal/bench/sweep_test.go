package bench

import (
	"context"
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/scheduler"
)

// The search's runs and answer for a policy that holds the SLO up to a
// threshold speed (or as holds says).
func TestRateSearch(t *testing.T) {
	upTo := func(x float64) func(float64) bool { return func(s float64) bool { return s <= x } }
	r := func(v float64) float64 { return math.Round(v*1000) / 1000 }
	for _, tc := range []struct {
		name               string
		start, max         float64
		bisect             int
		holds              func(float64) bool
		tried              []float64
		wantHeld, wantFail float64
	}{
		{name: "doubles then bisects", start: 1, max: 64, bisect: 3, holds: upTo(5),
			// 1, 2, 4 hold, 8 misses; then sqrt(4·8)=5.657 misses,
			// sqrt(4·5.657)=4.757 holds, sqrt(4.757·5.657)=5.187 misses.
			tried: []float64{1, 2, 4, 8, 5.657, 4.757, 5.187}, wantHeld: 4.757, wantFail: 5.187},
		{name: "halves when the start misses", start: 1, max: 64, bisect: 2, holds: upTo(0.3),
			// 1, 0.5 miss, 0.25 holds; sqrt(0.25·0.5)=0.354 misses,
			// sqrt(0.25·0.354)=0.297 holds.
			tried: []float64{1, 0.5, 0.25, 0.354, 0.297}, wantHeld: 0.297, wantFail: 0.354},
		{name: "stops at max", start: 1, max: 10, bisect: 3, holds: upTo(100),
			tried: []float64{1, 2, 4, 8, 10}, wantHeld: 10},
		{name: "stops at start/16", start: 1, max: 64, bisect: 3, holds: upTo(0.01),
			tried: []float64{1, 0.5, 0.25, 0.125, 0.063}, wantFail: 0.063},
		{name: "no bisection", start: 2, max: 64, bisect: -1, holds: upTo(5),
			tried: []float64{2, 4, 8}, wantHeld: 4, wantFail: 8},
		{name: "a narrow bracket ends early", start: 1, max: 64, bisect: 10, holds: upTo(1.01),
			// 1 holds, 2 misses, then 1.414, 1.189, 1.091, 1.044 miss; 1.044/1 < 1.05.
			tried: []float64{1, 2, 1.414, 1.189, 1.091, 1.044}, wantHeld: 1, wantFail: 1.044},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := SweepConfig{Start: tc.start, Max: tc.max, Bisect: tc.bisect}
			sc.populate()
			s := newRateSearch(sc.Start, sc.Max, sc.Bisect)
			var tried []float64
			for len(tried) < 50 {
				speed, ok := s.next()
				if !ok {
					break
				}
				tried = append(tried, r(speed))
				s.record(speed, tc.holds(speed))
			}
			if !slices.Equal(tried, tc.tried) {
				t.Errorf("tried %v, want %v", tried, tc.tried)
			}
			held, failed := s.bracket()
			if r(held) != tc.wantHeld || r(failed) != tc.wantFail {
				t.Errorf("bracket %v..%v, want %v..%v", held, failed, tc.wantHeld, tc.wantFail)
			}
		})
	}
	// A hold above a miss (noise near the edge) is not believed: 8 held,
	// but 4 missed.
	s := newRateSearch(1, 64, 0)
	for _, p := range []ratePoint{{1, true}, {8, true}, {4, false}} {
		s.record(p.speed, p.held)
	}
	if h, f := s.bracket(); h != 1 || f != 4 {
		t.Fatalf("bracket %v..%v, want 1..4", h, f)
	}
}

// A run's point: the 90th percentile counts failures as misses, goodput
// counts only requests within the SLO, and the prefill wait is what is
// left of the time to first token after the relay's queue and the
// request's own prefill.
func TestSweepPoint(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	ok := func(ttft, done int, tokens int) record {
		return record{ttft: ms(ttft), first: 0, done: ms(done), completion: tokens, engine: 0}
	}
	fail := record{failed: true, engine: -1}
	ten := func(fill record, last ...record) []record {
		rs := make([]record, 0, 10)
		for range 10 - len(last) {
			rs = append(rs, fill)
		}
		return append(rs, last...)
	}
	for _, tc := range []struct {
		name     string
		recs     []record
		p90      float64
		held     bool
		goodReqs float64 // per second; every run spans 10 s
		goodToks float64
	}{
		{name: "all fast", recs: ten(ok(500, 10_000, 100)), p90: 500, held: true, goodReqs: 1, goodToks: 100},
		{name: "one slow in ten", recs: ten(ok(500, 10_000, 100), ok(5000, 10_000, 100)), p90: 500, held: true, goodReqs: 0.9, goodToks: 90},
		{name: "two slow in ten", recs: ten(ok(500, 10_000, 100), ok(5000, 10_000, 100), ok(3000, 10_000, 100)), p90: 3000, held: false, goodReqs: 0.8, goodToks: 80},
		{name: "a failure misses", recs: ten(ok(500, 10_000, 100), fail, fail), p90: -1, held: false, goodReqs: 0.8, goodToks: 80},
		{name: "at the bound holds", recs: ten(ok(2000, 10_000, 100)), p90: 2000, held: true, goodReqs: 1, goodToks: 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pt := sweepPoint(Result{}, tc.recs, 2*time.Second, 25000)
			if pt.TTFT.P90 != tc.p90 || pt.Held != tc.held {
				t.Errorf("p90 %v held %v, want %v %v", pt.TTFT.P90, pt.Held, tc.p90, tc.held)
			}
			if math.Abs(pt.GoodReqPerSec-tc.goodReqs) > 1e-9 || math.Abs(pt.GoodTokPerSec-tc.goodToks) > 1e-9 {
				t.Errorf("goodput %v req/s %v tok/s, want %v %v", pt.GoodReqPerSec, pt.GoodTokPerSec, tc.goodReqs, tc.goodToks)
			}
		})
	}
	// 25,000 prompt tokens, 5,000 of them cached, at 25,000 a second: 800
	// ms of its own prefill; it waited 300 ms at the relay and its first
	// token came at 1,500 ms, so 400 ms behind other prompts.
	rc := record{ttft: 1500 * time.Millisecond, wait: 300 * time.Millisecond, waited: true, prompt: 25000, cached: 5000, done: time.Second}
	if pt := sweepPoint(Result{}, []record{rc}, 2*time.Second, 25000); pt.PrefillWaitP90 != 400 || pt.QueueWaitP90 != 300 {
		t.Fatalf("prefill wait %v ms, relay wait %v ms; want 400 and 300", pt.PrefillWaitP90, pt.QueueWaitP90)
	}
}

// A whole sweep over a short trace: every run is reported, each policy's
// answer is a speed that held with the next one tried above it missing,
// and the search stays within its bound of runs.
func TestRunSweep(t *testing.T) {
	cfg := Config{Mode: ModeSim, TracePath: "testdata/mooncake_head.jsonl", Engines: 2,
		Policies: []scheduler.Policy{scheduler.PolicySticky, scheduler.PolicyRoundRobin},
		Sweep:    SweepConfig{SLO: 400 * time.Millisecond, Start: 1, Max: 64, Bisect: 2}}
	rp, err := RunSweep(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The two policies, then round-robin sent at once as the baseline.
	if len(rp.Policies) != 3 || rp.Policies[2].Policy != AtOnceLabel || rp.Requests != 9 ||
		rp.DispatchLimit != simengine.DefaultMaxRunning || rp.SLO != 400 {
		t.Fatalf("report %+v", rp)
	}
	for _, r := range rp.Policies {
		// Doubling from 1 to 64 is 7 runs, halving to 1/16 is 5, then 2
		// bisections.
		if n := len(r.Points); n == 0 || n > 9 {
			t.Errorf("%s: %d runs", r.Policy, n)
		}
		if r.MaxSpeed == 0 || r.FailedSpeed == 0 || r.MaxSpeed >= r.FailedSpeed {
			t.Errorf("%s: held %v, missed %v: the SLO should break inside the range", r.Policy, r.MaxSpeed, r.FailedSpeed)
		}
		for i, pt := range r.Points {
			if i > 0 && pt.Speed <= r.Points[i-1].Speed {
				t.Errorf("%s: points not by speed", r.Policy)
			}
			if pt.Held != (pt.TTFT.P90 >= 0 && pt.TTFT.P90 <= 400) || pt.Requests != 9 {
				t.Errorf("%s at %v: %+v", r.Policy, pt.Speed, pt)
			}
			if pt.Speed == r.MaxSpeed && (!pt.Held || pt.Offered != r.MaxOffered) {
				t.Errorf("%s: its highest speed %v: %+v", r.Policy, r.MaxSpeed, pt)
			}
			if pt.Speed == r.FailedSpeed && pt.Held {
				t.Errorf("%s: its missed speed %v held", r.Policy, pt.Speed)
			}
			if pt.Speed > r.MaxSpeed && pt.Speed < r.FailedSpeed {
				t.Errorf("%s: %v lies inside the answer's bracket", r.Policy, pt.Speed)
			}
		}
	}
	var b strings.Builder
	if err := rp.WriteTable(&b); err != nil || !strings.Contains(b.String(), "round-robin") || !strings.Contains(b.String(), "1.00x") {
		t.Fatalf("table: %v\n%s", err, b.String())
	}
	b.Reset()
	var back SweepReport
	if err := rp.WriteJSON(&b); err != nil || json.Unmarshal([]byte(b.String()), &back) != nil || len(back.Policies) != 3 {
		t.Fatalf("json: %v\n%s", err, b.String())
	}

	for name, c := range map[string]Config{
		"live":           {Mode: ModeLive, TracePath: cfg.TracePath},
		"no trace":       {Mode: ModeSim},
		"both key modes": {Mode: ModeSim, TracePath: cfg.TracePath, Keys: KeysBoth},
		"bad speeds":     {Mode: ModeSim, TracePath: cfg.TracePath, Sweep: SweepConfig{Start: 4, Max: 2}},
	} {
		if _, err := RunSweep(context.Background(), c); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
