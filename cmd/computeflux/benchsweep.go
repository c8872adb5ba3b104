package main

import (
	"context"
	"errors"
	"io"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
)

// runSweep runs the capacity sweep (bench --sweep) and prints its tables
// or JSON.
func runSweep(ctx context.Context, cfg bench.Config, scenarios []bench.Scenario, asJSON bool, stdout io.Writer) error {
	if len(scenarios) != 1 {
		return errors.New("bench: --sweep runs one scenario")
	}
	cfg.Scenario = scenarios[0]
	rp, err := bench.RunSweep(ctx, cfg)
	if err != nil {
		return err
	}
	if asJSON {
		return rp.WriteJSON(stdout)
	}
	return rp.WriteTable(stdout)
}
