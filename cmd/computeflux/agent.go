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

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent"
)

// runAgent joins a relay and serves the local engine until ctx ends, then
// drains.
func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := agentConfig(args, os.LookupEnv, stderr)
	if err != nil {
		return err
	}
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "agent peer ID: %s\n", a.ID())
	return a.Run(ctx)
}

// agentConfig turns the command line, then COMPUTEFLUX_* environment
// variables for flags not given, into an agent.Config.
func agentConfig(args []string, lookupEnv func(string) (string, bool), stderr io.Writer) (agent.Config, error) {
	var cfg agent.Config
	var p2pListen, logFormat, logLevel string
	var ephemeral bool
	var nat natFlags
	var gossip gossipFlags
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Relay, "relay", "", "relay `multiaddr` ending in /p2p/<relay peer ID>")
	fs.StringVar(&cfg.Token, "token", "", "join `secret` (prefer --token-file)")
	fs.StringVar(&cfg.TokenFile, "token-file", "", "`file` holding the join secret")
	fs.StringVar(&cfg.Upstream, "upstream", "", "local engine base `URL`, e.g. http://127.0.0.1:8000")
	fs.StringVar(&cfg.UpstreamAPIKey, "upstream-api-key", "", "API `key` the engine expects, sent as a bearer token")
	fs.StringVar(&cfg.Name, "name", "", "agent `name` shown by the relay (default: host name)")
	fs.Float64Var(&cfg.Weight, "weight", 1, "relative share of traffic")
	fs.IntVar(&cfg.MaxConcurrency, "max-concurrency", 0, "most concurrent requests (0: unlimited)")
	fs.StringVar(&cfg.IdentityFile, "identity", "", "Ed25519 identity `file`, created on first run (default: <user config dir>/computeflux/agent-<name>.key)")
	fs.BoolVar(&ephemeral, "ephemeral-identity", false, "use a new identity on every start instead of a file (a restarted agent then waits until the relay drops its old registration)")
	nat.register(fs)
	gossip.register(fs)
	fs.StringVar(&p2pListen, "p2p-listen", "", "comma-separated libp2p listen `multiaddrs` (default: QUIC on a random port, v4 and v6)")
	fs.DurationVar(&cfg.DrainTimeout, "drain-timeout", 30*time.Second, "longest wait for in-flight requests when stopping")
	fs.StringVar(&logFormat, "log-format", "console", "log format: console or json")
	fs.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("agent: unexpected arguments %q", fs.Args())
	}
	if err := agentFlagsFromEnv(fs, lookupEnv); err != nil {
		return cfg, err
	}
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
	level, err := zerolog.ParseLevel(logLevel)
	if err != nil {
		return cfg, fmt.Errorf("agent: --log-level: %w", err)
	}
	switch logFormat {
	case "json":
		cfg.Logger = zerolog.New(stderr).Level(level).With().Timestamp().Logger()
	case "console":
		cfg.Logger = zerolog.New(zerolog.ConsoleWriter{Out: stderr, TimeFormat: time.TimeOnly, NoColor: true}).Level(level).With().Timestamp().Logger()
	default:
		return cfg, fmt.Errorf("agent: --log-format %q: want console or json", logFormat)
	}
	return cfg, nil
}

// agentFlagsFromEnv sets every flag not given on the command line from the
// environment variable COMPUTEFLUX_<NAME> (upper case, '-' as '_'), if set.
func agentFlagsFromEnv(fs *flag.FlagSet, lookupEnv func(string) (string, bool)) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] || err != nil {
			return
		}
		name := "COMPUTEFLUX_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := lookupEnv(name); ok {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("agent: %s: %w", name, e)
			}
		}
	})
	return err
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
