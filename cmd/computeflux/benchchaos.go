package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/chaos"
)

// runBenchChaos runs the chaos scenario live: this very binary as a relay,
// sim engines and agents, under load while one agent is SIGKILLed, another
// frozen and woken, and the first restarted; it prints the figures.
func runBenchChaos(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := chaos.Config{}
	var scenario string
	var quiet bool
	fs := flag.NewFlagSet("bench --scenario chaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&scenario, "scenario", "chaos", "chaos")
	fs.IntVar(&cfg.Agents, "engines", chaos.DefaultAgents, "engines, each with its agent (at least 3)")
	fs.IntVar(&cfg.Workers, "sessions", chaos.DefaultWorkers, "concurrent sessions; every other one streams")
	fs.DurationVar(&cfg.Freeze, "freeze", chaos.DefaultFreeze, "how long the frozen agent stays SIGSTOPped")
	fs.Float64Var(&cfg.TimeScale, "time-scale", chaos.DefaultTimeScale, "run the engines this many times faster than real time")
	fs.IntVar(&cfg.MaxTokens, "answer-tokens", chaos.DefaultMaxTokens, "tokens per answer")
	fs.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	timeout := fs.Duration("timeout", 2*time.Minute, "bound on the whole run")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("bench: unexpected arguments %q", fs.Args())
	}
	bin, err := os.Executable()
	if err != nil {
		return fmt.Errorf("bench: chaos: %w", err)
	}
	cfg.Binary = bin
	if !quiet {
		cfg.Progress = stderr
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	res, err := chaos.Run(ctx, cfg)
	if res != nil {
		res.Write(stdout)
	}
	return err
}
