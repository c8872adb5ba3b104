package scheduler

import (
	"fmt"
	"strconv"
	"testing"
	"time"
)

func tierEP(id string, priority, capacity int) Endpoint {
	return Endpoint{ID: id, Models: []string{"m"}, Priority: priority, Capacity: capacity}
}

func TestTierLowestFirst(t *testing.T) {
	// The provider has a far higher weight: without tiers it would win.
	cloud := tierEP("cloud", 1, 0)
	cloud.Weight = 100
	s, _ := newTest(t, Config{}, tierEP("home1", 0, 0), tierEP("home2", 0, 0), cloud)
	for i := range 50 {
		if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID == "cloud" {
			t.Fatalf("request %d went to the overflow tier while home had room", i)
		}
	}
}

func TestTierOverflowWhenSaturated(t *testing.T) {
	s, _ := newTest(t, Config{}, tierEP("home", 0, 2), tierEP("cloud", 1, 0))
	a1, a2, a3 := s.Begin(Request{Model: "m"}), s.Begin(Request{Model: "m"}), s.Begin(Request{Model: "m"})
	c1, c2 := mustPick(t, a1), mustPick(t, a2)
	if c1.EndpointID != "home" || c2.EndpointID != "home" {
		t.Fatalf("first two went to %s, %s; want home", c1.EndpointID, c2.EndpointID)
	}
	c3 := mustPick(t, a3)
	if c3.EndpointID != "cloud" {
		t.Fatalf("with home full, got %s; want cloud", c3.EndpointID)
	}
	a1.Report(c1, ok200)
	if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "home" {
		t.Fatalf("with a home slot free again, got %s", c.EndpointID)
	}
	a2.Report(c2, ok200)
	a3.Report(c3, ok200)
}

func TestTierEngineSaturatedOverflows(t *testing.T) {
	s, _ := newTest(t, Config{}, tierEP("home", 0, 0), tierEP("cloud", 1, 0))
	s.SetHealth("home", Health{Waiting: 4, KVCacheUsage: 1})
	if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "cloud" {
		t.Fatalf("home engine saturated: got %s, want cloud", c.EndpointID)
	}
	s.SetHealth("home", Health{})
	if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "home" {
		t.Fatalf("home recovered: got %s, want home", c.EndpointID)
	}
}

func TestTierRetryOverflows(t *testing.T) {
	s, _ := newTest(t, Config{}, tierEP("home", 0, 0), tierEP("cloud", 1, 0))
	a := s.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	if c.EndpointID != "home" {
		t.Fatalf("first pick %s", c.EndpointID)
	}
	a.Report(c, fail500)
	c = mustPick(t, a)
	if c.EndpointID != "cloud" {
		t.Fatalf("retry after home failed: %s, want cloud", c.EndpointID)
	}
	a.Report(c, fail500)
	// Both failed in this request: the lowest tier is retried.
	if c = mustPick(t, a); c.EndpointID != "home" {
		t.Fatalf("third try: %s, want home", c.EndpointID)
	}
	a.Report(c, ok200)
}

func TestTierSessionsReturnHome(t *testing.T) {
	s, clk := newTest(t, Config{}, tierEP("home", 0, 0), tierEP("cloud", 1, 0))
	r := Request{Model: "m", SessionKey: "chat"}
	s.Upsert(Endpoint{ID: "home", Models: []string{"m"}, Disabled: true})
	if c := do(t, s, r, ok200); c.EndpointID != "cloud" {
		t.Fatalf("home disabled: %s", c.EndpointID)
	}
	if c := do(t, s, r, ok200); c.EndpointID != "cloud" || c.Affinity != AffinityHit {
		t.Fatalf("overflowed session: %s %v, want cloud hit", c.EndpointID, c.Affinity)
	}
	s.Upsert(tierEP("home", 0, 0))
	clk.Advance(time.Second)
	c := do(t, s, r, ok200)
	if c.EndpointID != "home" || c.Affinity != AffinityMiss {
		t.Fatalf("home back: %s %v, want home miss", c.EndpointID, c.Affinity)
	}
	if c := do(t, s, r, ok200); c.EndpointID != "home" || c.Affinity != AffinityHit {
		t.Fatalf("next turn: %s %v, want home hit", c.EndpointID, c.Affinity)
	}
}

func TestTierAffinityWithinTier(t *testing.T) {
	s, _ := newTest(t, Config{}, tierEP("a", 0, 0), tierEP("b", 0, 0), tierEP("cloud", 1, 0))
	r := Request{Model: "m", SessionKey: "s1"}
	first := do(t, s, r, ok200).EndpointID
	for range 10 {
		if c := do(t, s, r, ok200); c.EndpointID != first || c.Affinity != AffinityHit {
			t.Fatalf("got %s %v, want %s hit", c.EndpointID, c.Affinity, first)
		}
	}
	if got := status(t, s, "cloud").Requests; got != 0 {
		t.Fatalf("cloud got %d requests", got)
	}
}

func TestTierPriorityChange(t *testing.T) {
	s, _ := newTest(t, Config{}, tierEP("a", 0, 0), tierEP("b", 1, 0))
	if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "a" {
		t.Fatalf("got %s", c.EndpointID)
	}
	s.Upsert(tierEP("a", 2, 0))
	if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "b" {
		t.Fatalf("after a moved to tier 2: got %s", c.EndpointID)
	}
	if p := status(t, s, "a").Priority; p != 2 {
		t.Fatalf("status priority %d", p)
	}
}

func keyed(id string, keys ...string) Endpoint {
	return Endpoint{ID: id, Models: []string{"m"}, Keys: keys}
}

func TestKeysDeadThenUsedThenServed(t *testing.T) {
	s, clk := newTest(t, Config{}, keyed("cloud", "k1", "k2", "k3"))
	a := s.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	if c.EndpointID != "cloud" || c.Key != "k1" {
		t.Fatalf("first pick %s/%s", c.EndpointID, c.Key)
	}
	if cl := a.Report(c, Outcome{Status: 401}); cl != ClassDeadKey {
		t.Fatalf("class %v", cl)
	}
	if x := a.Excluded("cloud"); x != ExclusionNone {
		t.Fatalf("one dead key excluded the endpoint: %v", x)
	}
	c = mustPick(t, a)
	if c.Key != "k2" {
		t.Fatalf("second pick key %s, want k2", c.Key)
	}
	a.Report(c, Outcome{Status: 429, RetryAfter: 30 * time.Second})
	c = mustPick(t, a)
	if c.Key != "k3" {
		t.Fatalf("third pick key %s, want k3", c.Key)
	}
	a.Report(c, ok200)
	st := status(t, s, "cloud")
	if st.Breaker != BreakerClosed {
		t.Fatalf("endpoint breaker %v after a key's 429", st.Breaker)
	}
	if st.Keys[1].Breaker != BreakerOpen || st.Keys[0].Breaker != BreakerClosed {
		t.Fatalf("key states %+v", st.Keys)
	}
	if want := clk.Now().Add(30 * time.Second); !st.Keys[1].BreakerUntil.Equal(want) {
		t.Fatalf("k2 reopens at %v, want %v", st.Keys[1].BreakerUntil, want)
	}

	// A later request tries the refused key again and skips the limited one.
	a = s.Begin(Request{Model: "m"})
	if c = mustPick(t, a); c.Key != "k1" {
		t.Fatalf("next request starts with %s, want k1", c.Key)
	}
	a.Report(c, Outcome{Status: 401})
	if c = mustPick(t, a); c.Key != "k3" {
		t.Fatalf("k2 is limited: got %s, want k3", c.Key)
	}
	a.Report(c, ok200)

	// After its Retry-After, k2 takes probes again.
	clk.Advance(30 * time.Second)
	a = s.Begin(Request{Model: "m"})
	a.Report(mustPick(t, a), Outcome{Status: 403})
	c = mustPick(t, a)
	if c.Key != "k2" {
		t.Fatalf("after Retry-After: got %s, want k2", c.Key)
	}
	a.Report(c, ok200)
	if st := status(t, s, "cloud"); st.Keys[1].Breaker != BreakerHalfOpen {
		t.Fatalf("k2 after one probe: %v", st.Keys[1].Breaker)
	}
}

func TestKeysExclusionOrder(t *testing.T) {
	s, _ := newTest(t, Config{}, keyed("cloud", "k1", "k2"))
	a := s.Begin(Request{Model: "m"})
	a.Report(mustPick(t, a), Outcome{Status: 401})
	a.Report(mustPick(t, a), Outcome{Status: 401})
	if x := a.Excluded("cloud"); x != ExclusionDeadKey {
		t.Fatalf("every key dead: %v", x)
	}
	_, err := a.Pick()
	if ue := wantUnavailable(t, err); ue.RateLimited {
		t.Fatalf("dead keys reported as rate limited")
	}

	a = s.Begin(Request{Model: "m"})
	a.Report(mustPick(t, a), Outcome{Status: 401})
	a.Report(mustPick(t, a), Outcome{Status: 429, RetryAfter: 5 * time.Second})
	if x := a.Excluded("cloud"); x != ExclusionUsedKey {
		t.Fatalf("one dead, one used: %v", x)
	}

	s.Upsert(Endpoint{ID: "cloud", Models: []string{"m"}, Keys: []string{"k1", "k2"}, Disabled: true})
	if x := a.Excluded("cloud"); x != ExclusionDisabled {
		t.Fatalf("disabled first: %v", x)
	}
}

func TestKeysAllRateLimited(t *testing.T) {
	s, _ := newTest(t, Config{}, keyed("cloud", "k1", "k2"))
	for range 2 {
		a := s.Begin(Request{Model: "m"})
		a.Report(mustPick(t, a), Outcome{Status: 429, RetryAfter: 20 * time.Second})
	}
	a := s.Begin(Request{Model: "m"})
	_, err := a.Pick()
	ue := wantUnavailable(t, err)
	if !ue.RateLimited || ue.RetryAfter != 20*time.Second {
		t.Fatalf("got %+v, want rate limited with 20s", ue)
	}
}

func TestKeysKeptAcrossUpsert(t *testing.T) {
	s, _ := newTest(t, Config{}, keyed("cloud", "k1", "k2"))
	a := s.Begin(Request{Model: "m"})
	a.Report(mustPick(t, a), Outcome{Status: 429, RetryAfter: time.Minute})
	s.Upsert(keyed("cloud", "k0", "k1", "k2"))
	st := status(t, s, "cloud")
	if len(st.Keys) != 3 || st.Keys[1].ID != "k1" || st.Keys[1].Breaker != BreakerOpen || st.Keys[0].Breaker != BreakerClosed {
		t.Fatalf("keys after reload: %+v", st.Keys)
	}
}

func TestKeysEndpointFailureCountsAgainstEndpoint(t *testing.T) {
	s, _ := newTest(t, Config{}, keyed("cloud", "k1", "k2"), ep("other"))
	s.Upsert(Endpoint{ID: "other", Models: []string{"m"}, Priority: 1})
	a := s.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	a.Report(c, fail500)
	// The endpoint failed, whatever the key: the retry goes to the other
	// endpoint, not to the next key.
	if c = mustPick(t, a); c.EndpointID != "other" {
		t.Fatalf("retry after a 5xx: %s/%s, want other", c.EndpointID, c.Key)
	}
	a.Report(c, ok200)
	if st := status(t, s, "cloud"); st.Failures != 1 || st.Keys[0].Breaker != BreakerClosed {
		t.Fatalf("cloud after 5xx: %+v", st)
	}
}

// BenchmarkPickTiers measures a scored pick among 10 agents when the table
// also holds two keyed providers in an overflow tier ("tiers"), next to the
// same 10 agents alone ("flat"), and a pick that overflows because every
// agent is disabled ("overflow").
func BenchmarkPickTiers(b *testing.B) {
	ok := Outcome{Status: 200, Latency: 80 * time.Millisecond}
	for _, mode := range []string{"flat", "tiers", "overflow"} {
		b.Run(mode, func(b *testing.B) {
			s := benchScheduler(b, 10)
			if mode != "flat" {
				for i := range 2 {
					s.Upsert(Endpoint{ID: fmt.Sprintf("provider-%d", i), Models: []string{"m"}, Priority: 1, Keys: []string{"k1", "k2", "k3"}, Capacity: 64})
				}
			}
			if mode == "overflow" {
				for i := range 10 {
					s.Upsert(Endpoint{ID: "agent-" + strconv.Itoa(i), Models: []string{"m", "other"}, Capacity: 64, Disabled: true})
				}
			}
			a := s.Begin(Request{Model: "m"})
			measure(b, func() {
				c, err := a.Pick()
				if err != nil {
					b.Fatal(err)
				}
				a.Report(c, ok)
			})
		})
	}
}

// An endpoint to avoid (failed in this request) loses to one in a higher
// tier whose engine is saturated: avoidance comes before the tier order.
func TestTierAvoidedBeforeSaturated(t *testing.T) {
	s, _ := newTest(t, Config{}, tierEP("home", 0, 0), tierEP("cloud", 1, 0))
	s.SetHealth("cloud", Health{Waiting: 3, KVCacheUsage: 1})
	a := s.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	if c.EndpointID != "home" {
		t.Fatalf("first pick %s", c.EndpointID)
	}
	a.Report(c, fail500)
	if c = mustPick(t, a); c.EndpointID != "cloud" {
		t.Fatalf("retry: %s, want the saturated cloud over the failed home", c.EndpointID)
	}
	a.Report(c, ok200)
}

// TestTierWaitForRoom: a request that waits for room (Request.Wait) is told
// its tier is full instead of overflowing, and overflows still when its
// tier cannot take it for any other reason.
func TestTierWaitForRoom(t *testing.T) {
	s, _ := newTest(t, Config{}, tierEP("home", 0, 1), tierEP("cloud", 1, 0))
	a1 := s.Begin(Request{Model: "m", Wait: true})
	c1 := mustPick(t, a1)
	if c1.EndpointID != "home" {
		t.Fatalf("first went to %s", c1.EndpointID)
	}
	_, err := s.Begin(Request{Model: "m", Wait: true}).Pick()
	if ue := wantUnavailable(t, err); !ue.Full || ue.RateLimited {
		t.Fatalf("home full: %+v, want Full", ue)
	}
	// Without Wait the full tier overflows, as before.
	if c := do(t, s, Request{Model: "m"}, ok200); c.EndpointID != "cloud" {
		t.Fatalf("without Wait: %s, want cloud", c.EndpointID)
	}
	// A slot frees: the waiting request gets home.
	a1.Report(c1, ok200)
	if c := do(t, s, Request{Model: "m", Wait: true}, ok200); c.EndpointID != "home" {
		t.Fatalf("after the slot freed: %s, want home", c.EndpointID)
	}
	// Home draining: nothing to wait for, the request overflows.
	s.SetHealth("home", Health{Draining: true})
	if c := do(t, s, Request{Model: "m", Wait: true}, ok200); c.EndpointID != "cloud" {
		t.Fatalf("home draining: %s, want cloud", c.EndpointID)
	}
	// A single full tier: Full, so the caller queues.
	s2, _ := newTest(t, Config{}, tierEP("home", 0, 1))
	a := s2.Begin(Request{Model: "m"})
	c := mustPick(t, a)
	_, err = s2.Begin(Request{Model: "m"}).Pick()
	if ue := wantUnavailable(t, err); !ue.Full {
		t.Fatalf("single tier full: %+v, want Full", ue)
	}
	a.Report(c, ok200)
	// An open breaker is not Full: nothing frees by waiting for a slot.
	for range 5 {
		do(t, s2, Request{Model: "m"}, Outcome{Status: 500})
	}
	_, err = s2.Begin(Request{Model: "m", Wait: true}).Pick()
	if ue := wantUnavailable(t, err); ue.Full {
		t.Fatalf("breaker open: %+v, want not Full", ue)
	}
}
