package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
	"github.com/computeflux/computeflux/scheduler"
)

// runBench compares routing policies on one workload and prints the table
// (or JSON) for each scenario asked for.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	switch liveScenario(args) {
	case "chaos":
		return runBenchChaos(ctx, args, stdout, stderr)
	case "soak":
		return runBenchSoak(ctx, args, stdout, stderr)
	case "overload":
		return runBenchOverload(ctx, args, stdout, stderr)
	case "audit":
		return runBenchAudit(ctx, args, stdout, stderr)
	}
	if rest, ok := cutOverhead(args); ok {
		return runOverhead(ctx, rest, stdout, stderr)
	}
	cfg, scenarios, asJSON, plot, err := benchConfig(args, stderr)
	if err != nil {
		return err
	}
	if cfg.Sweep.Enabled {
		return runSweep(ctx, cfg, scenarios, asJSON, plot, stdout)
	}
	var reports []*bench.Report
	for _, sc := range scenarios {
		c := cfg
		c.Scenario = sc
		rp, err := bench.Run(ctx, c)
		if err != nil {
			return err
		}
		reports = append(reports, rp)
		if !asJSON {
			if len(reports) > 1 {
				fmt.Fprintln(stdout)
			}
			if err := rp.WriteTable(stdout); err != nil {
				return err
			}
		}
	}
	if plot != "" {
		if err := writePlotFile(plot, reports); err != nil {
			return err
		}
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(reports)
	}
	return nil
}

// benchConfig turns the command line into a bench.Config and the list of
// scenarios to run.
func benchConfig(args []string, stderr io.Writer) (bench.Config, []bench.Scenario, bool, string, error) {
	var cfg bench.Config
	var policies, scenarios string
	var asJSON, quiet bool
	var plot string
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: computeflux bench [flags]")
		fmt.Fprintln(stderr, "\nRuns one workload through each routing policy, each on a fresh cluster with the same seed,")
		fmt.Fprintln(stderr, "and prints cache hit ratio, TTFT, end-to-end latency, throughput, load imbalance and errors.")
		fmt.Fprintln(stderr, "live: real relay, agents and sim engines over QUIC on loopback; sim: discrete-event simulation.")
		fmt.Fprintln(stderr, "\nFlags:")
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.Mode, "mode", bench.ModeLive, "`live` (relay, agents, engines on loopback) or sim (discrete-event simulation)")
	fs.StringVar(&policies, "policies", "all", "comma-separated `policies`: sticky, round-robin, random, least-loaded, consistent-hash, sglang, dualmap, prefix-hash, or all")
	fs.StringVar(&cfg.Keys, "keys", "", "whether clients send session keys: with, without, or both side by side (default: chat with, trace replays without, inferring no sessions)")
	fs.BoolVar(&cfg.NoPooled, "no-pooled", false, "skip the pooled bound (one engine with all caches together), an extra simulation")
	fs.StringVar(&scenarios, "scenario", "steady", "comma-separated `scenarios`: steady, degraded, failure, join, skew, or all; or chaos or soak alone (real processes, see --scenario chaos -h, --scenario soak -h)")
	fs.IntVar(&cfg.Engines, "engines", 4, "number of engines, each with its agent")
	fs.IntVar(&cfg.Relays, "relays", 0, "relays the requests are spread over at random (sim: schedulers sharing session bindings as relays do; live: real relays, every agent joined to all; 0: one relay)")
	fs.DurationVar(&cfg.PeerDelay, "peer-delay", 0, "sim: model time a session binding takes to reach the other relays (default 15ms)")
	var keyless bool
	fs.BoolVar(&keyless, "keyless", false, "deprecated spelling of --keys without")
	fs.IntVar(&cfg.Chat.Sessions, "sessions", 0, "chat sessions (default 30 per engine)")
	fs.DurationVar(&cfg.Duration, "duration", 0, "send no new turn after this much model time (0: the whole workload)")
	fs.IntVar(&cfg.MaxRequests, "requests", 0, "send at most this many requests (0: the whole workload)")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the workload and of every random choice")
	fs.StringVar(&cfg.TracePath, "trace", "", "replay this Mooncake trace `file` instead of synthetic chat")
	fs.IntVar(&cfg.TraceLimit, "trace-limit", 0, "replay only the trace's first N requests (0: all)")
	fs.Float64Var(&cfg.Trace.Speed, "trace-speed", 1, "replay the trace's arrivals this many times faster")
	fs.IntVar(&cfg.Trace.MaxOutput, "trace-max-output", 0, "cap the trace's answer lengths (0: none)")
	fs.StringVar(&cfg.Trace.Clients, "trace-clients", bench.TraceClientsRequest, "who the relay's fair queue sees as a client in a trace replay: each request, or each conversation (one user, one API key), keys or none")
	fs.Float64Var(&cfg.TimeScale, "time-scale", 10, "live: run the engines this many times faster than real time")
	fs.BoolVar(&cfg.Parallel, "parallel", false, "live: run the policies at the same time, each on its own cluster (fairer on a busy machine)")
	fs.DurationVar(&cfg.Timeout, "timeout", 0, "live: bound on one policy's run in real time (default 5m)")
	fs.BoolVar(&asJSON, "json", false, "print JSON instead of tables")
	fs.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	fs.StringVar(&plot, "plot", "", "also write an SVG chart to this `file`: each policy's time to first token (p50, p95, p99), or with --sweep its TTFT p90 against the rate offered")
	// Workload knobs.
	fs.Float64Var(&cfg.SessionRate, "session-rate", 0.5, "new chat sessions per second (model time) per engine")
	fs.IntVar(&cfg.Chat.SystemTokens, "system-tokens", 2000, "length of the system prompt all sessions share")
	fs.Float64Var(&cfg.Chat.MeanTurns, "turns", 5, "mean turns per session (geometric)")
	fs.IntVar(&cfg.Chat.MaxTurns, "max-turns", 16, "most turns of a session")
	fs.IntVar(&cfg.Chat.QuestionTokens, "question-tokens", 120, "median user message length (log-normal)")
	fs.IntVar(&cfg.Chat.AnswerTokens, "answer-tokens", 250, "median answer length (log-normal)")
	fs.DurationVar(&cfg.Chat.Think, "think", 0, "median pause between a response and the next turn (default 12s)")
	fs.Float64Var(&cfg.Chat.HeavyShare, "heavy-share", 0, "share of heavy sessions (default 0, or 0.05 in the skew scenario)")
	// Cluster knobs.
	fs.IntVar(&cfg.Engine.CacheBlocks, "cache-blocks", simengine.DefaultCacheBlocks, "each engine's prefix cache in 16-token blocks")
	fs.Float64Var(&cfg.Engine.PrefillTokensPerSec, "prefill-tokens-per-sec", simengine.DefaultPrefillTokensPerSec, "each engine's prompt throughput")
	fs.IntVar(&cfg.Engine.MaxRunning, "max-running", simengine.DefaultMaxRunning, "sequences each engine batches")
	fs.IntVar(&cfg.Capacity, "capacity", 0, "concurrency each agent announces to the scheduler (0: unlimited; sim: replaces --dispatch-limit)")
	fs.IntVar(&cfg.PrefillLimit, "prefill-limit", 0, "sim: prompt tokens of prefill each agent may have queued before the rest wait in the relay's queue (0: the relay's default, 16384; -1: none)")
	fs.IntVar(&cfg.DispatchLimit, "dispatch-limit", 0, "sim: requests each agent gives its engine at once; the rest wait in the relay's fair queue (0: the engine's batch, --max-running; -1: none, and no queue)")
	// The capacity sweep (sweep.go, benchsweep.go).
	fs.BoolVar(&cfg.Sweep.Enabled, "sweep", false, "sim, with --trace: replay the trace at rising speeds and report each policy's highest speed whose TTFT p90 holds --slo, with the goodput at each speed tried")
	fs.DurationVar(&cfg.Sweep.SLO, "slo", bench.DefaultSLO, "--sweep: the bound on TTFT p90; 2s is twice the time the conversation trace's p90 prompt takes to prefill cold on an idle default engine")
	fs.Float64Var(&cfg.Sweep.Start, "sweep-start", bench.DefaultSweepStart, "--sweep: the first trace speed; doubled while the SLO holds, halved while it does not")
	fs.Float64Var(&cfg.Sweep.Max, "sweep-max", bench.DefaultSweepMax, "--sweep: the highest trace speed tried")
	fs.IntVar(&cfg.Sweep.Bisect, "sweep-bisect", bench.DefaultSweepBisect, "--sweep: bisections of the last bracket of speeds (-1: none)")
	if err := fs.Parse(args); err != nil {
		return cfg, nil, false, "", err
	}
	if fs.NArg() > 0 {
		return cfg, nil, false, "", fmt.Errorf("bench: unexpected arguments %q", fs.Args())
	}
	if keyless {
		if cfg.Keys != bench.KeysAuto && cfg.Keys != bench.KeysWithout {
			return cfg, nil, false, "", fmt.Errorf("bench: --keyless contradicts --keys %s", cfg.Keys)
		}
		cfg.Keys = bench.KeysWithout
	}
	if policies != "all" && policies != "" {
		for _, s := range strings.Split(policies, ",") {
			p, err := scheduler.ParsePolicy(s)
			if err != nil {
				return cfg, nil, false, "", fmt.Errorf("bench: --policies: %w", err)
			}
			cfg.Policies = append(cfg.Policies, p)
		}
	}
	var scs []bench.Scenario
	if scenarios == "all" {
		scenarios = "steady,degraded,failure,join,skew"
	}
	for _, s := range strings.Split(scenarios, ",") {
		sc, err := bench.ParseScenario(s)
		if err != nil {
			return cfg, nil, false, "", fmt.Errorf("bench: --scenario: %w", err)
		}
		scs = append(scs, sc)
	}
	if !quiet {
		cfg.Progress = stderr
	}
	return cfg, scs, asJSON, plot, nil
}

// cutOverhead reports whether args ask for the overhead benchmark
// (--overhead) and returns them without that flag.
func cutOverhead(args []string) ([]string, bool) {
	for i, a := range args {
		if a == "--" {
			break
		}
		switch a {
		case "-overhead", "--overhead", "-overhead=true", "--overhead=true":
			return append(slices.Clone(args[:i]), args[i+1:]...), true
		}
	}
	return args, false
}

// runOverhead measures the relay path against direct (and frp, when its
// binaries are named) and prints the table or JSON.
func runOverhead(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var cfg bench.OverheadConfig
	var asJSON, quiet bool
	fs := flag.NewFlagSet("bench --overhead", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&cfg.Sequential, "requests", 2000, "sequential requests per kind (small, stream) and path, per round")
	fs.IntVar(&cfg.Concurrent, "concurrent-requests", 10000, "small requests per path at --clients clients, per round")
	fs.IntVar(&cfg.Clients, "clients", 32, "concurrent clients")
	fs.IntVar(&cfg.Rounds, "rounds", 3, "rounds; the table shows medians")
	fs.StringVar(&cfg.LogLevel, "log-level", "info", "relay's and agent's --log-level")
	fs.StringVar(&cfg.Binary, "binary", "", "computeflux `binary` to run as relay and agent (default: this one)")
	fs.StringVar(&cfg.BaseBinary, "base-binary", "", "a second computeflux `binary` timed in the same run (before/after a change)")
	var relayArgs, baseRelayArgs string
	fs.StringVar(&relayArgs, "relay-args", "", "space-separated `flags` added to the relay's command line (e.g. --ledger-file=/tmp/usage.db)")
	fs.StringVar(&baseRelayArgs, "base-relay-args", "", "space-separated `flags` added to the --base-binary relay's command line")
	fs.StringVar(&cfg.FRPS, "frps", "", "frps `binary` (default $"+bench.EnvFRPS+")")
	fs.StringVar(&cfg.FRPC, "frpc", "", "frpc `binary` (default $"+bench.EnvFRPC+")")
	fs.StringVar(&cfg.ProfileDir, "profile", "", "write CPU and allocation profiles of relay and agent under load to this `dir`")
	fs.IntVar(&cfg.ProfileSeconds, "profile-seconds", 10, "length of the CPU profiles")
	fs.BoolVar(&asJSON, "json", false, "print JSON instead of a table")
	fs.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	var proxyListen, proxyUpstream string
	fs.StringVar(&proxyListen, "serve-reverse-proxy", "", "serve only Go's httputil.ReverseProxy on this `addr` (the benchmark's one-hop baseline, run as its own process)")
	fs.StringVar(&proxyUpstream, "upstream", "", "with --serve-reverse-proxy or --serve-stock-floor-agent: the engine's `URL`")
	var floorRelay, floorAgent, floorAddrFile string
	fs.StringVar(&floorRelay, "serve-stock-floor-relay", "", "serve only the relay side of the stock-floor baseline on this loopback `addr` (run as its own process)")
	fs.StringVar(&floorAddrFile, "addr-file", "", "with --serve-stock-floor-relay: write its libp2p multiaddr to this `file`")
	fs.StringVar(&floorAgent, "serve-stock-floor-agent", "", "serve only the agent side of the stock-floor baseline, dialing the relay side at this loopback `multiaddr`")
	// The benchmark runs itself with these to serve its baselines; users
	// have no use for them, so usage leaves them out.
	hidden := map[string]bool{"serve-reverse-proxy": true, "upstream": true, "serve-stock-floor-relay": true, "addr-file": true, "serve-stock-floor-agent": true}
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: computeflux bench --overhead [flags]")
		fmt.Fprintln(stderr, "\nMeasures what the relay path costs: a stub engine that answers at once, reached directly,")
		fmt.Fprintln(stderr, "through frp (when "+bench.EnvFRPS+" and "+bench.EnvFRPC+" name its binaries) and through a relay")
		fmt.Fprintln(stderr, "and an agent run as processes of this binary, all on loopback, interleaved in one run.")
		fmt.Fprintln(stderr, "Prints added p50/p99 (small request, stream first byte), throughput at N clients against")
		fmt.Fprintln(stderr, "direct and CPU per request of each path's processes; medians over rounds.")
		fmt.Fprintln(stderr, "\nRows: direct; frp-tcp, frp-quic, frp-http (frp's tcp proxy over TCP and QUIC, its http")
		fmt.Fprintln(stderr, "proxy); go-reverse-proxy (Go's httputil.ReverseProxy, one stock HTTP hop); stock-floor (the")
		fmt.Fprintln(stderr, "relay path's stock parts alone, in two processes: net/http, HTTP/1.1 over libp2p QUIC streams,")
		fmt.Fprintln(stderr, "HTTP/1.1 to the engine, with no routing, auth, index, metrics or logging: what the path's")
		fmt.Fprintln(stderr, "parts cost used plainly); computeflux (relay and agent); computeflux-base (--base-binary).")
		fmt.Fprintln(stderr, "\nFlags:")
		printPublicDefaults(fs, hidden, stderr)
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("bench: unexpected arguments %q", fs.Args())
	}
	cfg.RelayArgs, cfg.BaseRelayArgs = strings.Fields(relayArgs), strings.Fields(baseRelayArgs)
	switch n := countSet(proxyListen, floorRelay, floorAgent); {
	case n > 1:
		return errors.New("bench: --serve-reverse-proxy, --serve-stock-floor-relay and --serve-stock-floor-agent exclude each other")
	case proxyListen != "":
		return bench.ServeReverseProxy(ctx, proxyListen, proxyUpstream)
	case floorRelay != "":
		return bench.ServeStockFloorRelay(ctx, floorRelay, floorAddrFile)
	case floorAgent != "":
		return bench.ServeStockFloorAgent(ctx, floorAgent, proxyUpstream)
	}
	if !quiet {
		cfg.Progress = stderr
	}
	rep, err := bench.RunOverhead(ctx, cfg)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	return rep.WriteTable(stdout)
}

// countSet returns how many of vs are not empty.
func countSet(vs ...string) int {
	n := 0
	for _, v := range vs {
		if v != "" {
			n++
		}
	}
	return n
}

// printPublicDefaults prints fs's flags but those in hidden, as
// fs.PrintDefaults would.
func printPublicDefaults(fs *flag.FlagSet, hidden map[string]bool, w io.Writer) {
	pub := flag.NewFlagSet(fs.Name(), flag.ContinueOnError)
	pub.SetOutput(w)
	fs.VisitAll(func(f *flag.Flag) {
		if !hidden[f.Name] {
			pub.Var(f.Value, f.Name, f.Usage)
			pub.Lookup(f.Name).DefValue = f.DefValue
		}
	})
	pub.PrintDefaults()
}
