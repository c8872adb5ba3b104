package agent

import (
	"bufio"
	"io"
	"math"
	"strconv"
	"strings"
)

// EngineMetrics is an engine's load as read from its Prometheus /metrics,
// in the terms of scheduler.Health.
type EngineMetrics struct {
	Running      int     // requests being processed
	Waiting      int     // requests queued
	KVCacheUsage float64 // 0..1; 0 when the engine does not report it
	// Engine names the family the metrics came from: "vllm", "sglang",
	// "tgi", "llamacpp", or "" when none of the known series was present.
	Engine string
	// HasKVCache tells a reported 0 from an engine that reports nothing.
	HasKVCache bool
	// KVCapacityTokens is the KV cache's size in tokens when the metrics
	// carry it: vLLM's vllm:cache_config_info (num_gpu_blocks ×
	// block_size), SGLang's sglang:max_total_num_tokens; 0 otherwise.
	KVCapacityTokens int
}

// metricRole is what a known series contributes.
type metricRole int

const (
	roleRunning metricRole = iota
	roleWaiting
	roleKV       // ratio 0..1
	roleCapacity // tokens
)

// knownMetrics maps the series names of supported engines to their role.
var knownMetrics = map[string]struct {
	engine string
	role   metricRole
}{
	"vllm:num_requests_running":     {"vllm", roleRunning},
	"vllm:num_requests_waiting":     {"vllm", roleWaiting},
	"vllm:kv_cache_usage_perc":      {"vllm", roleKV}, // despite the name, 0..1
	"vllm:gpu_cache_usage_perc":     {"vllm", roleKV}, // older vLLM releases
	"sglang:num_running_reqs":       {"sglang", roleRunning},
	"sglang:num_queue_reqs":         {"sglang", roleWaiting},
	"sglang:token_usage":            {"sglang", roleKV}, // 0..1
	"sglang:max_total_num_tokens":   {"sglang", roleCapacity},
	"tgi_batch_current_size":        {"tgi", roleRunning},
	"tgi_queue_size":                {"tgi", roleWaiting},
	"llamacpp:requests_processing":  {"llamacpp", roleRunning},
	"llamacpp:requests_deferred":    {"llamacpp", roleWaiting},
	"llamacpp:kv_cache_usage_ratio": {"llamacpp", roleKV},
}

// maxMetricLine bounds one line of the exposition; longer lines are skipped.
const maxMetricLine = 64 << 10

// ParseEngineMetrics reads the Prometheus text exposition format (also
// OpenMetrics text) and extracts the load series of vLLM, SGLang, TGI and
// llama.cpp, and the KV capacity of vLLM and SGLang.
// Series with several label sets (e.g. one per model) are summed for counts
// and maxed for KV usage. It is tolerant: malformed lines, unknown series,
// NaN and infinite values are skipped; only a read error is returned.
func ParseEngineMetrics(r io.Reader) (EngineMetrics, error) {
	var m EngineMetrics
	var running, waiting, capacity float64
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxMetricLine)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, cacheConfigInfo+"{") {
			// vLLM publishes its cache configuration as labels of an
			// info gauge whose value is 1.
			if t := cacheConfigTokens(line); t > 0 {
				capacity += float64(t)
				if m.Engine == "" {
					m.Engine = "vllm"
				}
			}
			continue
		}
		name, value, ok := parseSample(line)
		if !ok {
			continue
		}
		k, known := knownMetrics[name]
		if !known || math.IsNaN(value) || math.IsInf(value, 0) || value < 0 {
			continue
		}
		if m.Engine == "" {
			m.Engine = k.engine
		}
		switch k.role {
		case roleRunning:
			running += value
		case roleWaiting:
			waiting += value
		case roleKV:
			m.KVCacheUsage = max(m.KVCacheUsage, min(value, 1))
			m.HasKVCache = true
		case roleCapacity:
			capacity += value // one pool per data-parallel rank
		}
	}
	if err := sc.Err(); err != nil && err != bufio.ErrTooLong {
		return EngineMetrics{}, err
	}
	m.Running = clampInt(running)
	m.Waiting = clampInt(waiting)
	m.KVCapacityTokens = clampInt(capacity)
	return m, nil
}

// cacheConfigInfo is vLLM's info gauge of its cache configuration.
const cacheConfigInfo = "vllm:cache_config_info"

// cacheConfigTokens returns num_gpu_blocks × block_size from a
// vllm:cache_config_info sample line, or 0.
func cacheConfigTokens(line string) int {
	end := labelsEnd(line[len(cacheConfigInfo):])
	if end < 0 {
		return 0
	}
	labels := line[len(cacheConfigInfo)+1 : len(cacheConfigInfo)+end]
	var blocks, size int
	for labels != "" {
		eq := strings.IndexByte(labels, '=')
		if eq < 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return 0
		}
		key := strings.TrimSpace(labels[:eq])
		q := closingQuote(labels, eq+2)
		if q < 0 {
			return 0
		}
		val := labels[eq+2 : q]
		switch key {
		case "num_gpu_blocks":
			blocks, _ = strconv.Atoi(val)
		case "block_size":
			size, _ = strconv.Atoi(val)
		}
		labels = strings.TrimLeft(labels[q+1:], ", ")
	}
	if blocks <= 0 || size <= 0 || blocks > math.MaxInt32/size {
		return 0
	}
	return blocks * size
}

func clampInt(f float64) int {
	if f >= math.MaxInt32 {
		return math.MaxInt32
	}
	return int(math.Round(f))
}

// parseSample splits one exposition line into the metric name and value.
// It accepts `name value`, `name{labels} value [timestamp]` and the quoted
// UTF-8 form `{"name",labels} value`.
func parseSample(line string) (name string, value float64, ok bool) {
	line = strings.TrimSpace(line)
	if line == "" || line[0] == '#' {
		return "", 0, false
	}
	var rest string
	switch {
	case line[0] == '{':
		// {"metric:name", label="v"} value
		end := labelsEnd(line)
		if end < 0 {
			return "", 0, false
		}
		inner := strings.TrimSpace(line[1:end])
		if len(inner) < 2 || inner[0] != '"' {
			return "", 0, false
		}
		q := closingQuote(inner, 1)
		if q < 0 {
			return "", 0, false
		}
		name = inner[1:q]
		rest = line[end+1:]
	default:
		i := strings.IndexAny(line, "{ \t")
		if i <= 0 {
			return "", 0, false
		}
		name = line[:i]
		rest = line[i:]
		if rest[0] == '{' {
			end := labelsEnd(rest)
			if end < 0 {
				return "", 0, false
			}
			rest = rest[end+1:]
		}
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 || len(fields) > 3 {
		return "", 0, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return "", 0, false
	}
	return name, v, true
}

// labelsEnd returns the index of the '}' closing the label set that opens at
// s[0], honouring quoted values with escapes, or -1.
func labelsEnd(s string) int {
	for i := 1; i < len(s); i++ {
		switch s[i] {
		case '"':
			q := closingQuote(s, i+1)
			if q < 0 {
				return -1
			}
			i = q
		case '}':
			return i
		}
	}
	return -1
}

// closingQuote returns the index of the unescaped '"' at or after from, or -1.
func closingQuote(s string, from int) int {
	for i := from; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '"':
			return i
		}
	}
	return -1
}
