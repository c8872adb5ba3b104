package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/chaos"
)

// liveScenario returns the scenario a bench command line asks for when it
// is one that runs this binary as processes instead of comparing policies
// (chaos, soak, overload or audit), else "".
func liveScenario(args []string) string {
	for i, a := range args {
		v, ok := strings.CutPrefix(strings.TrimLeft(a, "-"), "scenario=")
		if !ok && strings.TrimLeft(a, "-") == "scenario" && i+1 < len(args) {
			v, ok = args[i+1], true
		}
		if ok && (v == "chaos" || v == "soak" || v == "overload" || v == "audit") {
			return v
		}
	}
	return ""
}

// liveFlags is the flag set of a live scenario, with its --scenario and
// --quiet flags.
type liveFlags struct {
	*flag.FlagSet
	quiet  bool
	stderr io.Writer
}

func newLiveFlags(scenario string, stderr io.Writer) *liveFlags {
	lf := &liveFlags{FlagSet: flag.NewFlagSet("bench --scenario "+scenario, flag.ContinueOnError), stderr: stderr}
	lf.SetOutput(stderr)
	lf.String("scenario", scenario, scenario)
	lf.BoolVar(&lf.quiet, "quiet", false, "no progress lines on stderr")
	return lf
}

// parse parses a live scenario's command line and returns this binary's
// path (the scenario runs it as its processes) and where progress lines
// go (nil with --quiet).
func (lf *liveFlags) parse(args []string) (bin string, progress io.Writer, err error) {
	if err := lf.Parse(args); err != nil {
		return "", nil, err
	}
	if lf.NArg() > 0 {
		return "", nil, fmt.Errorf("bench: unexpected arguments %q", lf.Args())
	}
	if bin, err = os.Executable(); err != nil {
		return "", nil, fmt.Errorf("%s: %w", lf.Name(), err)
	}
	if !lf.quiet {
		progress = lf.stderr
	}
	return bin, progress, nil
}

// runBenchChaos runs the chaos scenario live: this very binary as a relay,
// sim engines and agents, under load while one agent is SIGKILLed, another
// frozen and woken, and the first restarted; it prints the figures.
func runBenchChaos(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := chaos.Config{}
	fs := newLiveFlags("chaos", stderr)
	fs.IntVar(&cfg.Agents, "engines", chaos.DefaultAgents, "engines, each with its agent (at least 3)")
	fs.IntVar(&cfg.Workers, "sessions", chaos.DefaultWorkers, "concurrent sessions; every other one streams")
	fs.DurationVar(&cfg.Freeze, "freeze", chaos.DefaultFreeze, "how long the frozen agent stays SIGSTOPped")
	fs.Float64Var(&cfg.TimeScale, "time-scale", chaos.DefaultTimeScale, "run the engines this many times faster than real time")
	fs.IntVar(&cfg.MaxTokens, "answer-tokens", chaos.DefaultMaxTokens, "tokens per answer")
	timeout := fs.Duration("timeout", 2*time.Minute, "bound on the whole run")
	var err error
	if cfg.Binary, cfg.Progress, err = fs.parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	res, err := chaos.Run(ctx, cfg)
	if res != nil {
		res.Write(stdout)
	}
	return err
}

// runBenchSoak runs the soak live: this very binary as a relay, sim engines
// and agents under many concurrent clients for minutes, one agent
// restarted midway, then a shorter round-robin run; it prints the figures
// and fails when a check does (broken answers, panics, heap or goroutines
// not flat, relay CPU per request growing, no better hit ratio than
// round-robin).
func runBenchSoak(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := chaos.SoakConfig{}
	fs := newLiveFlags("soak", stderr)
	fs.IntVar(&cfg.Agents, "engines", chaos.DefaultSoakAgents, "engines, each with its agent (at least 2)")
	fs.IntVar(&cfg.Clients, "clients", chaos.DefaultSoakClients, "concurrent clients")
	fs.DurationVar(&cfg.Duration, "duration", chaos.DefaultSoakDuration, "how long the clients run")
	fs.DurationVar(&cfg.Warmup, "warmup", chaos.DefaultSoakWarmup, "when heap, goroutines and CPU per request are first taken")
	fs.DurationVar(&cfg.RestartAt, "restart-at", 0, "when agent 0 restarts, its engine running on (default: half the duration; negative: never)")
	fs.DurationVar(&cfg.Baseline, "baseline", 0, "length of the round-robin run, and of the window whose hit ratios are compared (default: half the duration, at most 2m; negative: no round-robin run)")
	fs.IntVar(&cfg.Slots, "slots", chaos.DefaultSoakSlots, "engines' batch slots (sim-engine --max-running)")
	fs.IntVar(&cfg.MinTokens, "min-tokens", chaos.DefaultSoakMinTokens, "shortest answer in tokens")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", chaos.DefaultSoakMaxTokens, "longest answer in tokens")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the conversations")
	logFile := fs.String("log-file", "", "write every process's output to this `file`, each line prefixed with the process's name")
	var err error
	if cfg.Binary, cfg.Progress, err = fs.parse(args); err != nil {
		return err
	}
	if *logFile != "" {
		f, err := os.Create(*logFile)
		if err != nil {
			return fmt.Errorf("bench: soak: %w", err)
		}
		defer f.Close()
		cfg.Echo = &lockedWriter{w: bufio.NewWriterSize(f, 1<<20)}
		defer cfg.Echo.(*lockedWriter).flush()
	}
	// Bounded: both runs, and time to start and stop the processes.
	ctx, cancel := context.WithTimeout(ctx, 2*cfg.Duration+5*time.Minute)
	defer cancel()
	rep, err := chaos.Soak(ctx, cfg)
	if rep != nil {
		rep.Write(stdout)
	}
	if err != nil {
		return err
	}
	if f := rep.Failures(); len(f) > 0 {
		return fmt.Errorf("bench: soak: %d checks failed", len(f))
	}
	return nil
}

// lockedWriter serializes writes from several goroutines into one buffered
// writer.
type lockedWriter struct {
	mu sync.Mutex // guards w
	w  *bufio.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (l *lockedWriter) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	_ = l.w.Flush()
}
