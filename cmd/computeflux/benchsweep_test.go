package main

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"strconv"
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
	if rp.SLO != 400 || rp.Engines != 2 || len(rp.Policies) != 3 || rp.Policies[1].Policy != "round-robin" ||
		rp.Policies[2].Policy != bench.AtOnceLabel {
		t.Fatalf("report %+v", rp)
	}
	for _, r := range rp.Policies {
		// No bisection: the answer and the miss are a doubling apart.
		if r.FailedSpeed != 2*r.MaxSpeed {
			t.Errorf("%s: held %v, missed %v", r.Policy, r.MaxSpeed, r.FailedSpeed)
		}
	}
	out.Reset()
	svgPath := filepath.Join(t.TempDir(), "sweep.svg")
	if err := runBench(context.Background(), append(args, "--plot", svgPath), &out, io.Discard); err != nil || !strings.Contains(out.String(), "vs round-robin") ||
		!strings.Contains(out.String(), "vs at once") {
		t.Fatalf("table: %v\n%s", err, out.String())
	}
	svg, err := os.ReadFile(svgPath)
	if err != nil {
		t.Fatal(err)
	}
	if lines := sweepLines(t, string(svg)); len(lines) != 4 || len(lines["SLO"]) != 1 || len(lines["sticky"]) < 2 || len(lines["round-robin"]) < 2 ||
		len(lines[bench.AtOnceLabel]) < 2 {
		t.Fatalf("chart's lines %v", lines)
	}
	if err := runBench(context.Background(), append(args, "--scenario", "steady,degraded"), io.Discard, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "one scenario") {
		t.Fatalf("two scenarios: %v", err)
	}
}

// sweepLines parses a sweep chart: each policy's line as its points, and
// fails the test on XML that does not parse.
func sweepLines(t *testing.T, svg string) map[string][][2]float64 {
	t.Helper()
	lines := map[string][][2]float64{}
	dec := xml.NewDecoder(strings.NewReader(svg))
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return lines
		}
		if err != nil {
			t.Fatalf("not XML: %v\n%s", err, svg)
		}
		se, ok := tok.(xml.StartElement)
		if !ok || se.Name.Local != "polyline" && !(se.Name.Local == "line" && attr(se, "class") == "slo") {
			continue
		}
		name := attr(se, "data-policy")
		if se.Name.Local == "line" {
			y, _ := strconv.ParseFloat(attr(se, "y1"), 64)
			lines["SLO"] = [][2]float64{{0, y}}
			continue
		}
		for _, xy := range strings.Fields(attr(se, "points")) {
			a, b, _ := strings.Cut(xy, ",")
			x, err1 := strconv.ParseFloat(a, 64)
			y, err2 := strconv.ParseFloat(b, 64)
			if err1 != nil || err2 != nil {
				t.Fatalf("point %q", xy)
			}
			lines[name] = append(lines[name], [2]float64{x, y})
		}
	}
}

func attr(se xml.StartElement, name string) string {
	for _, a := range se.Attr {
		if a.Name.Local == name {
			return a.Value
		}
	}
	return ""
}

// The sweep's chart puts every speed tried on its policy's line, in the
// order of the rate offered, higher on the chart for a longer TTFT p90;
// the SLO line lies between a speed that held and one that missed, and a
// failed p90 is drawn at the top.
func TestSweepPlot(t *testing.T) {
	pt := func(offered, p90 float64) bench.SweepPoint {
		return bench.SweepPoint{Offered: offered, TTFT: bench.TTFTQuantiles{P90: p90}, Held: p90 > 0 && p90 <= 2000}
	}
	rp := &bench.SweepReport{Workload: "mooncake-trace", Requests: 4000, Engines: 4, SLO: 2000, Keys: "without", Policies: []bench.SweepResult{
		// Points in the order tried, not by rate.
		{Policy: "sticky", Points: []bench.SweepPoint{pt(3, 1200), pt(6, 2400), pt(4.3, 1400), pt(5.2, 1770)}, MaxOffered: 5.2},
		{Policy: "round-robin", Points: []bench.SweepPoint{pt(3, 1900), pt(6, -1)}, MaxOffered: 3},
	}}
	var b strings.Builder
	if err := writeSweepPlot(&b, rp); err != nil {
		t.Fatal(err)
	}
	lines := sweepLines(t, b.String())
	st, rr, slo := lines["sticky"], lines["round-robin"], lines["SLO"]
	if len(st) != 4 || len(rr) != 2 || len(slo) != 1 {
		t.Fatalf("lines %v", lines)
	}
	for i := 1; i < len(st); i++ {
		// Left to right by rate, and up (smaller y) as p90 grows.
		if st[i][0] <= st[i-1][0] || st[i][1] >= st[i-1][1] {
			t.Fatalf("sticky's line is not rising with the rate: %v", st)
		}
	}
	if sloY := slo[0][1]; !(st[3][1] < sloY && sloY < st[2][1]) || !(rr[0][1] > sloY) {
		t.Fatalf("SLO at y=%v, sticky %v, round-robin %v", sloY, st, rr)
	}
	if rr[1][1] > st[3][1] { // the failure is the top of the chart
		t.Fatalf("a failed p90 drawn at y=%v, below sticky's 2,400 ms at %v", rr[1][1], st[3][1])
	}
	if !strings.Contains(b.String(), "sticky at 5.20 req/s: TTFT p90 1770 ms") || !strings.Contains(b.String(), "round-robin: 3.00 req/s") {
		t.Fatalf("labels missing:\n%s", b.String())
	}
	if err := writeSweepPlot(io.Discard, &bench.SweepReport{Policies: []bench.SweepResult{{Policy: "sticky"}}}); err == nil {
		t.Fatal("a chart of nothing")
	}
}
