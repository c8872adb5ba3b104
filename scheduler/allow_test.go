package scheduler

import "testing"

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
