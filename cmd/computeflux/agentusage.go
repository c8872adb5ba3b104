package main

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/transport"
)

// runAgentUsage asks each relay an agent joined what the agent served
// there (`computeflux agent usage`): the agent's owner proves the join
// secret and holds the agent's key, and sees nothing about anyone else.
// The agent need not be stopped; it must be joined, since the relay knows
// which name a key holds while its agent is joined.
func runAgentUsage(ctx context.Context, args []string, lookupEnv func(string) (string, bool), stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("agent usage", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: computeflux agent usage --relay MULTIADDR --token-file FILE [--name NAME | --identity FILE] [--since 7d] [--format table|csv|json]")
		fmt.Fprintln(stderr, "Asks each relay the agent joined what the agent served there, by model (the agent must be joined).")
		fs.PrintDefaults()
	}
	var relays listFlag
	fs.Var(&relays, "relay", "relay `multiaddr` ending in /p2p/<relay peer ID>, as the agent was given; repeatable or comma-separated")
	token := fs.String("token", "", "join `secret` (prefer --token-file)")
	tokenFile := fs.String("token-file", "", "`file` holding the join secret")
	name := fs.String("name", "", "the agent's `name`, which names its default identity file (default: host name)")
	identity := fs.String("identity", "", "the agent's identity `file` (default: <user config dir>/computeflux/agent-<name>.key)")
	since := fs.String("since", "7d", "report from this long ago (7d, 36h, 90m) or from an RFC 3339 `time`")
	format := fs.String("format", "table", "output `format`: table, csv or json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("agent usage: unexpected arguments %q", fs.Args())
	}
	if err := flagsFromEnv(fs, lookupEnv); err != nil {
		return fmt.Errorf("agent usage: %w", err)
	}
	if len(relays) == 0 {
		return errors.New("agent usage: give the agent's relays with --relay")
	}
	if _, err := ledger.ParseSince(*since, time.Now()); err != nil {
		return fmt.Errorf("agent usage: --%w", err)
	}
	switch *format {
	case "table", "csv", "json":
	default:
		return fmt.Errorf("agent usage: --format %q: want table, csv or json", *format)
	}
	secret, err := joinSecret(*token, *tokenFile)
	if err != nil {
		return fmt.Errorf("agent usage: %w", err)
	}
	if *identity == "" {
		if *identity, err = defaultIdentityFile(*name); err != nil {
			return err
		}
	}
	if _, err := os.Stat(*identity); err != nil {
		return fmt.Errorf("agent usage: the agent's identity file: %w (give --identity or the agent's --name)", err)
	}
	key, err := transport.LoadOrCreateIdentity(*identity)
	if err != nil {
		return fmt.Errorf("agent usage: %w", err)
	}
	// The question goes out from a host of its own, so that it does not
	// disturb the running agent's connections.
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/0.0.0.0/udp/0/quic-v1"}})
	if err != nil {
		return fmt.Errorf("agent usage: %w", err)
	}
	defer h.Close()
	var reports []relay.AgentUsage
	var answered []string // the relay of each report
	var failed []string
	for _, addr := range relays {
		ai, err := peer.AddrInfoFromString(addr)
		if err != nil {
			return fmt.Errorf("agent usage: --relay %q (a multiaddr ending in /p2p/<peer ID>): %w", addr, err)
		}
		rep, err := askRelay(ctx, h, *ai, secret, key, *since)
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", ai.ID, err))
			continue
		}
		reports = append(reports, rep)
		answered = append(answered, addr)
	}
	for _, f := range failed {
		fmt.Fprintf(stderr, "agent usage: relay %s\n", f)
	}
	if len(reports) == 0 {
		return errors.New("agent usage: no relay answered")
	}
	switch *format {
	case "json":
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(reports)
	case "csv":
		cw := csv.NewWriter(stdout)
		for i, rep := range reports {
			var b strings.Builder
			if err := writeUsageCSV(&b, rep.Report); err != nil {
				return err
			}
			recs, err := csv.NewReader(strings.NewReader(b.String())).ReadAll()
			if err != nil {
				return err
			}
			for j, rec := range recs {
				if j == 0 && i > 0 {
					continue // one header
				}
				head := "relay"
				if j > 0 {
					head = answered[i]
				}
				_ = cw.Write(append([]string{head}, rec...))
			}
		}
		cw.Flush()
		return cw.Error()
	}
	for i, rep := range reports {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		fmt.Fprintf(stdout, "agent %s on relay %s\n", rep.Agent, answered[i])
		if rep.Note != "" {
			fmt.Fprintf(stdout, "note: %s\n", rep.Note)
		}
		if !rep.Ledger.OK {
			fmt.Fprintf(stdout, "warning: the relay's usage ledger cannot write its file (%s)\n", rep.Ledger.Error)
		}
		if err := printUsageTotal(stdout, rep.Report, "TOTAL"); err != nil {
			return err
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("agent usage: %d of %d relays did not answer", len(failed), len(relays))
	}
	return nil
}

// askRelay asks one relay for the agent's usage.
func askRelay(ctx context.Context, h host.Host, ai peer.AddrInfo, secret []byte, key crypto.PrivKey, since string) (relay.AgentUsage, error) {
	var rep relay.AgentUsage
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := h.Connect(ctx, ai); err != nil {
		return rep, fmt.Errorf("connect: %w", err)
	}
	body, err := transport.QueryAgentUsage(ctx, h, ai.ID, secret, key, since)
	if err != nil {
		return rep, err
	}
	if err := json.Unmarshal(body, &rep); err != nil {
		return rep, fmt.Errorf("malformed answer: %w", err)
	}
	return rep, nil
}
