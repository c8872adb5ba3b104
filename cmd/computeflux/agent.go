package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/computeflux/computeflux/agent"
)

// runAgent joins a relay and serves the local engine until ctx ends, then
// drains.
func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "usage" {
		return runAgentUsage(ctx, args[1:], os.LookupEnv, stdout, stderr) // agentusage.go
	}
	cfg, err := agentConfig(args, os.LookupEnv, stderr)
	if err != nil {
		return err
	}
	tuneGC(os.LookupEnv)
	if cfg.Upstream == "" {
		if cfg.Upstream, err = findUpstream(ctx, nil, stdout); err != nil {
			return err
		}
	}
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "agent peer ID: %s\n", a.ID())
	return a.Run(ctx)
}

// findUpstream looks for an engine on the usual local ports when no
// --upstream was given, says which it found, and returns its URL; with none
// or several it says exactly what to pass.
func findUpstream(ctx context.Context, ports []agent.EnginePort, stdout io.Writer) (string, error) {
	found, err := agent.FindEngine(ctx, ports, 0)
	if err != nil {
		return "", fmt.Errorf("agent: %w", err)
	}
	if len(found) > 1 {
		var opts []string
		for _, f := range found {
			opts = append(opts, "  --upstream "+f.URL+"   # "+f.Describe())
		}
		return "", fmt.Errorf("agent: found %d engines; pass one of:\n%s", len(found), strings.Join(opts, "\n"))
	}
	fmt.Fprintf(stdout, "found %s; using --upstream %s\n", found[0].Describe(), found[0].URL)
	return found[0].URL, nil
}

// agentConfig turns the command line, then COMPUTEFLUX_* environment
// variables for flags not given, into an agent.Config.
func agentConfig(args []string, lookupEnv func(string) (string, bool), stderr io.Writer) (agent.Config, error) {
	var cfg agent.Config
	var p2pListen string
	var ephemeral bool
	var nat natFlags
	var gossip gossipFlags
	var logs logFlags
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: computeflux agent [flags]")
		fmt.Fprintln(stderr, "       computeflux agent usage [flags]   what this agent served through each relay (-h for its flags)")
		fs.PrintDefaults()
	}
	var relays listFlag
	fs.Var(&relays, "relay", "relay `multiaddr` ending in /p2p/<relay peer ID>; repeat it (or give a comma list) to join and serve several relays")
	fs.StringVar(&cfg.Token, "token", "", "join `secret` (prefer --token-file)")
	fs.StringVar(&cfg.TokenFile, "token-file", "", "`file` holding the join secret")
	fs.StringVar(&cfg.Upstream, "upstream", "", "local engine base `URL`, e.g. http://127.0.0.1:8000 (default: look on 127.0.0.1 ports 8000, 30000, 8080, 3000, 11434)")
	fs.StringVar(&cfg.UpstreamAPIKey, "upstream-api-key", "", "API `key` the engine expects, sent as a bearer token")
	fs.StringVar(&cfg.Name, "name", "", "agent `name` shown by the relay (default: host name)")
	fs.Float64Var(&cfg.Weight, "weight", 1, "relative share of traffic")
	fs.IntVar(&cfg.MaxConcurrency, "max-concurrency", 0, "most concurrent requests, waiting ones included (0: unlimited)")
	fs.IntVar(&cfg.DispatchLimit, "dispatch-limit", 0, "requests the engine is given at once, the rest waiting in fair order at the relays (0: its batch, measured from its metrics; negative: no limit)")
	fs.IntVar(&cfg.Index.KVCapacityTokens, "kv-capacity-tokens", 0, "the engine's KV-cache capacity in `tokens`, sizing the prefix index published to the relay (0: read it from the engine, else 262144)")
	fs.StringVar(&cfg.IdentityFile, "identity", "", "Ed25519 identity `file`, created on first run (default: <user config dir>/computeflux/agent-<name>.key)")
	fs.BoolVar(&ephemeral, "ephemeral-identity", false, "use a new identity on every start instead of a file (a restarted agent then waits until the relay drops its old registration)")
	nat.register(fs)
	gossip.register(fs)
	fs.StringVar(&p2pListen, "p2p-listen", "", "comma-separated libp2p listen `multiaddrs` (default: QUIC on a random port, v4 and v6)")
	fs.DurationVar(&cfg.DrainTimeout, "drain-timeout", 30*time.Second, "longest wait for in-flight requests when stopping")
	logs.register(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("agent: unexpected arguments %q", fs.Args())
	}
	if err := flagsFromEnv(fs, lookupEnv); err != nil {
		return cfg, fmt.Errorf("agent: %w", err)
	}
	cfg.Relays = relays
	for _, a := range strings.Split(p2pListen, ",") {
		if a = strings.TrimSpace(a); a != "" {
			cfg.ListenAddrs = append(cfg.ListenAddrs, a)
		}
	}
	if ephemeral && cfg.IdentityFile != "" {
		return cfg, errors.New("agent: give --identity or --ephemeral-identity, not both")
	}
	if !ephemeral && cfg.IdentityFile == "" {
		f, err := defaultIdentityFile(cfg.Name)
		if err != nil {
			return cfg, err
		}
		cfg.IdentityFile = f
	}
	var err error
	if cfg.PublicCIDRs, err = nat.publicCIDRs(); err != nil {
		return cfg, fmt.Errorf("agent: %w", err)
	}
	if cfg.Gossip, err = gossip.agentConfig(); err != nil {
		return cfg, fmt.Errorf("agent: %w", err)
	}
	if cfg.Logger, err = logs.logger(stderr); err != nil {
		return cfg, fmt.Errorf("agent: %w", err)
	}
	return cfg, nil
}

// defaultIdentityFile is where an agent keeps its key unless told
// otherwise: <user config dir>/computeflux/agent-<name>.key. A stable
// identity lets a restarted agent take its registration back at once (the
// relay replaces the old one from the same peer instead of refusing the
// name while the old one times out), and lets gossip recognise it. The
// name is part of the path so that several agents of one user keep
// distinct identities.
func defaultIdentityFile(name string) (string, error) {
	if name == "" {
		name, _ = os.Hostname()
	}
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", fmt.Errorf("agent: no place for the identity file (%w): give --identity FILE or --ephemeral-identity", err)
	}
	safe := []byte(name)
	for i, c := range safe {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			safe[i] = '_'
		}
	}
	if len(safe) == 0 {
		safe = []byte("agent")
	}
	return filepath.Join(dir, "computeflux", "agent-"+string(safe)+".key"), nil
}
