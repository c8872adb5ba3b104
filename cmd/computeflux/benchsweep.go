package main

import (
	"context"
	"errors"
	"io"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
)

// runSweep runs the capacity sweep (bench --sweep) and prints its tables
// or JSON; with plot, it also writes the chart of TTFT p90 against the
// rate offered there.
func runSweep(ctx context.Context, cfg bench.Config, scenarios []bench.Scenario, asJSON bool, plot string, stdout io.Writer) error {
	if len(scenarios) != 1 {
		return errors.New("bench: --sweep runs one scenario")
	}
	cfg.Scenario = scenarios[0]
	rp, err := bench.RunSweep(ctx, cfg)
	if err != nil {
		return err
	}
	if plot != "" {
		if err := writeSweepPlotFile(plot, rp); err != nil {
			return err
		}
	}
	if asJSON {
		return rp.WriteJSON(stdout)
	}
	return rp.WriteTable(stdout)
}
