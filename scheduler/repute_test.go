package scheduler

import "testing"

// inFlightShare picks n requests for model m without reporting them (so
// load builds up) and counts the picks per endpoint.
func inFlightShare(t *testing.T, s *Scheduler, r Request, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for range n {
		got[mustPick(t, s.Begin(r)).EndpointID]++
	}
	return got
}

func TestModelWeightLowersShare(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy Policy
		prefix []uint64
		least  int // b's fewest picks at a quarter of the weight
	}{
		{name: "sticky", policy: PolicySticky, least: 1},
		// The prefix cost multiplies the whole expected wait by 4: at 30
		// requests in flight b's empty queue does not make up for it.
		{name: "prefix", policy: PolicySticky, prefix: []uint64{1, 2, 3}, least: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Request{Model: "m", Prefix: tc.prefix}
			// Past the cold start (where weight alone decides), with equal
			// records.
			warm := func() *Scheduler {
				s, _ := newTest(t, Config{Policy: tc.policy}, ep("a"), ep("b"), ep("c"))
				for range 3 * s.cfg.ColdStartSamples {
					do(t, s, Request{Model: "m"}, ok200)
				}
				return s
			}
			s := warm()
			full := inFlightShare(t, s, r, 30)
			s2 := warm()
			s2.SetModelWeight("b", "m", 0.25)
			low := inFlightShare(t, s2, r, 30)
			t.Logf("30 requests in flight: full weight %v, b at 0.25 %v", full, low)
			if full["b"] < 9 || full["b"] > 11 {
				t.Errorf("full weight: b took %d of 30, want about 10", full["b"])
			}
			// Scores weigh load against weight: b gets a request once a and
			// c hold about four times its load.
			if low["b"] < tc.least || low["b"] > 4 {
				t.Errorf("b at a quarter of the weight took %d of 30, want %d to 4", low["b"], tc.least)
			}
			if s2.ModelWeight("b", "m") != 0.25 || s2.ModelWeight("b", "other") != 1 || s2.ModelWeight("a", "m") != 1 {
				t.Error("ModelWeight does not read back")
			}
		})
	}
}

func TestModelWeightQuarantine(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a", "m"), ep("b", "m", "m2"))
	s.SetModelWeight("b", "m", 0)
	for range 50 {
		if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "a" {
			t.Fatalf("quarantined b picked for m")
		}
	}
	// Its other model is untouched.
	if c := do(t, s, Request{Model: "m2"}, ok200); c.EndpointID != "b" {
		t.Errorf("m2 went to %s", c.EndpointID)
	}
	if x := s.Begin(Request{Model: "m"}).Excluded("b"); x != ExclusionQuarantined || x.String() != "quarantined" {
		t.Errorf("exclusion %v", x)
	}
	// Not a last resort: with a gone, m is unavailable.
	s.Remove("a")
	if _, err := s.Begin(Request{Model: "m"}).Pick(); err == nil {
		t.Error("a quarantined endpoint served as the last resort")
	}
	// The quarantine outlives a leave and a join.
	s.Remove("b")
	s.Upsert(ep("b", "m", "m2"))
	if _, err := s.Begin(Request{Model: "m"}).Pick(); err == nil {
		t.Error("quarantine lost when b joined again")
	}
	s.SetModelWeight("b", "m", 1)
	if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "b" {
		t.Errorf("released b not picked: %s", c.EndpointID)
	}
	if len(s.repute) != 0 {
		t.Errorf("released factors kept: %v", s.repute)
	}
}

func TestModelWeightMovesSessions(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"))
	first := do(t, s, Request{Model: "m", SessionKey: "s1"}, ok200).EndpointID
	s.SetModelWeight(first, "m", 0)
	c := do(t, s, Request{Model: "m", SessionKey: "s1"}, ok200)
	if c.EndpointID == first {
		t.Fatalf("session stayed on quarantined %s", first)
	}
}
