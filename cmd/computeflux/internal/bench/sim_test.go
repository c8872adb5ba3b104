package bench

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/scheduler"
)

func simConfig(cfg Config) *Config {
	cfg.Mode = ModeSim
	cfg.populate()
	return &cfg
}

// On one engine with a cache that never evicts, and sessions that do not
// overlap, the simulation's hit ratio is exactly the oracle's.
func TestSimMatchesOracleOnOneEngine(t *testing.T) {
	chat, err := Chat(ChatConfig{Sessions: 6, SystemTokens: 300}, 5)
	if err != nil {
		t.Fatal(err)
	}
	for i := range chat.Sessions {
		chat.Sessions[i].Start = time.Duration(i) * time.Hour
	}
	for name, w := range map[string]*Workload{"chat": chat, "trace": tinyTrace()} {
		t.Run(name, func(t *testing.T) {
			cfg := simConfig(Config{Engines: 1, Engine: simengine.EngineConfig{CacheBlocks: 1 << 20}})
			res, err := runSim(context.Background(), cfg, w, scheduler.PolicySticky)
			if err != nil {
				t.Fatal(err)
			}
			if res.Errors != 0 || res.Requests != w.Requests() {
				t.Fatalf("%d errors in %d requests, want %d", res.Errors, res.Requests, w.Requests())
			}
			if o := Oracle(w, 16); math.Abs(res.HitRatio-o) > 1e-12 {
				t.Fatalf("hit ratio %v, oracle %v", res.HitRatio, o)
			}
		})
	}
}

// The ordering that must hold on multi-turn chat: no policy beats the
// oracle, and sticky keeps more of the cache than the policies that ignore
// sessions.
func TestSimOrdering(t *testing.T) {
	rp, err := Run(context.Background(), Config{Mode: ModeSim, Engines: 4, Chat: ChatConfig{Sessions: 60}, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	hit := map[string]float64{}
	for _, r := range rp.Results {
		hit[r.Policy] = r.HitRatio
		if r.Errors != 0 {
			t.Errorf("%s: %d errors", r.Policy, r.Errors)
		}
		if r.HitRatio > rp.Oracle+1e-9 {
			t.Errorf("%s: hit ratio %.4f above the oracle's %.4f", r.Policy, r.HitRatio, rp.Oracle)
		}
	}
	for _, p := range []string{"round-robin", "random", "least-loaded"} {
		if hit["sticky"] <= hit[p] {
			t.Errorf("sticky's hit ratio %.4f is not above %s's %.4f", hit["sticky"], p, hit[p])
		}
	}
	// The same seed gives the same result.
	again, err := Run(context.Background(), Config{Mode: ModeSim, Engines: 4, Chat: ChatConfig{Sessions: 60}, Seed: 3,
		Policies: []scheduler.Policy{scheduler.PolicySticky}})
	if err != nil {
		t.Fatal(err)
	}
	if a, b := again.Results[0], rp.Results[0]; a.HitRatio != b.HitRatio || a.TTFT != b.TTFT || a.E2E != b.E2E {
		t.Fatalf("a second run differs: %+v vs %+v", a, b)
	}
}

// Every scenario runs to the end with every request accounted for.
func TestSimScenarios(t *testing.T) {
	for _, sc := range []Scenario{ScenarioDegraded, ScenarioFailure, ScenarioJoin, ScenarioSkew} {
		t.Run(sc.String(), func(t *testing.T) {
			rp, err := Run(context.Background(), Config{Mode: ModeSim, Engines: 3, Scenario: sc, Chat: ChatConfig{Sessions: 40}})
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range rp.Results {
				total := 0
				for _, n := range r.PerEngine {
					total += n
				}
				if total != r.Requests-r.Errors {
					t.Errorf("%s: %d served of %d requests with %d errors", r.Policy, total, r.Requests, r.Errors)
				}
				switch sc {
				case ScenarioJoin:
					// prefix-hash and sglang place every chat session by its
					// shared system prompt (sglang while the load looks
					// balanced to it): a joiner gets nothing, by design.
					if r.PerEngine[2] == 0 && r.Policy != "prefix-hash" && r.Policy != "sglang" {
						t.Errorf("%s: the joining engine served nothing", r.Policy)
					}
				}
			}
		})
	}
}

// A keyless trace replay infers no sessions: every request is its own
// keyless session.
func TestTraceKeylessInfersNoSessions(t *testing.T) {
	recs := []TraceRecord{
		{Timestamp: 0, InputLength: 1000, OutputLength: 5, HashIDs: []uint64{1, 2}},
		{Timestamp: 1000, InputLength: 1300, OutputLength: 5, HashIDs: []uint64{1, 2, 3}},
		{Timestamp: 2000, InputLength: 1700, OutputLength: 5, HashIDs: []uint64{1, 2, 3, 4}},
	}
	keyed, err := TraceWorkload(recs, TraceConfig{}, 1)
	if err != nil {
		t.Fatal(err)
	}
	keyless, err := TraceWorkload(recs, TraceConfig{Keyless: true}, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(keyed.Sessions) != 1 || keyed.Sessions[0].Key == "" {
		t.Fatalf("keyed replay: %d sessions, want 1 inferred", len(keyed.Sessions))
	}
	if len(keyless.Sessions) != 3 {
		t.Fatalf("keyless replay: %d sessions, want 3", len(keyless.Sessions))
	}
	for _, s := range keyless.Sessions {
		if s.Key != "" || len(s.Turns) != 1 {
			t.Fatalf("keyless session %+v", s)
		}
	}
}

// Without session keys, the product finds conversations by their prefixes
// (agents publishing what their engines hold): nearly the hit ratio it
// gets with keys, far above round-robin, and within the pooled bound.
func TestSimKeylessChatFollowsPrefixes(t *testing.T) {
	rp, err := Run(context.Background(), Config{Mode: ModeSim, Engines: 4, Chat: ChatConfig{Sessions: 60}, Seed: 3,
		Keys: KeysBoth, Policies: []scheduler.Policy{scheduler.PolicySticky, scheduler.PolicyRoundRobin}})
	if err != nil {
		t.Fatal(err)
	}
	hit := map[string]float64{}
	for _, r := range rp.Results {
		hit[r.Policy] = r.HitRatio
	}
	if hit["sticky/no-keys"] < 0.95*hit["sticky/keys"] || hit["sticky/no-keys"] <= hit["round-robin/no-keys"]+0.1 {
		t.Fatalf("hit ratios %v", hit)
	}
	if rp.Pooled <= 0 || rp.Pooled > rp.Oracle+1e-9 {
		t.Fatalf("pooled bound %v, oracle %v", rp.Pooled, rp.Oracle)
	}
}
