package relay

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/scheduler"
)

// TestPromptBlocksPooled checks that hashing a request's prompt in the
// request path allocates nothing once the pool is warm, and gives the same
// chain as scheduler.PromptBlocks.
func TestPromptBlocksPooled(t *testing.T) {
	body, _ := json.Marshal(map[string]any{
		"model": "m", "stream": true,
		"messages": []map[string]string{
			{"role": "system", "content": strings.Repeat("a shared system prompt ", 1000)},
			{"role": "user", "content": strings.Repeat("question ", 500)},
		},
	})
	if len(body) < 24<<10 {
		t.Fatalf("body of %d bytes", len(body))
	}
	r := &Relay{}
	want := scheduler.PromptBlocks(nil, body, scheduler.PrefixConfig{})
	bp := r.promptBlocks(body)
	if len(*bp) != len(want) || len(want) < 90 {
		t.Fatalf("%d blocks, want %d", len(*bp), len(want))
	}
	for i := range want {
		if (*bp)[i] != want[i] {
			t.Fatalf("block %d differs", i)
		}
	}
	releaseBlocks(bp)
	if n := testing.AllocsPerRun(200, func() { releaseBlocks(r.promptBlocks(body)) }); n != 0 {
		t.Fatalf("%v allocations per request", n)
	}
}

func BenchmarkPromptBlocksPooled(b *testing.B) {
	body, _ := json.Marshal(map[string]any{
		"model": "m", "messages": []map[string]string{{"role": "user", "content": strings.Repeat("x", 32<<10)}},
	})
	r := &Relay{}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		releaseBlocks(r.promptBlocks(body))
	}
}
