package scheduler

import (
	"math/rand/v2"
	"testing"
)

// TestAllowIsHard checks that Request.Allow confines every policy to the
// allowed endpoints, overriding a session mapped elsewhere, and that a
// request nobody may serve gets a 503, not another endpoint.
func TestAllowIsHard(t *testing.T) {
	for _, p := range []Policy{PolicySticky, PolicyRoundRobin, PolicyRandom, PolicyLeastLoaded, PolicyConsistentHash, PolicyPrefixHash, PolicyDualMap, PolicySGLang} {
		t.Run(p.String(), func(t *testing.T) {
			s, _ := newTest(t, Config{Policy: p}, ep("a"), ep("b"), ep("c"))
			do(t, s, Request{Model: "m", SessionKey: "k"}, Outcome{Status: 200})
			only := func(id string) func(string) bool { return func(e string) bool { return e == id } }
			for _, id := range []string{"a", "b", "c", "b"} {
				for i := 0; i < 5; i++ {
					c := do(t, s, Request{Model: "m", SessionKey: "k", Prefix: []uint64{1, 2, 3}, Allow: only(id)}, Outcome{Status: 200})
					if c.EndpointID != id {
						t.Fatalf("Allow only %s: picked %s", id, c.EndpointID)
					}
				}
			}
			a := s.Begin(Request{Model: "m", Allow: only("gone")})
			if got := a.Excluded("a"); got != ExclusionAllow {
				t.Fatalf("Excluded = %v, want %v", got, ExclusionAllow)
			}
			_, err := a.Pick()
			if ue := wantUnavailable(t, err); ue.RateLimited {
				t.Fatalf("%+v: want a plain 503", ue)
			}
		})
	}
}

// TestAdmitsQuickAgreesWithAdmit checks the pick loops' fast path against
// admit over random endpoint states: whenever it admits, admit admits too,
// with avoid set exactly for suspects.
func TestAdmitsQuickAgreesWithAdmit(t *testing.T) {
	s, _ := newTest(t, Config{}, ep("a"), ep("b"))
	rng := rand.New(rand.NewPCG(1, 2))
	now := s.now()
	quick := 0
	for range 2000 {
		a := s.Begin(Request{Model: "m"})
		e := s.endpoints["a"]
		e.disabled = rng.IntN(4) == 0
		e.health.Draining = rng.IntN(4) == 0
		e.health.Suspect = rng.IntN(2) == 0
		e.capacity, e.affCap, e.inFlight = rng.IntN(3), rng.IntN(3), rng.IntN(3)
		e.br = BreakerState(rng.IntN(3))
		e.openUntil = now + int64(rng.IntN(3)-1)
		if rng.IntN(4) == 0 {
			a.mapped = e
		}
		if !a.admitsQuick(e, a.clean()) {
			continue
		}
		quick++
		if ok, avoid := a.admit(e, now, false); !ok || avoid != e.health.Suspect {
			t.Fatalf("fast path admits %+v, admit says %v %v", e, ok, avoid)
		}
	}
	if quick == 0 {
		t.Fatal("the fast path admitted nothing")
	}
}
