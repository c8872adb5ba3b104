package simengine

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// collector exports the engine's statistics under vLLM's metric names, with
// vLLM's model_name label, so tools that read a vLLM engine's /metrics read
// the simulator's too.
type collector struct{ s *Server }

var (
	labels         = []string{"model_name"}
	descRunning    = prometheus.NewDesc("vllm:num_requests_running", "Number of requests in model execution batches.", labels, nil)
	descWaiting    = prometheus.NewDesc("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, nil)
	descKVUsage    = prometheus.NewDesc("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, nil)
	descPCQueries  = prometheus.NewDesc("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", labels, nil)
	descPCHits     = prometheus.NewDesc("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", labels, nil)
	descPrompt     = prometheus.NewDesc("vllm:prompt_tokens_total", "Number of prefill tokens processed.", labels, nil)
	descGeneration = prometheus.NewDesc("vllm:generation_tokens_total", "Number of generation tokens processed.", labels, nil)
	descSuccess    = prometheus.NewDesc("vllm:request_success_total", "Count of successfully processed requests.", labels, nil)
	descCachedBlks = prometheus.NewDesc("simengine_prefix_cache_blocks", "Blocks held in the simulated prefix cache.", labels, nil)
	descCapacity   = prometheus.NewDesc("simengine_prefix_cache_capacity_blocks", "Capacity of the simulated prefix cache, in blocks.", labels, nil)
	descCancelled  = prometheus.NewDesc("simengine_requests_cancelled_total", "Requests whose client went away before the end.", labels, nil)
	descRejected   = prometheus.NewDesc("simengine_requests_rejected_total", "Requests refused because the queue was full.", labels, nil)
	descSlowdown   = prometheus.NewDesc("simengine_slowdown_factor", "How many times slower than configured the engine runs.", labels, nil)
	// descCacheConfig is vLLM's cache configuration series (value 1, the
	// figures in labels): agents size their prefix index from it.
	descCacheConfig = prometheus.NewDesc("vllm:cache_config_info", "Information of the KV-cache configuration.", []string{"block_size", "num_gpu_blocks"}, nil)
	collectorDescs  = []*prometheus.Desc{descRunning, descWaiting, descKVUsage, descPCQueries, descPCHits, descPrompt, descGeneration, descSuccess, descCachedBlks, descCapacity, descCancelled, descRejected, descSlowdown, descCacheConfig}
)

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range collectorDescs {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.Stats()
	m := c.s.cfg.Models[0]
	g := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, m)
	}
	n := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), m)
	}
	g(descRunning, float64(st.Running))
	g(descWaiting, float64(st.Waiting))
	g(descKVUsage, st.KVCacheUsage)
	n(descPCQueries, st.PrefixQueries)
	n(descPCHits, st.PrefixHits)
	n(descPrompt, st.PromptTokens)
	n(descGeneration, st.GenerationTokens)
	n(descSuccess, st.Finished)
	g(descCachedBlks, float64(st.CachedBlocks))
	g(descCapacity, float64(st.CacheBlocks))
	n(descCancelled, st.Cancelled)
	n(descRejected, st.Rejected)
	g(descSlowdown, st.Slowdown)
	ch <- prometheus.MustNewConstMetric(descCacheConfig, prometheus.GaugeValue, 1,
		strconv.Itoa(c.s.cfg.Engine.BlockSize), strconv.Itoa(st.CacheBlocks))
}
