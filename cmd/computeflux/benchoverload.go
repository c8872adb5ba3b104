package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/chaos"
)

// runBenchOverload runs the overload scenario live: this binary as relays,
// sim engines and agents, a light client beside heavy ones. With
// --compare it runs the fleet without a queue first, then with it, and
// prints both.
func runBenchOverload(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := chaos.OverloadConfig{}
	var compare bool
	fs := newLiveFlags("overload", stderr)
	fs.IntVar(&cfg.Engines, "engines", chaos.DefaultOverloadEngines, "sim engines, each with its agent")
	fs.IntVar(&cfg.Slots, "max-running", chaos.DefaultOverloadSlots, "each engine's batch")
	fs.IntVar(&cfg.Relays, "relays", 1, "relays (1 or 2; with 2 the light client uses the first, the heavy ones the second)")
	fs.IntVar(&cfg.HeavyStreams, "heavy-streams", chaos.DefaultHeavyStreams, "streams each heavy client keeps going")
	fs.IntVar(&cfg.HeavyTokens, "heavy-tokens", chaos.DefaultHeavyTokens, "tokens per heavy answer")
	fs.Float64Var(&cfg.HeavySpread, "heavy-spread", 0, "spread the heavy answers' lengths over heavy-tokens × (1 ± this); 0: all alike, ending together")
	fs.IntVar(&cfg.LightTokens, "light-tokens", chaos.DefaultLightTokens, "tokens per light answer")
	fs.DurationVar(&cfg.LightEvery, "light-every", chaos.DefaultLightEvery, "the light client's pace")
	fs.DurationVar(&cfg.Phase, "phase", chaos.DefaultOverloadPhase, "length of each measured phase")
	fs.BoolVar(&cfg.Weighted, "weighted", false, "add a phase of two heavy clients of weights 2 and 1")
	fs.BoolVar(&cfg.RestartRelay, "restart-relay", false, "with --relays 2: kill the first relay under load and start it again")
	fs.BoolVar(&compare, "compare", false, "run the fleet without a queue (--queue-wait=-1s, --dispatch-limit=-1) first, side by side")
	timeout := fs.Duration("timeout", 10*time.Minute, "bound on the whole run")
	var err error
	if cfg.Binary, cfg.Progress, err = fs.parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	runs := []struct {
		name        string
		relay, agnt []string
	}{{"with the queue (default)", nil, nil}}
	if compare {
		runs = append([]struct {
			name        string
			relay, agnt []string
		}{{"without a queue", []string{"--queue-wait=-1s"}, []string{"--dispatch-limit=-1"}}}, runs...)
	}
	for _, run := range runs {
		c := cfg
		c.RelayArgs, c.AgentArgs = run.relay, run.agnt
		res, err := chaos.RunOverload(ctx, c)
		if err != nil {
			return fmt.Errorf("bench: overload (%s): %w", run.name, err)
		}
		fmt.Fprintf(stdout, "== %s\n", run.name)
		res.Write(stdout)
		fmt.Fprintln(stdout)
	}
	return nil
}
