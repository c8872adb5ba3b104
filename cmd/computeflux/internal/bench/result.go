package bench

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// record is what one request measured.
type record struct {
	ttft, e2e   time.Duration
	prompt      int
	cached      int
	completion  int
	engine      int // index of the engine that served it; -1 when none
	failed      bool
	why         string        // why it failed
	first, done time.Duration // from the run's start
	wait        time.Duration // time waited in the relay's queue (sim)
	waited      bool          // it waited there
}

// Quantiles are latency percentiles in milliseconds of model time.
type Quantiles struct {
	P50 float64 `json:"p50_ms"`
	P95 float64 `json:"p95_ms"`
	P99 float64 `json:"p99_ms"`
}

// Result is one policy's measurements on one scenario.
type Result struct {
	Policy   string `json:"policy"`
	Scenario string `json:"scenario"`
	Mode     string `json:"mode"`
	// Requests counts requests sent; Errors those that did not complete.
	Requests int `json:"requests"`
	Errors   int `json:"errors"`
	// ErrorCauses counts the errors by cause.
	ErrorCauses map[string]int `json:"error_causes,omitempty"`
	// HitRatio is cached over prompt tokens, from the engines' usage.
	HitRatio     float64 `json:"hit_ratio"`
	PromptTokens int64   `json:"prompt_tokens"`
	CachedTokens int64   `json:"cached_tokens"`
	OutputTokens int64   `json:"completion_tokens"`
	// TTFT and E2E are in model time (live runs: measured × time scale).
	TTFT Quantiles `json:"ttft"`
	E2E  Quantiles `json:"e2e"`
	// ReqPerSec and TokPerSec are completed requests and completion tokens
	// per second of model time, from the first send to the last response.
	ReqPerSec float64 `json:"req_per_sec"`
	TokPerSec float64 `json:"tok_per_sec"`
	// Imbalance is the most requests served by one engine over the mean
	// per engine (every engine of the cluster counts, also idle ones).
	Imbalance float64 `json:"load_imbalance"`
	PerEngine []int   `json:"requests_per_engine"`
	// Queued counts the requests that waited in the relay's queue for an
	// agent with room, and QueueWait is the wait of those (sim mode).
	Queued    int        `json:"queued,omitempty"`
	QueueWait *Quantiles `json:"queue_wait,omitempty"`
	// Decision is the scheduler's own time per request (Pick plus Report,
	// wall clock, in microseconds); sim mode only.
	Decision *Micros `json:"decision_us,omitempty"`
	// Wall is how long the run took in real time.
	Wall time.Duration `json:"wall_ns"`
	// IndexTraffic is what the agents published of their prefix indexes
	// to the relay (live mode).
	IndexTraffic *IndexTraffic `json:"index_traffic,omitempty"`
	// Relays is the number of relays the requests were spread over (0:
	// one); BindingUpdates counts bindings sent between them and
	// BindingBytesPerSec the bytes each relay sent per second of model
	// time (sim: the wire size of the updates).
	Relays             int     `json:"relays,omitempty"`
	BindingUpdates     int64   `json:"binding_updates,omitempty"`
	BindingBytesPerSec float64 `json:"binding_bytes_per_sec,omitempty"`
}

// summarize turns records into a Result.
func summarize(policy, scenario, mode string, recs []record, engines int) Result {
	r := Result{Policy: policy, Scenario: scenario, Mode: mode, Requests: len(recs), PerEngine: make([]int, engines)}
	var ttft, e2e, waits []time.Duration
	var first, last time.Duration = -1, 0
	for _, rc := range recs {
		if rc.waited {
			waits = append(waits, rc.wait)
		}
		if rc.failed {
			r.Errors++
			if r.ErrorCauses == nil {
				r.ErrorCauses = map[string]int{}
			}
			r.ErrorCauses[rc.why]++
			continue
		}
		r.PromptTokens += int64(rc.prompt)
		r.CachedTokens += int64(rc.cached)
		r.OutputTokens += int64(rc.completion)
		ttft = append(ttft, rc.ttft)
		e2e = append(e2e, rc.e2e)
		if rc.engine >= 0 && rc.engine < engines {
			r.PerEngine[rc.engine]++
		}
		if first < 0 || rc.first < first {
			first = rc.first
		}
		last = max(last, rc.done)
	}
	if r.PromptTokens > 0 {
		r.HitRatio = float64(r.CachedTokens) / float64(r.PromptTokens)
	}
	r.TTFT = quantiles(ttft)
	r.E2E = quantiles(e2e)
	if span := (last - first).Seconds(); span > 0 {
		r.ReqPerSec = float64(len(ttft)) / span
		r.TokPerSec = float64(r.OutputTokens) / span
	}
	r.Imbalance = imbalance(r.PerEngine)
	if r.Queued = len(waits); r.Queued > 0 {
		q := quantiles(waits)
		r.QueueWait = &q
	}
	return r
}

// imbalance is max over mean of counts.
func imbalance(counts []int) float64 {
	sum, mx := 0, 0
	for _, n := range counts {
		sum += n
		mx = max(mx, n)
	}
	if sum == 0 {
		return 0
	}
	return float64(mx) / (float64(sum) / float64(len(counts)))
}

// quantiles returns p50, p95 and p99 in milliseconds.
func quantiles(d []time.Duration) Quantiles {
	q := func(p float64) float64 { return float64(percentile(d, p)) / 1e6 }
	return Quantiles{P50: q(0.50), P95: q(0.95), P99: q(0.99)}
}

// percentile sorts v and returns its p-th percentile by nearest rank, the
// one rule of the package's figures; the zero value when v is empty.
func percentile[T cmp.Ordered](v []T, p float64) T {
	if len(v) == 0 {
		var zero T
		return zero
	}
	slices.Sort(v)
	i := int(p*float64(len(v))+0.999999) - 1
	return v[max(0, min(len(v)-1, i))]
}

// median is v's 50th percentile by nearest rank (the lower middle value
// of an even count).
func median[T cmp.Ordered](v []T) T { return percentile(v, .5) }

// Micros are percentiles in microseconds of wall time.
type Micros struct {
	P50 float64 `json:"p50_us"`
	P99 float64 `json:"p99_us"`
}

// Report is a whole benchmark: the workload's oracle and one Result per
// policy.
type Report struct {
	Mode     string `json:"mode"`
	Scenario string `json:"scenario"`
	Workload string `json:"workload"`
	Engines  int    `json:"engines"`
	Sessions int    `json:"sessions"`
	// Turns is the number of requests the workload holds (runs may stop
	// earlier at --requests or --duration).
	Turns int    `json:"workload_requests"`
	Seed  uint64 `json:"seed"`
	// TimeScale is the engines' speed-up in live mode.
	TimeScale float64 `json:"time_scale,omitempty"`
	// Oracle is the workload's best possible hit ratio: one infinite cache
	// that has seen every earlier request (each session always on an engine
	// that holds its history and the shared prefixes).
	Oracle float64 `json:"oracle_hit_ratio"`
	// Pooled is the pooled bound: the hit ratio of one engine with all the
	// engines' caches (and throughput) together, in arrival order; 0 when
	// not computed.
	Pooled float64 `json:"pooled_hit_ratio,omitempty"`
	// Keys lists the key modes run ("with", "without").
	Keys    []string `json:"keys"`
	Results []Result `json:"results"`
}

// StickyShare returns sticky's hit ratio over the oracle's, and false when
// sticky was not run.
func (rp *Report) StickyShare() (float64, bool) {
	for _, r := range rp.Results {
		if strings.HasPrefix(r.Policy, "sticky") && rp.Oracle > 0 {
			return r.HitRatio / rp.Oracle, true
		}
	}
	return 0, false
}

// WriteJSON writes the report as indented JSON.
func (rp *Report) WriteJSON(w io.Writer) error { return writeJSON(w, rp) }

// writeJSON writes v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// WriteTable writes the report as an aligned text table.
func (rp *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "mode %s, scenario %s, workload %s: %d engines, %d sessions, %d requests, seed %d, session keys %s",
		rp.Mode, rp.Scenario, rp.Workload, rp.Engines, rp.Sessions, rp.Turns, rp.Seed, strings.Join(rp.Keys, " and "))
	if rp.TimeScale > 0 {
		fmt.Fprintf(&b, ", time scale %g", rp.TimeScale)
	}
	b.WriteString("\nlatencies in ms of model time")
	if rp.Mode == "live" {
		b.WriteString(" (measured × time scale)")
	}
	b.WriteString("; throughput per second of model time\n\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	hdr := "policy\thit\tof pooled\tttft p50\tp95\tp99\te2e p50\tp99\treq/s\ttok/s\timbalance\terrors\t"
	hasDecision := false
	for _, r := range rp.Results {
		hasDecision = hasDecision || r.Decision != nil
	}
	if hasDecision {
		hdr += "pick+report p50\tp99\t"
	}
	fmt.Fprintln(tw, hdr)
	for _, r := range rp.Results {
		pooled := "-"
		if rp.Pooled > 0 {
			pooled = fmt.Sprintf("%.0f%%", 100*r.HitRatio/rp.Pooled)
		}
		fmt.Fprintf(tw, "%s\t%.1f%%\t%s\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.2f\t%.0f\t%.2f\t%d/%d\t",
			r.Policy, 100*r.HitRatio, pooled, r.TTFT.P50, r.TTFT.P95, r.TTFT.P99, r.E2E.P50, r.E2E.P99,
			r.ReqPerSec, r.TokPerSec, r.Imbalance, r.Errors, r.Requests)
		if r.Decision != nil {
			fmt.Fprintf(tw, "%.2fµs\t%.2fµs\t", r.Decision.P50, r.Decision.P99)
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rp.Results {
		if len(r.ErrorCauses) > 0 {
			fmt.Fprintf(&b, "\n%s errors:", r.Policy)
			for _, k := range slices.Sorted(maps.Keys(r.ErrorCauses)) {
				fmt.Fprintf(&b, " %d× %s;", r.ErrorCauses[k], k)
			}
		}
	}
	for _, r := range rp.Results {
		if r.QueueWait != nil {
			fmt.Fprintf(&b, "\n%s: %d requests waited in the relay's queue, wait p50 %.0f p95 %.0f p99 %.0f ms",
				r.Policy, r.Queued, r.QueueWait.P50, r.QueueWait.P95, r.QueueWait.P99)
		}
	}
	for _, r := range rp.Results {
		if r.Relays > 1 {
			fmt.Fprintf(&b, "\n%s over %d relays: %d binding updates between relays, %.0f bytes/s sent per relay", r.Policy, r.Relays, r.BindingUpdates, r.BindingBytesPerSec)
		}
	}
	b.WriteString("\nwall time per policy:")
	for _, r := range rp.Results {
		fmt.Fprintf(&b, " %s %s", r.Policy, r.Wall.Round(100*time.Millisecond))
	}
	b.WriteString("\n")
	for _, r := range rp.Results {
		if t := r.IndexTraffic; t != nil {
			fmt.Fprintf(&b, "%s prefix index traffic: %d agents, %d bytes, %.0f B/s per agent (max %.0f) of model time\n",
				r.Policy, t.Agents, t.Bytes, t.Mean, t.Max)
		}
	}
	if rp.Pooled > 0 {
		fmt.Fprintf(&b, "pooled bound (one engine with all %d engines' caches together, arrival order): %.1f%%\n", rp.Engines, 100*rp.Pooled)
	}
	fmt.Fprintf(&b, "oracle hit ratio (one infinite cache that has seen every earlier request): %.1f%%\n", 100*rp.Oracle)
	if share, ok := rp.StickyShare(); ok {
		fmt.Fprintf(&b, "sticky reaches %.1f%% of the oracle\n", 100*share)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
