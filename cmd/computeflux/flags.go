package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/transport"
)

// flagsFromEnv sets every flag not given on the command line from the
// environment variable COMPUTEFLUX_<NAME> (upper case, '-' as '_'), if set.
// It stops at the first value a flag refuses.
func flagsFromEnv(fs *flag.FlagSet, lookupEnv func(string) (string, bool)) error {
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
				err = fmt.Errorf("%s: %w", name, e)
			}
		}
	})
	return err
}

// logFlags are the --log-format and --log-level flags of the long-running
// commands.
type logFlags struct{ format, level string }

func (l *logFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&l.format, "log-format", "auto", "log format: console, json, or auto (console on a terminal, json otherwise)")
	fs.StringVar(&l.level, "log-level", "info", "log level: debug, info, warn, error")
}

// logger returns the logger the flags ask for, writing to w with
// timestamps.
func (l *logFlags) logger(w io.Writer) (zerolog.Logger, error) {
	lg, _, err := l.loggers(w, false)
	return lg, err
}

// loggers returns the logger the flags ask for and the one for per-request
// lines, writing to w with timestamps. With buffer, JSON lines to a file or
// pipe that is not a terminal go through one logBuffer (logbuf.go): the
// request logger's info lines are held up to logFlushEvery, the other
// logger's lines go out at once, both in order. Otherwise both are the
// same logger.
func (l *logFlags) loggers(w io.Writer, buffer bool) (main, requests zerolog.Logger, err error) {
	level, err := zerolog.ParseLevel(l.level)
	if err != nil {
		return main, requests, fmt.Errorf("--log-level: %w", err)
	}
	format := l.format
	if format == "auto" {
		// zerolog's ConsoleWriter decodes every event back from JSON to
		// format it: on a busy relay the per-request line cost more CPU
		// than the rest of the request's handling. Humans at a terminal
		// get it; files, pipes and journals get the JSON as written.
		format = "json"
		if isTerminal(w) {
			format = "console"
		}
	}
	switch format {
	case "json":
		if _, isFile := w.(*os.File); buffer && isFile && !isTerminal(w) {
			b := bufferLogs(w)
			main = zerolog.New(b.Immediate()).Level(level).With().Timestamp().Logger()
			requests = zerolog.New(b).Level(level).With().Timestamp().Logger()
			return main, requests, nil
		}
		main = zerolog.New(w).Level(level).With().Timestamp().Logger()
	case "console":
		main = zerolog.New(zerolog.ConsoleWriter{Out: w, TimeFormat: time.TimeOnly, NoColor: true}).Level(level).With().Timestamp().Logger()
	default:
		return main, requests, fmt.Errorf("--log-format %q: want console, json or auto", l.format)
	}
	return main, main, nil
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	if err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	// /dev/null is a character device too, and nobody reads it.
	if null, err := os.Stat(os.DevNull); err == nil && os.SameFile(st, null) {
		return false
	}
	return true
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

// joinSecret returns the join secret from --token or --token-file (the
// relay's and `agent usage`'s; the agent reads its own, agent.Config).
func joinSecret(token, file string) ([]byte, error) {
	switch {
	case token != "" && file != "":
		return nil, errors.New("give --token or --token-file, not both")
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("--token-file: %w", err)
		}
		if s := strings.TrimSpace(string(b)); s != "" {
			return []byte(s), nil
		}
		return nil, fmt.Errorf("token file %s is empty", file)
	case token != "":
		return []byte(token), nil
	}
	return nil, errors.New("give the join secret with --token-file (or --token)")
}
