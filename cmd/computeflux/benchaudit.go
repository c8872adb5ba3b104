package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/computeflux/computeflux/agent/llamaengine"
	"github.com/computeflux/computeflux/cmd/computeflux/internal/chaos"
)

// runBenchAudit runs the audit scenario: this binary as a relay, sim
// engines and agents (and llama.cpp engines when installed), some agents
// serving another model under the claimed name, for everything or behind
// a front that tries to tell audits apart, under the traffic of chat
// front ends (sampled, a user field, no session key); it prints who
// served what and when the cheaters left routing, for each part:
//
//	catch      3 honest sim agents and 1 liar; of llama.cpp: 3 honest
//	           agents and 1 front; 2 honest and 1 liar; 1 honest, 1 liar
//	           and a provider endpoint serving the model
//	honest     4 honest sim agents and 3 honest llama.cpp agents, audits
//	           off, then on: every agent's share side by side
//	collusion  1 honest agent and 2 liars: voices alone, then with an
//	           operator's reference
func runBenchAudit(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var parts string
	var noLlama bool
	cfg := chaos.AuditConfig{}
	fs := newLiveFlags("audit", stderr)
	fs.StringVar(&parts, "parts", "catch,honest,collusion", "comma-separated `parts`: catch, honest, collusion")
	fs.DurationVar(&cfg.Duration, "duration", 10*time.Minute, "load of the honest part (catch: a fourth of it, at least 150s; collusion: a tenth, at least 1m)")
	fs.IntVar(&cfg.Workers, "clients", 4, "concurrent clients")
	fs.BoolVar(&noLlama, "no-llama", false, "leave out the llama.cpp engines")
	var err error
	if cfg.Binary, cfg.Progress, err = fs.parse(args); err != nil {
		return err
	}
	llama := !noLlama
	if err := llamaengine.Available(""); llama && err != nil {
		fmt.Fprintf(stderr, "bench: audit: without llama.cpp engines: %v\n", err)
		llama = false
	}
	full := cfg.Duration
	for _, part := range strings.Split(parts, ",") {
		var runs []chaos.AuditConfig
		switch part {
		case "catch":
			c := cfg
			c.Duration = max(full/4, 150*time.Second)
			c.Groups = []chaos.AuditGroup{{Honest: 3, Liars: 1}}
			if llama {
				c.Groups = append(c.Groups, chaos.AuditGroup{Honest: 3, Fronts: 1, Llama: true},
					chaos.AuditGroup{Honest: 2, Liars: 1, Llama: true}, chaos.AuditGroup{Honest: 1, Liars: 1, Provider: true, Llama: true})
			}
			runs = append(runs, c)
		case "honest":
			c := cfg
			c.Groups = []chaos.AuditGroup{{Honest: 4}}
			if llama {
				c.Groups = append(c.Groups, chaos.AuditGroup{Honest: 3, Llama: true})
			}
			off := c
			off.RelayArgs = []string{"--no-audits"}
			runs = append(runs, off, c)
		case "collusion":
			c := cfg
			c.Duration = max(full/10, time.Minute)
			c.Groups = []chaos.AuditGroup{{Honest: 1, Liars: 2}}
			ref := c
			ref.Groups = []chaos.AuditGroup{{Honest: 1, Liars: 2, Reference: true}}
			runs = append(runs, c, ref)
		default:
			return fmt.Errorf("bench: audit: unknown part %q (catch, honest, collusion)", part)
		}
		for _, c := range runs {
			fmt.Fprintf(stdout, "== %s: %v, relay %v\n", part, c.Groups, c.RelayArgs)
			rctx, cancel := context.WithTimeout(ctx, c.Duration+5*time.Minute)
			res, err := chaos.RunAudit(rctx, c)
			cancel()
			if res != nil {
				res.Write(stdout)
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}
