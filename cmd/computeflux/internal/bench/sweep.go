package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/scheduler"
)

// The capacity sweep: a trace replayed in the simulation at rising speeds
// (TraceConfig.Speed), each policy on its own, to find the highest speed
// at which the time to first token's 90th percentile stays within an SLO,
// with the goodput (requests and tokens per second that met the SLO) at
// every speed tried. A request that fails (the relay's queue answered 429)
// counts as one that missed the SLO. The search (rateSearch) doubles the
// speed from Start while the SLO holds, halves it while it does not, then
// bisects the bracket (geometrically) Bisect times: a bounded number of
// runs per policy, about 9% apart at the end with the defaults.

// Defaults of SweepConfig's zero values.
const (
	// DefaultSLO bounds the time to first token's 90th percentile. With
	// the simulated engine's defaults (25,000 prompt tokens a second), the
	// Mooncake conversation trace's 90th-percentile prompt (27,367 tokens)
	// takes 1.1 s to prefill cold on an idle engine: 2 s lets such a
	// request wait behind about one more prompt of its size, or find part
	// of its prompt cached, and no more.
	DefaultSLO = 2 * time.Second
	// DefaultSweepStart is the first speed tried.
	DefaultSweepStart = 1.0
	// DefaultSweepMax bounds the doubling: 7 runs from 1.
	DefaultSweepMax = 64.0
	// DefaultSweepBisect is the bisections of the last bracket.
	DefaultSweepBisect = 3
	// sweepHalvings bounds the halving below Start.
	sweepHalvings = 4
	// sweepClose stops bisecting a bracket narrower than this ratio.
	sweepClose = 1.05
)

// SweepConfig configures RunSweep. The zero value of every field but
// Enabled means its default.
type SweepConfig struct {
	// Enabled asks the command for a sweep instead of a Run.
	Enabled bool
	// SLO bounds the time to first token's 90th percentile. Default
	// DefaultSLO.
	SLO time.Duration
	// Start is the first speed tried. Default 1.
	Start float64
	// Max is the highest speed tried. Default 64.
	Max float64
	// Bisect is how many times the last bracket is bisected. Default 3;
	// negative means none.
	Bisect int
}

func (c *SweepConfig) populate() {
	c.SLO = cmp.Or(c.SLO, DefaultSLO)
	c.Start = cmp.Or(c.Start, DefaultSweepStart)
	c.Max = cmp.Or(c.Max, DefaultSweepMax)
	c.Bisect = max(cmp.Or(c.Bisect, DefaultSweepBisect), 0) // negative: none
}

func (c *SweepConfig) validate() error {
	if c.SLO < 0 || !(c.Start > 0) || math.IsInf(c.Start, 0) || !(c.Max >= c.Start) || math.IsInf(c.Max, 0) {
		return fmt.Errorf("bench: sweep: slo %v must be positive and speeds 0 < start %v <= max %v", c.SLO, c.Start, c.Max)
	}
	return nil
}

// rateSearch finds the highest speed at which runs hold the SLO. It is
// pure: next says which speed to run, record what the run showed. The
// answer is the highest speed that held below the lowest that did not,
// so a run that holds above one that failed (noise near the edge) is not
// taken at its word.
type rateSearch struct {
	start, max, min float64
	bisect          int
	bisected        int
	tried           []ratePoint
}

type ratePoint struct {
	speed float64
	held  bool
}

func newRateSearch(start, maxSpeed float64, bisect int) *rateSearch {
	return &rateSearch{start: start, max: maxSpeed, min: start / (1 << sweepHalvings), bisect: bisect}
}

// bracket returns the highest speed held below the lowest that failed,
// and that lowest failure; 0 for either when there is none.
func (s *rateSearch) bracket() (held, failed float64) {
	for _, p := range s.tried {
		if !p.held && (failed == 0 || p.speed < failed) {
			failed = p.speed
		}
	}
	for _, p := range s.tried {
		if p.held && (failed == 0 || p.speed < failed) {
			held = max(held, p.speed)
		}
	}
	return held, failed
}

// next returns the next speed to run, or false when the search is over.
func (s *rateSearch) next() (float64, bool) {
	held, failed := s.bracket()
	switch {
	case len(s.tried) == 0:
		return s.start, true
	case failed == 0: // every run held: double
		if held >= s.max {
			return 0, false
		}
		return min(2*held, s.max), true
	case held == 0: // none held: halve
		if failed <= s.min {
			return 0, false
		}
		return max(failed/2, s.min), true
	case s.bisected >= s.bisect || failed/held < sweepClose:
		return 0, false
	}
	return math.Sqrt(held * failed), true
}

// record takes the outcome of the run at speed.
func (s *rateSearch) record(speed float64, held bool) {
	if h, f := s.bracket(); h > 0 && f > 0 {
		s.bisected++
	}
	s.tried = append(s.tried, ratePoint{speed, held})
}

// SweepPoint is one policy's run at one speed.
type SweepPoint struct {
	// Speed divides the trace's arrival times.
	Speed float64 `json:"speed"`
	// Offered is the requests per second sent: the requests over the
	// span of their arrivals.
	Offered float64 `json:"offered_req_per_sec"`
	// TTFT is over every request, a failed one counting as over any
	// bound (-1 in JSON, "fail" in tables).
	TTFT TTFTQuantiles `json:"ttft"`
	// Queued counts the requests that waited in the relay's queue;
	// QueueWaitP90 is the 90th percentile of the wait over all requests.
	// PrefillWaitP90 is that of the time a completed request waited in
	// its engine for the prompts ahead of it: its time to first token
	// less its relay wait and its own prefill at the engine's speed.
	Queued         int     `json:"queued"`
	QueueWaitP90   float64 `json:"queue_wait_p90_ms"`
	PrefillWaitP90 float64 `json:"prefill_wait_p90_ms"`
	HitRatio       float64 `json:"hit_ratio"`
	// ReqPerSec is completed requests per second, from the first send to
	// the last response; GoodReqPerSec and GoodTokPerSec count only the
	// requests whose first token came within the SLO (completion tokens).
	ReqPerSec     float64 `json:"req_per_sec"`
	GoodReqPerSec float64 `json:"goodput_req_per_sec"`
	GoodTokPerSec float64 `json:"goodput_tok_per_sec"`
	Requests      int     `json:"requests"`
	Errors        int     `json:"errors"`
	// Held is true when TTFT.P90 is within the SLO.
	Held bool `json:"held"`
}

// TTFTQuantiles are times to first token in milliseconds of model time;
// -1 stands for a failed request.
type TTFTQuantiles struct {
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	P99 float64 `json:"p99_ms"`
}

// SweepResult is one policy's sweep.
type SweepResult struct {
	Policy string       `json:"policy"`
	Points []SweepPoint `json:"points"` // by speed
	// MaxSpeed is the highest speed that held the SLO below the lowest
	// that did not (0: none held); MaxOffered its requests per second.
	// FailedSpeed is that lowest failure (0: every speed held).
	MaxSpeed    float64       `json:"max_speed"`
	MaxOffered  float64       `json:"max_offered_req_per_sec"`
	FailedSpeed float64       `json:"failed_speed"`
	Wall        time.Duration `json:"wall_ns"`
}

// SweepReport is a whole sweep.
type SweepReport struct {
	Workload      string  `json:"workload"`
	Requests      int     `json:"requests"`
	Engines       int     `json:"engines"`
	DispatchLimit int     `json:"dispatch_limit"` // per agent; 0: none
	SLO           float64 `json:"slo_ttft_p90_ms"`
	Seed          uint64  `json:"seed"`
	Keys          string  `json:"keys"`
	Clients       string  `json:"clients"` // TraceClientsRequest or TraceClientsConversation
	Scenario      string  `json:"scenario"`
	// Policies are in the order run.
	Policies []SweepResult `json:"policies"`
}

// RunSweep replays cfg's trace at rising speeds for each policy (sim
// mode) and returns the report.
func RunSweep(ctx context.Context, cfg Config) (*SweepReport, error) {
	cfg.populate()
	sc := cfg.Sweep
	sc.populate()
	var errs []error
	if cfg.Mode != ModeSim {
		errs = append(errs, errors.New("the sweep runs in sim mode (--mode sim)"))
	}
	if cfg.TracePath == "" {
		errs = append(errs, errors.New("the sweep replays a trace (--trace)"))
	}
	if cfg.Keys == KeysBoth {
		errs = append(errs, errors.New("the sweep runs one key mode (--keys with or without)"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := sc.validate(); err != nil {
		return nil, err
	}
	f, err := os.Open(cfg.TracePath)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	recs, err := ReadTrace(f, cfg.TraceLimit)
	f.Close()
	if err != nil {
		return nil, err
	}
	tc := cfg.Trace
	tc.Keyless = cfg.Keys != KeysWith
	rp := &SweepReport{Engines: cfg.Engines, SLO: float64(sc.SLO) / 1e6, Seed: cfg.Seed,
		Keys: map[bool]string{true: KeysWithout, false: KeysWith}[tc.Keyless], Clients: cmp.Or(tc.Clients, TraceClientsRequest), Scenario: cfg.Scenario.String()}
	workloads := map[float64]*Workload{} // by speed, shared by the policies
	prefillRate := cfg.Engine.PrefillTokensPerSec
	if prefillRate == 0 {
		prefillRate = simengine.DefaultPrefillTokensPerSec
	}
	runs := make([]sweepRun, 0, len(cfg.Policies)+1)
	for _, p := range cfg.Policies {
		runs = append(runs, sweepRun{policy: p, label: p.String(), cfg: cfg})
	}
	if slices.Contains(cfg.Policies, scheduler.PolicyRoundRobin) && cfg.DispatchLimit >= 0 {
		// The baseline a load balancer gives: round-robin, every request
		// sent to its engine at once.
		at := cfg
		at.DispatchLimit, at.Capacity = -1, 0
		runs = append(runs, sweepRun{policy: scheduler.PolicyRoundRobin, label: AtOnceLabel, cfg: at})
	}
	for _, run := range runs {
		p := run.policy
		wall := time.Now()
		res := SweepResult{Policy: run.label}
		s := newRateSearch(sc.Start, sc.Max, sc.Bisect)
		for {
			speed, ok := s.next()
			if !ok {
				break
			}
			w := workloads[speed]
			if w == nil {
				tc.Speed = speed
				if w, err = TraceWorkload(recs, tc, cfg.Seed); err != nil {
					return nil, err
				}
				workloads[speed] = w
				rp.Workload, rp.Requests = w.Name, w.Requests()
			}
			c := run.cfg
			r, recs, err := simulate(ctx, &c, w, p)
			if err != nil {
				return nil, fmt.Errorf("bench: sweep: %s at speed %g: %w", run.label, speed, err)
			}
			pt := sweepPoint(r, recs, sc.SLO, prefillRate)
			pt.Speed = speed
			if span := lastArrival(w); span > 0 {
				pt.Offered = float64(w.Requests()) / span.Seconds()
			}
			s.record(speed, pt.Held)
			res.Points = append(res.Points, pt)
			if cfg.Progress != nil {
				fmt.Fprintf(cfg.Progress, "bench sweep %s at speed %.3g (%.2f req/s): ttft p90 %s ms, goodput %.2f req/s, %s\n",
					run.label, speed, pt.Offered, cell(pt.TTFT.P90), pt.GoodReqPerSec, map[bool]string{true: "holds", false: "misses"}[pt.Held])
			}
		}
		slices.SortFunc(res.Points, func(a, b SweepPoint) int { return cmp.Compare(a.Speed, b.Speed) })
		res.MaxSpeed, res.FailedSpeed = s.bracket()
		for _, pt := range res.Points {
			if pt.Speed == res.MaxSpeed {
				res.MaxOffered = pt.Offered
			}
		}
		res.Wall = time.Since(wall)
		rp.Policies = append(rp.Policies, res)
	}
	rp.DispatchLimit = cfg.dispatchLimit()
	return rp, nil
}

// AtOnceLabel names the sweep's baseline run: round-robin with no queue at
// the relay, each request sent to its engine as it arrives, as a load
// balancer in front of the engines does.
const AtOnceLabel = "round-robin, at once"

// sweepRun is one policy's sweep to run: its label and configuration.
type sweepRun struct {
	policy scheduler.Policy
	label  string
	cfg    Config
}

// failedTTFT stands for a failed request's time to first token: over any
// bound.
const failedTTFT = time.Duration(math.MaxInt64)

// sweepPoint measures one run against the SLO, on engines that prefill
// prefillRate tokens a second.
func sweepPoint(r Result, recs []record, slo time.Duration, prefillRate float64) SweepPoint {
	pt := SweepPoint{HitRatio: r.HitRatio, ReqPerSec: r.ReqPerSec, Requests: r.Requests, Errors: r.Errors, Queued: r.Queued}
	ttft := make([]time.Duration, 0, len(recs))
	waits := make([]time.Duration, 0, len(recs))
	var prefillWaits []time.Duration
	var good, goodTok int
	var first, last time.Duration = -1, 0
	for _, rc := range recs {
		waits = append(waits, rc.wait)
		if rc.failed {
			ttft = append(ttft, failedTTFT)
			continue
		}
		ttft = append(ttft, rc.ttft)
		own := time.Duration(float64(rc.prompt-rc.cached) / prefillRate * float64(time.Second))
		prefillWaits = append(prefillWaits, max(rc.ttft-rc.wait-own, 0))
		if rc.ttft <= slo {
			good++
			goodTok += rc.completion
		}
		if first < 0 || rc.first < first {
			first = rc.first
		}
		last = max(last, rc.done)
	}
	if span := (last - first).Seconds(); span > 0 {
		pt.GoodReqPerSec = float64(good) / span
		pt.GoodTokPerSec = float64(goodTok) / span
	}
	ms := func(p float64) float64 {
		d := percentile(ttft, p)
		if d == failedTTFT {
			return -1
		}
		return float64(d) / 1e6
	}
	pt.TTFT = TTFTQuantiles{P50: ms(.5), P90: ms(.9), P99: ms(.99)}
	pt.QueueWaitP90 = float64(percentile(waits, .9)) / 1e6
	pt.PrefillWaitP90 = float64(percentile(prefillWaits, .9)) / 1e6
	pt.Held = pt.TTFT.P90 >= 0 && len(recs) > 0 && percentile(ttft, .9) <= slo
	return pt
}

// lastArrival returns the send time of an open-loop workload's last
// request.
func lastArrival(w *Workload) time.Duration {
	var last time.Duration
	for _, s := range w.Sessions {
		for _, t := range s.Turns {
			last = max(last, t.At)
		}
	}
	return last
}

// WriteJSON writes the report as indented JSON.
func (rp *SweepReport) WriteJSON(w io.Writer) error { return writeJSON(w, rp) }

// WriteTable writes every run, then each policy's highest speed held and
// its ratio to round-robin's.
func (rp *SweepReport) WriteTable(w io.Writer) error {
	var b strings.Builder
	limit := "none (no queue)"
	if rp.DispatchLimit > 0 {
		limit = fmt.Sprintf("%d per agent, the rest wait in the relay's fair queue", rp.DispatchLimit)
	}
	fmt.Fprintf(&b, "capacity sweep, sim, scenario %s, workload %s: %d requests, %d engines, seed %d, session keys %s, a client per %s\n",
		rp.Scenario, rp.Workload, rp.Requests, rp.Engines, rp.Seed, rp.Keys, cmp.Or(rp.Clients, TraceClientsRequest))
	fmt.Fprintf(&b, "dispatch limit %s; SLO: TTFT p90 <= %.0f ms (a failed request misses it)\n", limit, rp.SLO)
	b.WriteString("latencies in ms of model time; rates per second of model time; queued: requests that waited at the relay, wait p90\n")
	b.WriteString("over all requests; prefill wait: time in the engine behind other prompts; goodput: requests whose first token met the SLO\n\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tspeed\toffered req/s\tttft p50\tp90\tp99\tqueued\twait p90\tprefill wait p90\thit\treq/s\tgoodput req/s\tgood tok/s\terrors\tSLO\t")
	for _, r := range rp.Policies {
		for _, pt := range r.Points {
			fmt.Fprintf(tw, "%s\t%.3g\t%.2f\t%s\t%s\t%s\t%d\t%.0f\t%.0f\t%.1f%%\t%.2f\t%.2f\t%.0f\t%d/%d\t%s\t\n",
				r.Policy, pt.Speed, pt.Offered, cell(pt.TTFT.P50), cell(pt.TTFT.P90), cell(pt.TTFT.P99),
				pt.Queued, pt.QueueWaitP90, pt.PrefillWaitP90, 100*pt.HitRatio, pt.ReqPerSec, pt.GoodReqPerSec, pt.GoodTokPerSec,
				pt.Errors, pt.Requests, map[bool]string{true: "held", false: "missed"}[pt.Held])
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	var rr, once float64
	for _, r := range rp.Policies {
		switch r.Policy {
		case scheduler.PolicyRoundRobin.String():
			rr = r.MaxSpeed
		case AtOnceLabel:
			once = r.MaxSpeed
		}
	}
	fmt.Fprintf(&b, "\nhighest speed holding TTFT p90 <= %.0f ms (the next speed tried missed it):\n\n", rp.SLO)
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tspeed\treq/s\tmissed at\tvs round-robin\tvs at once\truns\twall\t")
	for _, r := range rp.Policies {
		ratio, vsOnce, missed := "-", "-", "-"
		if rr > 0 {
			ratio = fmt.Sprintf("%.2fx", r.MaxSpeed/rr)
		}
		if once > 0 {
			vsOnce = fmt.Sprintf("%.2fx", r.MaxSpeed/once)
		}
		if r.FailedSpeed > 0 {
			missed = fmt.Sprintf("%.3g", r.FailedSpeed)
		}
		held := fmt.Sprintf("%.3g", r.MaxSpeed)
		if r.MaxSpeed == 0 {
			held = "none"
		}
		fmt.Fprintf(tw, "%s\t%s\t%.2f\t%s\t%s\t%s\t%d\t%s\t\n", r.Policy, held, r.MaxOffered, missed, ratio, vsOnce,
			len(r.Points), r.Wall.Round(100*time.Millisecond))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// cell formats a TTFTQuantiles figure.
func cell(ms float64) string {
	if ms < 0 {
		return "fail"
	}
	return fmt.Sprintf("%.0f", ms)
}
