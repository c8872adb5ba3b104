package scheduler

import "testing"

// prefillEP is an endpoint of 64 slots with a prefill limit of limit blocks.
func prefillEP(id string, limit int) Endpoint {
	e := ep(id)
	e.Capacity, e.PrefillLimit = 64, limit
	return e
}

// An endpoint with a PrefillLimit takes streamed requests until the
// uncached blocks of those not yet started reach it, then is full (a
// waiting request queues) until one starts; a prompt longer than the limit
// goes to an endpoint with nothing queued, and non-streamed requests do not
// count.
func TestPrefillLimitHoldsWorkAtTheRelay(t *testing.T) {
	const limit = 100
	s, _ := newTest(t, Config{ColdStartSamples: 1}, prefillEP("a", limit), prefillEP("b", limit))
	base := uint64(0)
	streamed := func(blocks int) Request {
		base += 1_000_000
		return Request{Model: "m", Prefix: seqChain(base, blocks), Streamed: true, Wait: true}
	}

	// An idle endpoint takes a prompt longer than the limit.
	long := s.Begin(streamed(3 * limit))
	cl := mustPick(t, long)
	// The other takes prompts up to the limit, then is full.
	var open []struct {
		a *Attempt
		c Choice
	}
	for range 2 {
		a := s.Begin(streamed(limit / 2))
		c := mustPick(t, a)
		if c.EndpointID == cl.EndpointID {
			t.Fatalf("a short prompt went to %s, behind %d blocks of prefill, with the other endpoint idle", c.EndpointID, 3*limit)
		}
		open = append(open, struct {
			a *Attempt
			c Choice
		}{a, c})
	}
	full := s.Begin(streamed(1))
	_, err := full.Pick()
	if ue := wantUnavailable(t, err); !ue.Full {
		t.Fatalf("both endpoints hold their limit of prefill: got %v, want a full error to wait on", err)
	}
	// Once a prompt starts, its blocks leave the queued prefill.
	open[0].a.Started(open[0].c)
	c := mustPick(t, s.Begin(streamed(1)))
	if c.EndpointID != open[0].c.EndpointID {
		t.Fatalf("a prompt started on %s, freeing its prefill room; the next went to %s", open[0].c.EndpointID, c.EndpointID)
	}
	// The long prompt alone holds its endpoint full until it is done.
	only := func(id string) func(string) bool { return func(x string) bool { return x == id } }
	if _, err := s.Begin(Request{Model: "m", Prefix: seqChain(9_500_000, 1), Streamed: true, Wait: true, Allow: only(cl.EndpointID)}).Pick(); err == nil {
		t.Fatalf("%s holds %d blocks of streamed prefill, over its limit of %d, and took another", cl.EndpointID, 3*limit, limit)
	}
	long.Report(cl, ok200)
	// Non-streamed requests do not count: their first byte says nothing
	// of their prefill.
	for i := range 3 {
		a := s.Begin(Request{Model: "m", Prefix: seqChain(uint64(9_000_000+1000*i), limit), Allow: only(cl.EndpointID), Wait: true})
		if _, err := a.Pick(); err != nil {
			t.Fatalf("non-streamed request %d: %v", i, err)
		}
	}
	if _, err := s.Begin(Request{Model: "m", Prefix: seqChain(9_600_000, 1), Streamed: true, Wait: true, Allow: only(cl.EndpointID)}).Pick(); err != nil {
		t.Fatalf("%s has %d non-streamed prompts in flight and no streamed one; a streamed request: %v", cl.EndpointID, 3, err)
	}
}

// An endpoint at its limit still takes a prompt it holds a prefix of that
// is longer than the prefill queued there: waiting behind that costs less
// than prefilling the prefix cold elsewhere.
func TestPrefillLimitYieldsToTheCache(t *testing.T) {
	const limit = 100
	s, _ := newTest(t, Config{ColdStartSamples: 1}, prefillEP("a", limit), prefillEP("b", limit))
	conv := seqChain(1, 120)
	s.IndexReset("a", conv)
	for i, id := range []string{"a", "b"} {
		// The limit of prefill queued at each.
		if _, err := s.Begin(Request{Model: "m", Prefix: seqChain(uint64(1_000_000*(i+1)), limit), Streamed: true,
			Allow: func(x string) bool { return x == id }}).Pick(); err != nil {
			t.Fatal(err)
		}
	}
	// The next turn of the conversation: a holds 120 of its 125 blocks,
	// more than the 100 queued there.
	c := mustPick(t, s.Begin(Request{Model: "m", Prefix: seqChain(1, 125), Streamed: true, Wait: true}))
	if c.EndpointID != "a" || c.CachedBlocks != 120 {
		t.Fatalf("the next turn went to %s with %d blocks cached; want a, which holds 120 of its 125", c.EndpointID, c.CachedBlocks)
	}
	// A cold prompt fits neither.
	_, err := s.Begin(Request{Model: "m", Prefix: seqChain(5_000_000, 20), Streamed: true, Wait: true}).Pick()
	if ue := wantUnavailable(t, err); !ue.Full {
		t.Fatalf("a cold prompt, 105 and 100 blocks queued under a limit of %d: got %v, want full", limit, err)
	}
}
