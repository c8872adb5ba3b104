package main

import (
	"encoding/xml"
	"io"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
)

func TestPlot(t *testing.T) {
	rp := &bench.Report{Mode: "sim", Scenario: "steady", Engines: 4, Results: []bench.Result{
		{Policy: "sticky", TTFT: bench.Quantiles{P50: 5, P95: 29, P99: 83}},
		{Policy: "round-robin", TTFT: bench.Quantiles{P50: 27, P95: 123, P99: 192}},
	}}
	var b strings.Builder
	if err := writePlot(&b, []*bench.Report{rp}); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	// Well-formed XML with one bar per policy and percentile.
	dec := xml.NewDecoder(strings.NewReader(svg))
	bars := 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not XML: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "title" {
			bars++
		}
	}
	if bars != 6 || !strings.Contains(svg, "round-robin p99 192.0 ms") || !strings.Contains(svg, "steady (sim, 4 engines)") {
		t.Fatalf("%d bars in\n%s", bars, svg)
	}
	if err := writePlot(io.Discard, []*bench.Report{{Results: []bench.Result{{Policy: "sticky"}}}}); err == nil {
		t.Fatal("a chart of nothing")
	}
}
