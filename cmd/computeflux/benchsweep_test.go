package main

import (
	"context"
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
)

// bench --sweep runs the capacity sweep with the command's flags and
// prints its report; it runs one scenario.
func TestBenchSweepCommand(t *testing.T) {
	args := []string{"--mode", "sim", "--trace", "internal/bench/testdata/mooncake_head.jsonl", "--engines", "2",
		"--policies", "sticky,round-robin", "--sweep", "--slo", "400ms", "--sweep-bisect", "-1", "--quiet"}
	var out strings.Builder
	if err := runBench(context.Background(), append(args, "--json"), &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	var rp bench.SweepReport
	if err := json.Unmarshal([]byte(out.String()), &rp); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if rp.SLO != 400 || rp.Engines != 2 || len(rp.Policies) != 2 || rp.Policies[1].Policy != "round-robin" {
		t.Fatalf("report %+v", rp)
	}
	for _, r := range rp.Policies {
		// No bisection: the answer and the miss are a doubling apart.
		if r.FailedSpeed != 2*r.MaxSpeed {
			t.Errorf("%s: held %v, missed %v", r.Policy, r.MaxSpeed, r.FailedSpeed)
		}
	}
	out.Reset()
	if err := runBench(context.Background(), args, &out, io.Discard); err != nil || !strings.Contains(out.String(), "vs round-robin") {
		t.Fatalf("table: %v\n%s", err, out.String())
	}
	if err := runBench(context.Background(), append(args, "--scenario", "steady,degraded"), io.Discard, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "one scenario") {
		t.Fatalf("two scenarios: %v", err)
	}
}
