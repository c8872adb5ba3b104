package bench

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/scheduler"
)

// openLoop builds an open-loop workload: one keyless session per entry of
// sends, each turn sent at its time, a one-block prompt of its own and an
// answer of answer tokens.
func openLoop(answer int, sends ...[]time.Duration) *Workload {
	w := &Workload{Name: "test"}
	id := uint64(1000)
	for _, at := range sends {
		s := Session{Start: at[0]}
		for _, t := range at {
			id++
			s.Turns = append(s.Turns, Turn{At: t, Blocks: []uint64{id}, InputTokens: 500, MaxTokens: answer})
		}
		w.Sessions = append(w.Sessions, s)
	}
	return w
}

// A request that finds every agent at its dispatch limit waits at the
// relay and is placed the instant a slot frees, in fair order: a session
// with nothing in service goes before one already served, though it came
// last.
func TestSimQueueDispatchesInFairOrder(t *testing.T) {
	ms := time.Millisecond
	// Session a sends four requests, b one after them; two engines of one
	// slot each (their batch, so their dispatch limit).
	w := openLoop(100, []time.Duration{0, 1 * ms, 2 * ms, 3 * ms}, []time.Duration{4 * ms})
	cfg := simConfig(Config{Engines: 2, Engine: simengine.EngineConfig{MaxRunning: 1}})
	res, recs, err := simulate(context.Background(), cfg, w, scheduler.PolicySticky)
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 0 || len(recs) != 5 {
		t.Fatalf("%d errors in %d requests: %v", res.Errors, len(recs), res.ErrorCauses)
	}
	a1, a2, a3, a4, b1 := recs[0], recs[1], recs[2], recs[3], recs[4]
	placed := func(r record) time.Duration { return r.first + r.wait }
	for i, r := range recs {
		if want := i >= 2; r.waited != want {
			t.Errorf("request %d waited %v, want %v", i, r.waited, want)
		}
	}
	// b's request takes the first slot that frees, a's others the next
	// ones, each at the instant its slot frees.
	if placed(b1) != a1.done {
		t.Errorf("b placed at %v, want when a's first ended, %v", placed(b1), a1.done)
	}
	if placed(a3) != a2.done {
		t.Errorf("a's third placed at %v, want when a's second ended, %v", placed(a3), a2.done)
	}
	if want := min(b1.done, a3.done); placed(a4) != want {
		t.Errorf("a's fourth placed at %v, want %v", placed(a4), want)
	}
	if !(placed(b1) < placed(a3) && placed(a3) < placed(a4)) {
		t.Errorf("placed b %v, a3 %v, a4 %v: want in that order", placed(b1), placed(a3), placed(a4))
	}
	if res.Queued != 3 || res.QueueWait == nil {
		t.Errorf("result: %d queued, wait %v", res.Queued, res.QueueWait)
	}
}

// Without the queue, the same requests find no room and fail.
func TestSimQueueOff(t *testing.T) {
	ms := time.Millisecond
	w := openLoop(100, []time.Duration{0, 1 * ms, 2 * ms, 3 * ms}, []time.Duration{4 * ms})
	cfg := simConfig(Config{Engines: 2, Engine: simengine.EngineConfig{MaxRunning: 1}, Capacity: 1, DispatchLimit: -1})
	res, _, err := simulate(context.Background(), cfg, w, scheduler.PolicySticky)
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 3 || res.Queued != 0 {
		t.Fatalf("%d errors, %d queued; want 3 and none", res.Errors, res.Queued)
	}
}

// A request waits at most the relay's bound, then fails as the relay's 429.
func TestSimQueueWaitBound(t *testing.T) {
	// A 60 s answer holds the only slot.
	w := openLoop(6000, []time.Duration{0}, []time.Duration{time.Millisecond})
	cfg := simConfig(Config{Engines: 1, Engine: simengine.EngineConfig{MaxRunning: 1}})
	res, recs, err := simulate(context.Background(), cfg, w, scheduler.PolicySticky)
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 1 || !recs[1].failed || recs[1].why != "429 waited the queue bound" {
		t.Fatalf("errors %d, second request %+v", res.Errors, recs[1])
	}
	if recs[1].wait != relay.DefaultQueueWait {
		t.Fatalf("waited %v, want the relay's bound %v", recs[1].wait, relay.DefaultQueueWait)
	}
}

// queueTrace is the conversation of TestSimTraceQueueIgnoresKeys: three
// turns (each prompt starts with the last one's blocks), the first a long
// answer that holds the only slot, and a larger, unrelated request after
// them.
var queueTrace = []TraceRecord{
	{Timestamp: 0, InputLength: 512, OutputLength: 2000, HashIDs: []uint64{1}},
	{Timestamp: 1, InputLength: 1024, OutputLength: 10, HashIDs: []uint64{1, 2}},
	{Timestamp: 2, InputLength: 1536, OutputLength: 10, HashIDs: []uint64{1, 2, 3}},
	{Timestamp: 3, InputLength: 2048, OutputLength: 10, HashIDs: []uint64{9, 10, 11, 12}},
}

// placeQueueTrace replays queueTrace with tc on one engine of one slot and
// returns the time each request was placed, after checking that tc's
// workload has sessions sessions and that the three later requests
// queued.
func placeQueueTrace(t *testing.T, tc TraceConfig, sessions int) []time.Duration {
	t.Helper()
	tc.Bucket = time.Nanosecond
	w, err := TraceWorkload(queueTrace, tc, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Sessions) != sessions {
		t.Fatalf("%+v: %d sessions, want %d", tc, len(w.Sessions), sessions)
	}
	// Capacity strict for sessions too, so that keys change nothing but
	// the queue's flows, if they did.
	cfg := simConfig(Config{Engines: 1, Engine: simengine.EngineConfig{MaxRunning: 1},
		Scheduler: scheduler.Config{AffinityCapacity: 1}})
	res, rs, err := simulate(context.Background(), cfg, w, scheduler.PolicySticky)
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors != 0 || res.Queued != 3 || len(rs) != 4 {
		t.Fatalf("%+v: %d errors, %d queued of %d", tc, res.Errors, res.Queued, len(rs))
	}
	var placed []time.Duration
	for _, r := range rs {
		placed = append(placed, r.first+r.wait)
	}
	return placed
}

// A trace replay names no clients, so by default the queue sees each
// request as one, keyed or not: a conversation whose next turns arrive
// while its first is in service waits as keyless requests do, not behind
// its own first turn as a single client's would. Session keys change where
// a request goes, never its place in the queue.
func TestSimTraceQueueIgnoresKeys(t *testing.T) {
	keyed := placeQueueTrace(t, TraceConfig{}, 2)
	keyless := placeQueueTrace(t, TraceConfig{Keyless: true}, 4)
	if !slices.Equal(keyed, keyless) {
		t.Errorf("placed at %v with keys, %v without", keyed, keyless)
	}
	// Requests of their own flows go by cost: the conversation's short
	// turns before the larger request.
	if p := keyed; !(p[1] < p[2] && p[2] < p[3]) {
		t.Errorf("placed %v: want the second and third turns before the other request", p)
	}
}

// With a client per conversation (one user, one API key) the queue holds
// the conversation's later turns behind the service its first turn had, so
// the unrelated request goes first; keyless as keyed, since the
// conversations are inferred either way and only the key is left out.
func TestSimTraceClientPerConversation(t *testing.T) {
	keyed := placeQueueTrace(t, TraceConfig{Clients: TraceClientsConversation}, 2)
	keyless := placeQueueTrace(t, TraceConfig{Clients: TraceClientsConversation, Keyless: true}, 2)
	if !slices.Equal(keyed, keyless) {
		t.Errorf("placed at %v with keys, %v without", keyed, keyless)
	}
	if p := keyed; !(p[3] < p[1] && p[1] < p[2]) {
		t.Errorf("placed %v: want the other request before the conversation's later turns", p)
	}
	if _, err := TraceWorkload(queueTrace, TraceConfig{Clients: "user"}, 1); err == nil {
		t.Error("clients \"user\": no error")
	}
}
