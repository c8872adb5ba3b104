package bench

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// writeConversationTrace writes a Mooncake-shaped trace of n requests:
// conversations that share one of a few system prompts and grow by a few
// blocks a turn, several requests per timestamp.
func writeConversationTrace(t *testing.T, n int) string {
	t.Helper()
	rng := rand.New(rand.NewPCG(7, 25))
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	enc := json.NewEncoder(f)
	next := 1000
	var convs [][]int
	for i := range n {
		var ids []int
		if k := len(convs); k > 0 && rng.IntN(3) > 0 {
			c := rng.IntN(k)
			for range 1 + rng.IntN(3) {
				convs[c] = append(convs[c], next)
				next++
			}
			ids = convs[c]
		} else {
			ids = []int{rng.IntN(4)} // one of four system prompts
			for range 2 + rng.IntN(6) {
				ids = append(ids, next)
				next++
			}
			convs = append(convs, ids)
		}
		rec := map[string]any{"timestamp": i / 4 * 1000, "input_length": len(ids) * 512,
			"output_length": 16 + rng.IntN(200), "hash_ids": ids}
		if err := enc.Encode(rec); err != nil {
			t.Fatal(err)
		}
	}
	return path
}

// TestTraceReplayFastEveryPolicy replays a conversation trace 16 times
// faster than recorded, on engines whose caches hold far less than the
// conversations, through every policy: engines then hold more than an
// agent's index predicted and evict what it thought held, the case that
// once panicked in the index. Every request must be answered.
func TestTraceReplayFastEveryPolicy(t *testing.T) {
	slow.Gate(t, "replays a trace through every policy")
	cfg := Config{Mode: ModeSim, TracePath: writeConversationTrace(t, 1500), Engines: 8,
		Trace: TraceConfig{Speed: 16, MaxOutput: 64, Keyless: true}, Engine: simengine.EngineConfig{CacheBlocks: 2048}}
	rp, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(rp.Results) != len(AllPolicies) {
		t.Fatalf("%d results, want one for each of %d policies", len(rp.Results), len(AllPolicies))
	}
	for _, r := range rp.Results {
		if r.Requests != 1500 || r.Errors != 0 {
			t.Errorf("%s: %d requests, %d errors; want 1500 and 0", r.Policy, r.Requests, r.Errors)
		}
	}
}
