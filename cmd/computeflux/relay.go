package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// runRelay serves the OpenAI API and the agents' join service until ctx ends.
func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, tlsFiles, err := relayConfig(args, os.LookupEnv, stderr)
	if err != nil {
		return err
	}
	r, err := relay.New(cfg)
	if err != nil {
		return err
	}
	for _, a := range r.Addrs() {
		fmt.Fprintf(stdout, "relay p2p address: %s\n", a)
	}
	if tlsFiles.cert == "" {
		if !isLoopbackListen(cfg.Listen) {
			cfg.Logger.Warn().Str("listen", cfg.Listen).Msg("serving plain HTTP: clients' API keys cross the network in clear text; use --tls-cert/--tls-key or a TLS proxy in front")
		}
		return r.Run(ctx)
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		_ = r.Close()
		return fmt.Errorf("relay: listen: %w", err)
	}
	tln, err := relay.NewTLSListener(ln, tlsFiles.cert, tlsFiles.key)
	if err != nil {
		_ = ln.Close()
		_ = r.Close()
		return err
	}
	return r.Serve(ctx, tln)
}

// relayTLS names the relay's certificate and key files (both or neither).
type relayTLS struct{ cert, key string }

// isLoopbackListen reports whether addr listens on loopback only.
func isLoopbackListen(addr string) bool {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// relayConfig turns the command line, then COMPUTEFLUX_* environment
// variables for flags not given, into a relay.Config.
func relayConfig(args []string, lookupEnv func(string) (string, bool), stderr io.Writer) (relay.Config, relayTLS, error) {
	var cfg relay.Config
	var tf relayTLS
	var p2pListen, token, tokenFile, keysFile, policy string
	var nat natFlags
	var gossip gossipFlags
	var logs logFlags
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Listen, "listen", relay.DefaultListen, "HTTP listen `address` for the OpenAI API")
	fs.StringVar(&p2pListen, "p2p-listen", strings.Join(relay.DefaultP2PListen, ","), "comma-separated libp2p listen `multiaddrs` for agents")
	fs.StringVar(&cfg.IdentityFile, "identity", "", "Ed25519 identity `file` (created on first run; empty: ephemeral)")
	fs.StringVar(&token, "token", "", "agents' join `secret` (prefer --token-file)")
	fs.StringVar(&tokenFile, "token-file", "", "`file` holding the agents' join secret")
	fs.StringVar(&keysFile, "api-keys-file", "", "`file` of client API keys, one per line, # comments")
	fs.BoolVar(&cfg.NoAuth, "no-auth", false, "serve clients without API keys")
	fs.StringVar(&cfg.AddrFile, "addr-file", "", "write the relay's dialable multiaddrs to this `file` once listening")
	fs.StringVar(&policy, "policy", "sticky", "routing `policy`: sticky, round-robin, random, least-loaded, consistent-hash")
	fs.IntVar(&cfg.MaxAttempts, "max-attempts", relay.DefaultMaxAttempts, "agents tried per request before its first byte")
	fs.DurationVar(&cfg.TTFBTimeout, "ttfb-timeout", relay.DefaultTTFBTimeout, "longest wait for an agent's first response byte")
	fs.DurationVar(&cfg.IdleTimeout, "idle-timeout", relay.DefaultIdleTimeout, "longest gap between streamed chunks")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body", relay.DefaultMaxBodyBytes, "largest request body in `bytes`")
	fs.IntVar(&cfg.KeyRPM, "key-rpm", 0, "inference requests one API key may start per minute (0: unlimited)")
	fs.IntVar(&cfg.KeyConcurrency, "key-concurrency", 0, "inference requests one API key may have in flight (0: unlimited)")
	fs.StringVar(&cfg.MetricsKey, "metrics-key", "", "bearer `key` required on /metrics (empty: /metrics is public)")
	fs.StringVar(&tf.cert, "tls-cert", "", "serve HTTPS with this PEM certificate chain `file` (with --tls-key)")
	fs.StringVar(&tf.key, "tls-key", "", "PEM private key `file` for --tls-cert")
	nat.register(fs)
	gossip.register(fs)
	fs.Var(&gossip.relays, "gossip-relay", "another relay's `multiaddr` (ending in /p2p/<peer ID>) to share membership gossip with; repeatable or comma-separated")
	logs.register(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, tf, err
	}
	if fs.NArg() > 0 {
		return cfg, tf, fmt.Errorf("relay: unexpected arguments %q", fs.Args())
	}
	if err := flagsFromEnv(fs, lookupEnv); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}

	for _, a := range strings.Split(p2pListen, ",") {
		if a = strings.TrimSpace(a); a != "" {
			cfg.P2PListen = append(cfg.P2PListen, a)
		}
	}
	switch {
	case token != "" && tokenFile != "":
		return cfg, tf, errors.New("relay: give --token or --token-file, not both")
	case tokenFile != "":
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return cfg, tf, fmt.Errorf("relay: --token-file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	if token == "" {
		return cfg, tf, errors.New("relay: a join token is required (--token-file or --token)")
	}
	cfg.Token = []byte(token)
	if keysFile != "" {
		keys, err := relay.LoadAPIKeys(keysFile)
		if err != nil {
			return cfg, tf, fmt.Errorf("relay: %w", err)
		}
		if len(keys) == 0 {
			return cfg, tf, fmt.Errorf("relay: --api-keys-file %s holds no keys", keysFile)
		}
		cfg.APIKeys = keys
	}
	if len(cfg.APIKeys) == 0 && !cfg.NoAuth {
		return cfg, tf, errors.New("relay: no client API keys: give --api-keys-file, or --no-auth to serve anyone")
	}
	p, err := scheduler.ParsePolicy(policy)
	if err != nil {
		return cfg, tf, fmt.Errorf("relay: --policy: %w", err)
	}
	if cfg.PublicCIDRs, err = nat.publicCIDRs(); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	if cfg.Gossip, err = gossip.relayConfig(); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	cfg.Policy = p
	if cfg.Logger, err = logs.logger(stderr); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	if (tf.cert == "") != (tf.key == "") {
		return cfg, tf, errors.New("relay: give both --tls-cert and --tls-key, or neither")
	}
	return cfg, tf, nil
}

// listFlag is a flag that may be repeated and takes comma-separated
// values; from the environment it is set once with a comma list.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(s string) error {
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			*l = append(*l, v)
		}
	}
	return nil
}

// natFlags are the NAT-traversal flags of relay and agent.
type natFlags struct{ cidrs listFlag }

func (n *natFlags) register(fs *flag.FlagSet) {
	fs.Var(&n.cidrs, "public-cidr", "address `range` to treat as public for hole punching and relay reservations, "+
		"on top of globally routable addresses, e.g. 100.64.0.0/10 for carrier-grade NAT; repeatable or comma-separated (default: none)")
}

func (n *natFlags) publicCIDRs() ([]netip.Prefix, error) {
	p, err := transport.ParsePublicCIDRs(n.cidrs)
	if err != nil {
		return nil, fmt.Errorf("--public-cidr: %w", err)
	}
	return p, nil
}

// gossipFlags are the membership gossip flags of relay and agent.
type gossipFlags struct {
	disabled                                    bool
	preset                                      string
	probeInterval, probeTimeout, gossipInterval time.Duration
	suspicionMult                               int
	relays                                      listFlag // relay only
}

func (g *gossipFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&g.disabled, "no-gossip", false, "take no part in membership gossip (the relay then routes on join registrations alone)")
	fs.StringVar(&g.preset, "gossip-preset", transport.GossipPresetHome,
		"memberlist timing `preset`: home (probe every 2 s, a silent member is dead after 8 to 32 s), wan, lan, local")
	fs.DurationVar(&g.probeInterval, "gossip-probe-interval", 0, "override the preset's probe interval (0: keep the preset's)")
	fs.DurationVar(&g.probeTimeout, "gossip-probe-timeout", 0, "override the preset's wait for a probe's ack (0: keep)")
	fs.DurationVar(&g.gossipInterval, "gossip-interval", 0, "override the preset's gossip interval (0: keep)")
	fs.IntVar(&g.suspicionMult, "gossip-suspicion-mult", 0, "override the preset's suspicion multiplier: a suspect is dead after mult x log10(members) x probe interval at least (0: keep)")
}

// tune checks the preset and returns a memberlist edit for the overrides
// given (nil when none).
func (g *gossipFlags) tune() (func(*memberlist.Config), error) {
	switch g.preset {
	case transport.GossipPresetHome, transport.GossipPresetWAN, transport.GossipPresetLAN, transport.GossipPresetLocal:
	default:
		return nil, fmt.Errorf("--gossip-preset %q: want home, wan, lan or local", g.preset)
	}
	if g.probeInterval < 0 || g.probeTimeout < 0 || g.gossipInterval < 0 || g.suspicionMult < 0 {
		return nil, errors.New("gossip overrides must not be negative")
	}
	if g.probeInterval == 0 && g.probeTimeout == 0 && g.gossipInterval == 0 && g.suspicionMult == 0 {
		return nil, nil
	}
	o := *g
	return func(c *memberlist.Config) {
		if o.probeInterval > 0 {
			c.ProbeInterval = o.probeInterval
		}
		if o.probeTimeout > 0 {
			c.ProbeTimeout = o.probeTimeout
		}
		if o.gossipInterval > 0 {
			c.GossipInterval = o.gossipInterval
		}
		if o.suspicionMult > 0 {
			c.SuspicionMult = o.suspicionMult
		}
	}, nil
}

func (g *gossipFlags) relayConfig() (relay.GossipConfig, error) {
	tune, err := g.tune()
	if err != nil {
		return relay.GossipConfig{}, err
	}
	gc := relay.GossipConfig{Disabled: g.disabled, Preset: g.preset, Tune: tune}
	for _, s := range g.relays {
		ai, err := peer.AddrInfoFromString(s)
		if err != nil {
			return gc, fmt.Errorf("--gossip-relay %q (a multiaddr ending in /p2p/<peer ID>): %w", s, err)
		}
		gc.Relays = append(gc.Relays, *ai)
	}
	return gc, nil
}

func (g *gossipFlags) agentConfig() (agent.GossipConfig, error) {
	tune, err := g.tune()
	if err != nil {
		return agent.GossipConfig{}, err
	}
	return agent.GossipConfig{Disabled: g.disabled, Preset: g.preset, Tune: tune}, nil
}
