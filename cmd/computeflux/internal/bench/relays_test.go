package bench

import (
	"context"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/scheduler"
)

// TestSimRelaysShareBindings spreads the chat workload over 4 relays: with
// bindings shared, sticky keeps its one-relay hit ratio; with relays that
// share nothing (a binding that never arrives), it falls.
func TestSimRelaysShareBindings(t *testing.T) {
	w, err := Chat(ChatConfig{Sessions: 60}, 3)
	if err != nil {
		t.Fatal(err)
	}
	run := func(relays int, delay time.Duration, prefixes bool) Result {
		t.Helper()
		cfg := simConfig(Config{Engines: 4, Relays: relays, PeerDelay: delay, Seed: 3})
		// Without prompt prefixes, so that only the bindings tell relays
		// where a session is; with them, the agents' published indexes do.
		cfg.prefixes = prefixes
		res, err := runSim(context.Background(), cfg, w, scheduler.PolicySticky)
		if err != nil {
			t.Fatal(err)
		}
		if res.Errors != 0 {
			t.Fatalf("%d relays: %d errors", relays, res.Errors)
		}
		return res
	}
	one, four := run(1, 0, false), run(4, 0, false)
	isolated := run(4, 1000*time.Hour, false) // bindings arrive after the run
	// With prompt prefixes and the agents' indexes, isolated relays still
	// find each session's engine.
	if p := run(4, 1000*time.Hour, true); p.HitRatio < 0.98*four.HitRatio {
		t.Errorf("isolated relays with prefixes hit %.3f, below 98%% of sharing relays' %.3f", p.HitRatio, four.HitRatio)
	}
	t.Logf("hit: one relay %.1f%%, four sharing %.1f%% (%d updates, %.0f B/s per relay), four isolated %.1f%%",
		100*one.HitRatio, 100*four.HitRatio, four.BindingUpdates, four.BindingBytesPerSec, 100*isolated.HitRatio)
	if four.HitRatio < 0.98*one.HitRatio {
		t.Errorf("four relays hit %.3f, below 98%% of one relay's %.3f", four.HitRatio, one.HitRatio)
	}
	if isolated.HitRatio > four.HitRatio-0.05 {
		t.Errorf("isolated relays hit %.3f, near sharing relays' %.3f: the test shows nothing", isolated.HitRatio, four.HitRatio)
	}
	if four.Relays != 4 || four.BindingUpdates == 0 || one.Relays != 0 {
		t.Errorf("relay fields: %+v / %+v", four, one)
	}
}

// A short live run over three real relays, requests at random over them:
// sticky still beats round-robin, nothing fails, and bindings flow.
func TestLiveRelays(t *testing.T) {
	slow.Gate(t, "starts relays and agents over QUIC")
	_, rp := runLiveStickyRoundRobin(t, 3)
	if sticky := rp.Results[0]; sticky.BindingUpdates == 0 {
		t.Fatalf("sticky over 3 relays: no binding updates")
	}
	if _, err := Run(context.Background(), Config{Mode: ModeLive, Relays: 2, Scenario: ScenarioFailure}); err == nil {
		t.Error("several live relays with a failure scenario: accepted")
	}
}
