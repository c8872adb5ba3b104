package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest"
)

// runDemo starts simulated engines, agents and a relay on loopback, prints
// how to reach the relay, compares sticky routing with round-robin on long
// conversations at real-time engine speed (demo_compare.go), and serves
// until ctx ends or --duration has passed.
func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var engines, sessions, turns, contextTokens int
	var timeScale, compareScale float64
	var duration time.Duration
	var compare bool
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&engines, "engines", 3, "simulated engines, each with its agent")
	fs.Float64Var(&timeScale, "time-scale", 1, "run the served engines this many times faster than real time")
	fs.DurationVar(&duration, "duration", 0, "stop after serving this long once the comparison is done (0: until Ctrl-C)")
	fs.BoolVar(&compare, "compare", true, "run the sticky-versus-round-robin comparison")
	fs.IntVar(&sessions, "sessions", 5, "conversations in the comparison")
	fs.IntVar(&turns, "turns", 4, "turns of each conversation")
	fs.IntVar(&contextTokens, "context-tokens", 100000, "tokens of each conversation's own context at its first turn (less if the caches cannot hold them)")
	fs.Float64Var(&compareScale, "compare-time-scale", 1, "run the comparison's engines this many times faster than real time (times are reported in model time)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("demo: unexpected arguments %q", fs.Args())
	}
	if engines < 1 || sessions < 1 || turns < 1 || contextTokens < 1 || !(timeScale > 0) || !(compareScale > 0) {
		return errors.New("demo: --engines, --sessions, --turns and --context-tokens must be positive, the time scales above 0")
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
		err := runComparison(ctx, stdout, demoWorkload{
			Engines: engines, Sessions: sessions, Turns: turns,
			SystemTokens: 2000, ContextTokens: contextTokens, TurnTokens: 1000, AnswerTokens: 40,
			Think: 2 * time.Second, Stagger: 3 * time.Second, TimeScale: compareScale,
		})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("demo: comparison: %w", err)
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

// curlLine is a ready-to-paste streaming chat completion with a session ID.
func curlLine(url, key string) string {
	return fmt.Sprintf(`curl -sN %s/v1/chat/completions -H "Authorization: Bearer %s" -H "Content-Type: application/json" -H "X-Session-ID: demo-1" -d '{"model":"%s","stream":true,"stream_options":{"include_usage":true},"max_tokens":30,"messages":[{"role":"user","content":"Hello, ComputeFlux!"}]}'`,
		url, key, simengine.DefaultModel)
}
