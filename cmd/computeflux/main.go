// Command computeflux is the single ComputeFlux binary: the relay that serves
// the OpenAI API on a public host, the agent that runs next to a home GPU, a
// simulated engine, the routing benchmark and a self-contained demo.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// command is one subcommand of the binary.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

// commands lists the subcommands in the order usage prints them.
var commands = []command{
	{"relay", "serve the OpenAI API on a public host and route requests to agents", runRelay},
	{"agent", "join a relay from behind NAT and serve a local inference engine", runAgent},
	{"sim-engine", "run a simulated OpenAI-compatible engine with a prefix cache", runSimEngine},
	{"bench", "compare routing policies on the same workload, side by side", runBench},
	{"demo", "start engines, agents and a relay on loopback and show routing at work", runDemo},
	{"version", "print the version and the commit the binary was built from", runVersion},
	{"status", "print a relay's routing table (agents and provider endpoints) from its admin API", runStatus},
	{"admin", "disable, enable, drain or weigh an endpoint through a relay's admin API", runAdmin},
	{"usage", "print who used and who served what since a time, with cache savings, from a relay's admin API", runUsage},
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	if err := servePprof(os.Getenv(envPprof)); err != nil {
		fmt.Fprintf(os.Stderr, "computeflux: %s: %v\n", envPprof, err)
		os.Exit(2)
	}
	err := dispatch(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	flushLogs() // buffered log lines go out before the process exits
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.Is(err, errUsage):
		os.Exit(2)
	default:
		fmt.Fprintf(os.Stderr, "computeflux: %v\n", err)
		os.Exit(1)
	}
}

// errUsage reports a command line that names no known subcommand.
var errUsage = errors.New("usage")

func dispatch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		usage(stderr)
		return errUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		usage(stdout)
		return nil
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c.run(ctx, args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "computeflux: unknown command %q\n\n", args[0])
	usage(stderr)
	return errUsage
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Usage: computeflux <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-11s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'computeflux <command> -h' for a command's flags.")
}
