package agent

import (
	"strings"
	"testing"
)

func TestParseEngineMetrics(t *testing.T) {
	cases := []struct {
		name string
		text string
		want EngineMetrics
	}{
		{"vllm", `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 4.0
vllm:num_requests_running{engine="1",model_name="llama"} 1.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.75
vllm:prefix_cache_hits_total{model_name="llama"} 1234
`, EngineMetrics{Running: 5, Waiting: 7, KVCacheUsage: 0.75, HasKVCache: true, Engine: "vllm"}},
		{"older vllm", "vllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.1\n",
			EngineMetrics{Running: 2, KVCacheUsage: 0.1, HasKVCache: true, Engine: "vllm"}},
		{"tgi", "# TYPE tgi_queue_size gauge\ntgi_queue_size 3\ntgi_batch_current_size 8\n",
			EngineMetrics{Running: 8, Waiting: 3, Engine: "tgi"}},
		{"llama.cpp", "llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\nllamacpp:kv_cache_usage_ratio 0.3 1700000000000\n",
			EngineMetrics{Running: 1, Waiting: 2, KVCacheUsage: 0.3, HasKVCache: true, Engine: "llamacpp"}},
		{"utf-8 quoted names", `{"vllm:num_requests_waiting",model_name="a b}"} 6` + "\n",
			EngineMetrics{Waiting: 6, Engine: "vllm"}},
		{"labels with escapes and braces", `vllm:num_requests_running{model_name="we\"ird} {x"} 9` + "\n",
			EngineMetrics{Running: 9, Engine: "vllm"}},
		{"garbage tolerated", "not a metric\nvllm:num_requests_running{broken 3\nvllm:num_requests_waiting NaN\nvllm:num_requests_waiting -4\nvllm:num_requests_running 2\n\n# EOF\n",
			EngineMetrics{Running: 2, Engine: "vllm"}},
		{"kv clamped", "vllm:kv_cache_usage_perc 7\n", EngineMetrics{KVCacheUsage: 1, HasKVCache: true, Engine: "vllm"}},
		{"unknown engine", "process_cpu_seconds_total 12\n", EngineMetrics{}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseEngineMetrics(strings.NewReader(c.text))
			if err != nil {
				t.Fatal(err)
			}
			if got != c.want {
				t.Fatalf("got %+v, want %+v", got, c.want)
			}
		})
	}
}

func FuzzParseEngineMetrics(f *testing.F) {
	f.Add("vllm:num_requests_running{model_name=\"x\"} 3\nvllm:kv_cache_usage_perc 0.2\n")
	f.Add("tgi_queue_size 1\ntgi_batch_current_size 2 123\n")
	f.Add(`{"llamacpp:requests_deferred",a="\"}"} 4` + "\n")
	f.Add("# EOF\n{\n}\n\"\n")
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseEngineMetrics(strings.NewReader(s))
		if err != nil {
			t.Fatal(err)
		}
		if m.Running < 0 || m.Waiting < 0 || m.KVCacheUsage < 0 || m.KVCacheUsage > 1 {
			t.Fatalf("out of range: %+v", m)
		}
	})
}
