package main

import (
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"strings"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
)

// writePlotFile writes the SVG chart of reports to path.
func writePlotFile(path string, reports []*bench.Report) error {
	var b strings.Builder
	if err := writePlot(&b, reports); err != nil {
		return err
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("bench: --plot: %w", err)
	}
	return nil
}

// writePlot draws, for each report (scenario), each policy's time to first
// token as three bars, p50, p95 and p99, on a logarithmic axis in
// milliseconds of model time, so that a 5 ms median and a 200 ms tail fit
// one chart.
func writePlot(w io.Writer, reports []*bench.Report) error {
	type bar struct {
		label string
		q     [3]float64
	}
	var groups [][]bar
	var titles []string
	lo, hi := math.Inf(1), 0.0
	for _, rp := range reports {
		var g []bar
		for _, r := range rp.Results {
			q := [3]float64{r.TTFT.P50, r.TTFT.P95, r.TTFT.P99}
			for _, v := range q {
				if v > 0 {
					lo, hi = min(lo, v), max(hi, v)
				}
			}
			g = append(g, bar{label: r.Policy, q: q})
		}
		groups = append(groups, g)
		titles = append(titles, fmt.Sprintf("%s (%s, %d engines)", rp.Scenario, rp.Mode, rp.Engines))
	}
	if hi == 0 {
		return fmt.Errorf("bench: --plot: no time to first token was measured")
	}
	// Decades that cover the data.
	dlo, dhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if dhi == dlo {
		dhi++
	}
	const left, right, top, rowH, barH, plotW = 150.0, 30.0, 50.0, 22.0, 6.0, 560.0
	x := func(v float64) float64 {
		if v <= 0 {
			return left
		}
		return left + plotW*(math.Log10(v)-dlo)/(dhi-dlo)
	}
	rows := 0
	for _, g := range groups {
		rows += len(g) + 2
	}
	height := top + float64(rows)*rowH + 40
	width := left + plotW + right
	colors := [3]string{"#2b6cb0", "#dd6b20", "#c53030"}
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(w, `<text x="%.0f" y="20" font-size="14" font-weight="bold">Time to first token per routing policy (ms of model time, log scale)</text>`+"\n", left-140)
	for i, name := range []string{"p50", "p95", "p99"} {
		fmt.Fprintf(w, `<rect x="%.0f" y="30" width="10" height="10" fill="%s"/><text x="%.0f" y="39">%s</text>`+"\n", left+float64(i)*70, colors[i], left+float64(i)*70+14, name)
	}
	bottom := height - 30
	for d := dlo; d <= dhi; d++ {
		xv := x(math.Pow(10, d))
		fmt.Fprintf(w, `<line x1="%.1f" y1="%.0f" x2="%.1f" y2="%.0f" stroke="#ddd"/>`+"\n", xv, top, xv, bottom)
		fmt.Fprintf(w, `<text x="%.1f" y="%.0f" text-anchor="middle">%g</text>`+"\n", xv, bottom+15, math.Pow(10, d))
	}
	y := top
	for gi, g := range groups {
		fmt.Fprintf(w, `<text x="%.0f" y="%.0f" font-weight="bold">%s</text>`+"\n", left-140, y+14, html.EscapeString(titles[gi]))
		y += rowH
		for _, b := range g {
			fmt.Fprintf(w, `<text x="%.0f" y="%.0f" text-anchor="end">%s</text>`+"\n", left-8, y+12, html.EscapeString(b.label))
			for i, v := range b.q {
				fmt.Fprintf(w, `<rect x="%.0f" y="%.1f" width="%.1f" height="%.0f" fill="%s"><title>%s %s %.1f ms</title></rect>`+"\n",
					left, y+float64(i)*barH, x(v)-left, barH, colors[i], html.EscapeString(b.label), []string{"p50", "p95", "p99"}[i], v)
			}
			fmt.Fprintf(w, `<text x="%.1f" y="%.0f" fill="#444">%.0f</text>`+"\n", x(b.q[0])+4, y+9, b.q[0])
			y += rowH
		}
		y += rowH
	}
	_, err := fmt.Fprintln(w, "</svg>")
	return err
}
