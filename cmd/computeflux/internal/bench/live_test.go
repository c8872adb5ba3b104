package bench

import (
	"context"
	"testing"
	"time"

	"github.com/computeflux/computeflux/scheduler"
)

// A short live run through a real relay, agents and engines: sticky keeps
// more of the cache than round-robin on multi-turn chat, and the engines
// see exactly the prompts the simulation builds.
func TestLiveStickyBeatsRoundRobin(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster over QUIC")
	}
	cfg, rp := runLiveStickyRoundRobin(t, 0)
	if sticky := rp.Results[0]; sticky.HitRatio > rp.Oracle+1e-9 {
		t.Fatalf("sticky's hit ratio %.3f is above the oracle's %.3f", sticky.HitRatio, rp.Oracle)
	}

	cfg.Mode = ModeSim
	sim, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range sim.Results {
		if r.PromptTokens != rp.Results[i].PromptTokens || r.OutputTokens != rp.Results[i].OutputTokens {
			t.Fatalf("%s: live sent %d prompt and got %d completion tokens, the simulation %d and %d",
				r.Policy, rp.Results[i].PromptTokens, rp.Results[i].OutputTokens, r.PromptTokens, r.OutputTokens)
		}
	}
}

// runLiveStickyRoundRobin runs a short live chat workload over relays real
// relays (0: the one-relay cluster) with sticky and round-robin routing,
// and fails t unless every turn was answered and sticky hit the cache more
// often than round-robin. It returns the config and the report.
func runLiveStickyRoundRobin(t *testing.T, relays int) (Config, *Report) {
	t.Helper()
	cfg := Config{
		Mode:      ModeLive,
		Engines:   3,
		Relays:    relays,
		Seed:      2,
		TimeScale: 50,
		Policies:  []scheduler.Policy{scheduler.PolicySticky, scheduler.PolicyRoundRobin},
		Chat:      ChatConfig{Sessions: 12, SystemTokens: 1000, MeanTurns: 4, Think: 2 * time.Second, ArrivalSpan: 5 * time.Second},
	}
	rp, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	sticky, rr := rp.Results[0], rp.Results[1]
	t.Logf("oracle %.3f, sticky %.3f (%d relays, %d binding updates, %.0f B/s per relay), round-robin %.3f",
		rp.Oracle, sticky.HitRatio, relays, sticky.BindingUpdates, sticky.BindingBytesPerSec, rr.HitRatio)
	for _, r := range rp.Results {
		if r.Errors != 0 || r.Requests != rp.Turns || r.Relays != relays {
			t.Fatalf("%s: %d errors (%v) in %d requests over %d relays, want %d requests over %d", r.Policy, r.Errors, r.ErrorCauses, r.Requests, r.Relays, rp.Turns, relays)
		}
	}
	if sticky.HitRatio <= rr.HitRatio {
		t.Fatalf("sticky's hit ratio %.3f is not above round-robin's %.3f", sticky.HitRatio, rr.HitRatio)
	}
	return cfg, rp
}
