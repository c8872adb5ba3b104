package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/scheduler"
)

// Scenario is what happens to the cluster during a run.
type Scenario int

const (
	// ScenarioSteady: nothing happens.
	ScenarioSteady Scenario = iota
	// ScenarioDegraded: engine 0 becomes 5 times slower halfway through
	// the sessions' arrivals.
	ScenarioDegraded
	// ScenarioFailure: engine 0's agent is killed (its host closes without
	// leaving) a third of the way through the arrivals and comes back, on
	// the same identity and with the engine's cache intact, at two thirds.
	ScenarioFailure
	// ScenarioJoin: the last engine and its agent join halfway through the
	// arrivals, with a cold cache.
	ScenarioJoin
	// ScenarioSkew: a few heavy sessions send most of the requests (chat
	// workload only; see ChatConfig.HeavyShare).
	ScenarioSkew
)

var scenarioNames = [...]string{"steady", "degraded", "failure", "join", "skew"}

// String returns the scenario's name.
func (s Scenario) String() string {
	if s < 0 || int(s) >= len(scenarioNames) {
		return fmt.Sprintf("Scenario(%d)", int(s))
	}
	return scenarioNames[s]
}

// ParseScenario parses a scenario name; "" means steady.
func ParseScenario(s string) (Scenario, error) {
	s = strings.ToLower(strings.TrimSpace(s))
	if s == "" {
		return ScenarioSteady, nil
	}
	if i := slices.Index(scenarioNames[:], s); i >= 0 {
		return Scenario(i), nil
	}
	return 0, fmt.Errorf("unknown scenario %q (want one of %s)", s, strings.Join(scenarioNames[:], ", "))
}

// DefaultSlowdown is the degraded engine's slowdown factor.
const DefaultSlowdown = 5

// action is a scenario event at a model time.
type action struct {
	at     time.Duration
	kind   uint8
	engine int
	factor float64
}

const (
	actSlow uint8 = iota
	actKill
	actRestart
	actJoin
)

// scenarioActions returns the scenario's events, timed on the workload's
// arrival span.
func scenarioActions(sc Scenario, w *Workload, engines int) []action {
	span := w.Span()
	if span <= 0 {
		span = time.Second
	}
	switch sc {
	case ScenarioDegraded:
		return []action{{at: span / 2, kind: actSlow, engine: 0, factor: DefaultSlowdown}}
	case ScenarioFailure:
		return []action{{at: span / 3, kind: actKill, engine: 0}, {at: 2 * span / 3, kind: actRestart, engine: 0}}
	case ScenarioJoin:
		return []action{{at: span / 2, kind: actJoin, engine: engines - 1}}
	}
	return nil
}

// Modes of a benchmark run.
const (
	ModeLive = "live"
	ModeSim  = "sim"
)

// AllPolicies are the policies compared by default, ours first.
var AllPolicies = []scheduler.Policy{
	scheduler.PolicySticky, scheduler.PolicyRoundRobin, scheduler.PolicyRandom,
	scheduler.PolicyLeastLoaded, scheduler.PolicyConsistentHash,
	scheduler.PolicySGLang, scheduler.PolicyDualMap, scheduler.PolicyPrefixHash,
}

// Key modes: whether clients name their sessions.
const (
	// KeysAuto: chat sends its session keys, a trace replay sends none.
	KeysAuto = ""
	// KeysWith: every request carries its session's key (a trace replay
	// infers sessions: a request that extends an earlier one's blocks is
	// its next turn).
	KeysWith = "with"
	// KeysWithout: no request carries a key, as most clients send.
	KeysWithout = "without"
	// KeysBoth runs every policy both ways, side by side.
	KeysBoth = "both"
)

// Config configures a benchmark. The zero value of every field means the
// default in its comment.
type Config struct {
	// Mode is ModeLive (real relay, agents and engines over QUIC on
	// loopback) or ModeSim (discrete-event simulation). Default live.
	Mode string
	// Policies are run in order, each on a fresh cluster. Default
	// AllPolicies.
	Policies []scheduler.Policy
	// Scenario is what happens to the cluster. Default steady.
	Scenario Scenario
	// Engines is the number of engines (each with its agent). Default 4.
	Engines int
	// Seed makes the workload and every random choice repeatable. Default 1.
	Seed uint64
	// Duration stops sending new turns after this much model time (0: run
	// the whole workload).
	Duration time.Duration
	// MaxRequests stops sending after this many requests (0: no limit).
	MaxRequests int
	// Chat shapes the synthetic workload; Chat.Sessions defaults to 30 per
	// engine and Chat.ArrivalSpan to Sessions / (SessionRate × Engines).
	Chat ChatConfig
	// SessionRate is new sessions per second per engine. Default 0.5.
	SessionRate float64
	// TracePath, if set, replays a Mooncake trace instead of the chat
	// workload; TraceLimit keeps its first requests (0: all); Trace
	// shapes the replay.
	TracePath  string
	TraceLimit int
	Trace      TraceConfig
	// Model is the model name engines serve. Default simengine.DefaultModel.
	Model string
	// Engine configures every engine (its Seed is set to Seed so that all
	// engines give the same answers). Zero fields mean simengine's defaults.
	Engine simengine.EngineConfig
	// Capacity is the concurrency each agent announces (0: unlimited;
	// sim: the dispatch limit, see DispatchLimit).
	Capacity int
	// DispatchLimit is, in sim mode, how many requests each agent gives
	// its engine at once, announced to the scheduler as its capacity; the
	// rest wait in the relay's fair queue (simqueue.go). 0 means the
	// engine's batch (Engine.MaxRunning); a positive Capacity replaces
	// it; negative means no queue: every request goes to an engine at
	// once, and fails if Capacity is set and every agent is full.
	DispatchLimit int
	// PrefillLimit is, in sim mode with the queue, the prefill in prompt
	// tokens each agent may have queued from a relay before it is full (as
	// relay.Config.PrefillLimit). 0 means relay.DefaultPrefillLimit;
	// negative means none.
	PrefillLimit int
	// Sweep configures RunSweep (sweep.go); Run ignores it.
	Sweep SweepConfig
	// MaxAttempts is the relay's tries per request. Default 3, as the relay.
	MaxAttempts int
	// Scheduler tunes the scheduler; Policy, Clock and Seed are set per run.
	Scheduler scheduler.Config
	// Keys says whether clients send session keys: KeysAuto (default),
	// KeysWith, KeysWithout or KeysBoth.
	Keys string
	// Prefix cuts prompts into blocks as the relay does (sim mode): the
	// relay's request prefixes and the agents' indexes use it.
	Prefix scheduler.PrefixConfig
	// NoPooled skips the pooled bound's extra simulation.
	NoPooled bool
	// Relays is the number of relays requests are spread over at random
	// (sim: one scheduler per relay sharing bindings as relays do; live:
	// the relaytest cluster with that many real relays, every agent joined
	// to all, steady scenario only). 0 means one relay.
	Relays int
	// PeerDelay is the model time a binding takes from one relay to the
	// others in sim mode. 0 means DefaultPeerDelay.
	PeerDelay time.Duration
	// TimeScale speeds live engines up (live mode). Default 10.
	TimeScale float64
	// Parallel runs the live policies at the same time, each on its own
	// cluster, so that they share whatever else the machine is doing: on a
	// shared machine, sequential runs meet different background load and
	// the time scale magnifies it. Sim runs are always sequential.
	Parallel bool
	// Timeout bounds one live policy run in real time. Default 5 minutes.
	Timeout time.Duration
	// Progress receives a progress line every ProgressEvery (live mode);
	// nil means none. ProgressEvery defaults to 5 s.
	Progress      io.Writer
	ProgressEvery time.Duration

	prefixes bool // sim: compute the relay's request prefixes
}

func (c *Config) populate() {
	if c.Mode == "" {
		c.Mode = ModeLive
	}
	if len(c.Policies) == 0 {
		c.Policies = AllPolicies
	}
	if c.Engines == 0 {
		c.Engines = 4
	}
	if c.Seed == 0 {
		c.Seed = 1
	}
	if c.SessionRate == 0 {
		c.SessionRate = 0.5
	}
	if c.Chat.Sessions == 0 {
		c.Chat.Sessions = 30 * c.Engines
	}
	if c.Chat.ArrivalSpan == 0 && c.SessionRate > 0 {
		c.Chat.ArrivalSpan = time.Duration(float64(c.Chat.Sessions) / (c.SessionRate * float64(c.Engines)) * float64(time.Second))
	}
	if c.Scenario == ScenarioSkew && c.Chat.HeavyShare == 0 {
		c.Chat.HeavyShare = 0.05
	}
	if c.Model == "" {
		c.Model = simengine.DefaultModel
	}
	if c.Engine.BlockSize == 0 {
		c.Engine.BlockSize = simengine.DefaultBlockSize
	}
	if c.PeerDelay <= 0 {
		c.PeerDelay = DefaultPeerDelay
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 3
	}
	if c.TimeScale == 0 {
		c.TimeScale = 10
	}
	if c.Timeout == 0 {
		c.Timeout = 5 * time.Minute
	}
	if c.ProgressEvery == 0 {
		c.ProgressEvery = 5 * time.Second
	}
	c.prefixes = true
}

func (c *Config) validate() error {
	var errs []error
	if c.Mode != ModeLive && c.Mode != ModeSim {
		errs = append(errs, fmt.Errorf("mode %q: want live or sim", c.Mode))
	}
	minEngines := 1
	if c.Scenario == ScenarioJoin || c.Scenario == ScenarioFailure {
		minEngines = 2
	}
	if c.Engines < minEngines {
		errs = append(errs, fmt.Errorf("engines %d: the %s scenario needs at least %d", c.Engines, c.Scenario, minEngines))
	}
	if c.Trace.Clients != "" && c.Trace.Clients != TraceClientsRequest && c.TracePath == "" {
		errs = append(errs, errors.New("trace clients apply to a trace replay (--trace); chat sessions are their clients"))
	}
	if c.Scenario == ScenarioSkew && c.TracePath != "" {
		errs = append(errs, errors.New("the skew scenario shapes the chat workload; it does not apply to a trace"))
	}
	switch c.Keys {
	case KeysAuto, KeysWith, KeysWithout, KeysBoth:
	default:
		errs = append(errs, fmt.Errorf("keys %q: want with, without or both", c.Keys))
	}
	if c.Duration < 0 || c.MaxRequests < 0 || c.Capacity < 0 || c.MaxAttempts < 1 {
		errs = append(errs, errors.New("duration, requests and capacity must not be negative; max attempts at least 1"))
	}
	if c.Relays < 0 || c.Relays > 16 {
		errs = append(errs, fmt.Errorf("relays %d: want 0..16", c.Relays))
	}
	if c.Relays > 0 && c.Mode == ModeLive && c.Scenario != ScenarioSteady {
		errs = append(errs, errRelaysScenario)
	}
	if !(c.TimeScale > 0) || !(c.SessionRate > 0) {
		errs = append(errs, errors.New("time scale and session rate must be positive"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	return nil
}

// Workload builds the workload cfg describes (after defaults), with the
// session keys cfg.Keys says (KeysBoth: with keys).
func (c *Config) Workload() (*Workload, error) {
	ws, err := c.workloads()
	if err != nil {
		return nil, err
	}
	return ws[0].w, nil
}

// keyed is one variant of a workload.
type keyed struct {
	w       *Workload
	keyless bool
}

// workloads returns the workload in each key mode to run.
func (c *Config) workloads() ([]keyed, error) {
	with, without := c.Keys == KeysWith || c.Keys == KeysBoth, c.Keys == KeysWithout || c.Keys == KeysBoth
	if c.Keys == KeysAuto {
		with, without = c.TracePath == "", c.TracePath != ""
	}
	var out []keyed
	if c.TracePath == "" {
		w, err := Chat(c.Chat, c.Seed)
		if err != nil {
			return nil, err
		}
		if with {
			out = append(out, keyed{w, false})
		}
		if without {
			out = append(out, keyed{w.WithoutKeys(), true})
		}
		return out, nil
	}
	f, err := os.Open(c.TracePath)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	defer f.Close()
	recs, err := ReadTrace(f, c.TraceLimit)
	if err != nil {
		return nil, err
	}
	for _, keyless := range []bool{false, true} {
		if (keyless && !without) || (!keyless && !with) {
			continue
		}
		tc := c.Trace
		tc.Keyless = keyless
		w, err := TraceWorkload(recs, tc, c.Seed)
		if err != nil {
			return nil, err
		}
		out = append(out, keyed{w, keyless})
	}
	return out, nil
}

// Run builds the workload and runs every policy on it, each on a fresh
// cluster, and returns the report.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ws, err := cfg.workloads()
	if err != nil {
		return nil, err
	}
	w := ws[0].w
	rp := &Report{
		Mode: cfg.Mode, Scenario: cfg.Scenario.String(), Workload: w.Name, Engines: cfg.Engines,
		Sessions: len(w.Sessions), Turns: w.Requests(), Seed: cfg.Seed,
		Oracle: Oracle(w, cfg.Engine.BlockSize),
	}
	for _, k := range ws {
		if k.keyless {
			rp.Keys = append(rp.Keys, KeysWithout)
			rp.Sessions = len(k.w.Sessions) // as the scheduler sees them: none inferred
		} else {
			rp.Keys = append(rp.Keys, KeysWith)
		}
	}
	if cfg.Mode == ModeLive {
		rp.TimeScale = cfg.TimeScale
	}
	type job struct {
		w     *Workload
		p     scheduler.Policy
		label string
	}
	var jobs []job
	for _, k := range ws {
		for _, p := range cfg.Policies {
			label := p.String()
			if len(ws) > 1 {
				label += map[bool]string{false: "/keys", true: "/no-keys"}[k.keyless]
			}
			jobs = append(jobs, job{k.w, p, label})
		}
	}
	rp.Results = make([]Result, len(jobs))
	errs := make([]error, len(jobs))
	run := func(i int) {
		j := jobs[i]
		var err error
		if cfg.Mode == ModeSim {
			rp.Results[i], err = runSim(ctx, &cfg, j.w, j.p)
		} else {
			rp.Results[i], err = runLive(ctx, &cfg, j.w, j.p)
		}
		rp.Results[i].Policy = j.label
		if err != nil {
			errs[i] = fmt.Errorf("bench: %s: %w", j.label, err)
		} else if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, "bench %s %s %s: %d requests in %s\n",
				cfg.Mode, j.label, cfg.Scenario, rp.Results[i].Requests, rp.Results[i].Wall.Round(time.Millisecond))
		}
	}
	if cfg.Parallel && cfg.Mode == ModeLive {
		var wg sync.WaitGroup
		for i := range jobs {
			wg.Go(func() { run(i) })
		}
		wg.Wait()
	} else {
		for i := range jobs {
			if run(i); errs[i] != nil {
				break
			}
		}
	}
	if !cfg.NoPooled && errors.Join(errs...) == nil {
		if p, err := pooledBound(ctx, &cfg, w); err != nil {
			errs = append(errs, fmt.Errorf("bench: pooled bound: %w", err))
		} else {
			rp.Pooled = p
		}
	}
	if err := errors.Join(errs...); err != nil {
		return rp, err
	}
	return rp, nil
}

// pooledBound simulates one engine whose cache, batch, queue and prompt
// throughput are those of all cfg.Engines together, in arrival order: the
// hit ratio no placement over the separate engines can beat except by luck
// of eviction order.
func pooledBound(ctx context.Context, cfg *Config, w *Workload) (float64, error) {
	c := *cfg
	n := c.Engines
	c.Engines = 1
	c.Scenario = ScenarioSteady
	c.prefixes = false
	ec := &c.Engine
	ec.CacheBlocks = n * orDefault(ec.CacheBlocks, simengine.DefaultCacheBlocks)
	ec.MaxRunning = n * orDefault(ec.MaxRunning, simengine.DefaultMaxRunning)
	ec.MaxQueue = n * orDefault(ec.MaxQueue, simengine.DefaultMaxQueue)
	if ec.PrefillTokensPerSec == 0 {
		ec.PrefillTokensPerSec = simengine.DefaultPrefillTokensPerSec
	}
	ec.PrefillTokensPerSec *= float64(n)
	res, err := runSim(ctx, &c, w, scheduler.PolicyRoundRobin)
	if err != nil {
		return 0, err
	}
	return res.HitRatio, nil
}

func orDefault(v, d int) int {
	if v == 0 {
		return d
	}
	return v
}
