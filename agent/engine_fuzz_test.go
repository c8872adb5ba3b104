package agent

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzEngineAnswers feeds the engine identification decoders arbitrary
// bytes, seeded with every engine's fixtures: none may panic, and what they
// return stays in range.
func FuzzEngineAnswers(f *testing.F) {
	files, _ := filepath.Glob(filepath.Join("testdata", "engines", "*", "*"))
	for _, p := range files {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte(`vllm:cache_config_info{block_size="16",num_gpu_blocks="10"} 1`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if p, ok := ParseLlamaCppProps(b); ok && (p.NCtx < 0 || p.TotalSlots < 0) {
			t.Fatalf("props %+v", p)
		}
		if s, ok := ParseLlamaCppSlots(b); ok && (s.NCtx < 0 || s.Processing > s.Slots) {
			t.Fatalf("slots %+v", s)
		}
		if ti, ok := ParseTGIInfo(b); ok && ti.MaxBatchTotalTokens < 0 {
			t.Fatalf("tgi %+v", ti)
		}
		if si, ok := ParseSGLangServerInfo(b); ok && si.MaxTotalNumTokens < 0 {
			t.Fatalf("sglang %+v", si)
		}
		if ps, ok := ParseOllamaPS(b); ok && ps.ContextTokens < 0 {
			t.Fatalf("ollama %+v", ps)
		}
		ParseOpenAPIPaths(b)
		if n := cacheConfigTokens(cacheConfigInfo + string(b)); n < 0 {
			t.Fatalf("capacity %d", n)
		}
	})
}
