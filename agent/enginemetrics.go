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
	// Engine names the family the metrics came from: "vllm", "tgi",
	// "llamacpp", or "" when none of the known series was present.
	Engine string
	// HasKVCache tells a reported 0 from an engine that reports nothing.
	HasKVCache bool
}

// metricRole is what a known series contributes.
type metricRole int

const (
	roleRunning metricRole = iota
	roleWaiting
	roleKV // ratio 0..1
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
	"tgi_batch_current_size":        {"tgi", roleRunning},
	"tgi_queue_size":                {"tgi", roleWaiting},
	"llamacpp:requests_processing":  {"llamacpp", roleRunning},
	"llamacpp:requests_deferred":    {"llamacpp", roleWaiting},
	"llamacpp:kv_cache_usage_ratio": {"llamacpp", roleKV},
}

// maxMetricLine bounds one line of the exposition; longer lines are skipped.
const maxMetricLine = 64 << 10

// ParseEngineMetrics reads the Prometheus text exposition format (also
// OpenMetrics text) and extracts the load series of vLLM, TGI and llama.cpp.
// Series with several label sets (e.g. one per model) are summed for counts
// and maxed for KV usage. It is tolerant: malformed lines, unknown series,
// NaN and infinite values are skipped; only a read error is returned.
func ParseEngineMetrics(r io.Reader) (EngineMetrics, error) {
	var m EngineMetrics
	var running, waiting float64
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxMetricLine)
	for sc.Scan() {
		name, value, ok := parseSample(sc.Text())
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
		}
	}
	if err := sc.Err(); err != nil && err != bufio.ErrTooLong {
		return EngineMetrics{}, err
	}
	m.Running = clampInt(running)
	m.Waiting = clampInt(waiting)
	return m, nil
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
