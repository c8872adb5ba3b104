package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/scheduler"
)

// runDemo starts simulated engines, agents and a relay on loopback, prints
// how to reach the relay, runs a short sticky-versus-round-robin
// comparison, and serves until ctx ends or --duration has passed.
func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var engines, sessions int
	var timeScale float64
	var duration time.Duration
	var compare bool
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&engines, "engines", 3, "simulated engines, each with its agent")
	fs.Float64Var(&timeScale, "time-scale", 1, "run the served engines this many times faster than real time")
	fs.DurationVar(&duration, "duration", 0, "stop after serving this long once the comparison is done (0: until Ctrl-C)")
	fs.BoolVar(&compare, "compare", true, "run the sticky-versus-round-robin comparison")
	fs.IntVar(&sessions, "sessions", 24, "chat sessions in the comparison")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("demo: unexpected arguments %q", fs.Args())
	}
	if engines < 1 || sessions < 1 || !(timeScale > 0) {
		return errors.New("demo: --engines and --sessions must be positive, --time-scale above 0")
	}

	fmt.Fprintf(stdout, "Starting %d simulated engines, %d agents and a relay on loopback (libp2p over QUIC)...\n", engines, engines)
	c, err := relaytest.Start(ctx, relaytest.Config{
		Engines: engines,
		Engine:  simengine.Config{TimeScale: timeScale},
	})
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer c.Close()
	fmt.Fprintf(stdout, "\nRelay URL:   %s/v1\n", c.URL())
	fmt.Fprintf(stdout, "Client key:  %s\n", c.APIKey())
	fmt.Fprintf(stdout, "Model:       %s\n", simengine.DefaultModel)
	fmt.Fprintf(stdout, "\nTry it (send it twice: the second turn of a session lands on the engine that holds its cache;\n")
	fmt.Fprintf(stdout, "see the X-ComputeFlux-Agent and X-ComputeFlux-Affinity headers and usage.prompt_tokens_details.cached_tokens):\n\n")
	fmt.Fprintf(stdout, "  %s\n\n", curlLine(c.URL(), c.APIKey()))

	if compare {
		fmt.Fprintf(stdout, "Comparing sticky with round-robin on %d multi-turn chat sessions (each on a fresh cluster, engines %gx faster)...\n",
			sessions, demoCompareScale)
		rp, err := bench.Run(ctx, demoCompareConfig(engines, sessions))
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("demo: comparison: %w", err)
		}
		fmt.Fprintln(stdout)
		if err := rp.WriteTable(stdout); err != nil {
			return err
		}
		fmt.Fprintln(stdout)
	}

	if duration > 0 {
		fmt.Fprintf(stdout, "Serving at %s for %v.\n", c.URL(), duration)
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, duration)
		defer cancel()
	} else {
		fmt.Fprintf(stdout, "Serving at %s until Ctrl-C.\n", c.URL())
	}
	<-ctx.Done()
	fmt.Fprintln(stdout, "Stopping.")
	return nil
}

// demoCompareScale speeds up the comparison's engines so it finishes in
// seconds.
const demoCompareScale = 20.0

// demoCompareConfig is the demo's comparison: the bench's chat workload
// with quicker readers (3 s median think time) so sessions finish fast,
// both policies at once so they meet the same machine load.
func demoCompareConfig(engines, sessions int) bench.Config {
	return bench.Config{
		Mode:      bench.ModeLive,
		Policies:  []scheduler.Policy{scheduler.PolicySticky, scheduler.PolicyRoundRobin},
		Engines:   engines,
		Chat:      bench.ChatConfig{Sessions: sessions, Think: 3 * time.Second, MaxTurns: 10},
		TimeScale: demoCompareScale,
		Parallel:  true,
		Timeout:   2 * time.Minute,
	}
}

// curlLine is a ready-to-paste streaming chat completion with a session ID.
func curlLine(url, key string) string {
	return fmt.Sprintf(`curl -sN %s/v1/chat/completions -H "Authorization: Bearer %s" -H "Content-Type: application/json" -H "X-Session-ID: demo-1" -d '{"model":"%s","stream":true,"stream_options":{"include_usage":true},"max_tokens":30,"messages":[{"role":"user","content":"Hello, ComputeFlux!"}]}'`,
		url, key, simengine.DefaultModel)
}
