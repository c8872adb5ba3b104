package main

import (
	"cmp"
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"slices"
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

// writeSweepPlotFile writes the SVG chart of a capacity sweep to path.
func writeSweepPlotFile(path string, rp *bench.SweepReport) error {
	var b strings.Builder
	if err := writeSweepPlot(&b, rp); err != nil {
		return err
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("bench: --plot: %w", err)
	}
	return nil
}

// sweepColors tells the sweep chart's policies apart.
var sweepColors = []string{"#2b6cb0", "#c53030", "#2f855a", "#dd6b20", "#6b46c1", "#b7791f", "#319795", "#718096"}

// writeSweepPlot draws each policy's TTFT p90 against the requests per
// second offered, one line per policy with a marker at every speed tried,
// on a logarithmic time axis, with the SLO as a dashed line: where a line
// crosses it is that policy's capacity. A speed whose p90 is a failed
// request is drawn at the top edge.
func writeSweepPlot(w io.Writer, rp *bench.SweepReport) error {
	lo, hi, xmax := math.Inf(1), 0.0, 0.0
	for _, pr := range rp.Policies {
		for _, pt := range pr.Points {
			if pt.TTFT.P90 > 0 {
				lo, hi = min(lo, pt.TTFT.P90), max(hi, pt.TTFT.P90)
			}
			xmax = max(xmax, pt.Offered)
		}
	}
	if hi == 0 || xmax == 0 {
		return fmt.Errorf("bench: --plot: the sweep measured no time to first token")
	}
	if rp.SLO > 0 {
		lo, hi = min(lo, rp.SLO), max(hi, rp.SLO)
	}
	dlo, dhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if dhi == dlo {
		dhi++
	}
	const left, top, plotW, plotH, legendW = 70.0, 50.0, 560.0, 360.0, 210.0
	xmax = niceCeil(xmax)
	x := func(v float64) float64 { return left + plotW*v/xmax }
	y := func(v float64) float64 {
		if v <= 0 { // a failed request: over any bound
			return top
		}
		return top + plotH*(1-(math.Log10(v)-dlo)/(dhi-dlo))
	}
	bottom := top + plotH
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="12">`+"\n", left+plotW+legendW, bottom+50)
	fmt.Fprintf(w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(w, `<text x="10" y="20" font-size="14" font-weight="bold">%s</text>`+"\n", html.EscapeString(fmt.Sprintf(
		"TTFT p90 against offered load: %s, %d requests, %d engines, session keys %s", rp.Workload, rp.Requests, rp.Engines, rp.Keys)))
	for d := dlo; d <= dhi; d++ {
		yv := y(math.Pow(10, d))
		fmt.Fprintf(w, `<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#ddd"/><text x="%.0f" y="%.1f" text-anchor="end">%g ms</text>`+"\n",
			left, yv, left+plotW, yv, left-6, yv+4, math.Pow(10, d))
	}
	for i := 0; i <= 5; i++ {
		v := xmax * float64(i) / 5
		fmt.Fprintf(w, `<line x1="%.1f" y1="%.0f" x2="%.1f" y2="%.0f" stroke="#eee"/><text x="%.1f" y="%.0f" text-anchor="middle">%g</text>`+"\n",
			x(v), top, x(v), bottom, x(v), bottom+16, math.Round(v*100)/100)
	}
	fmt.Fprintf(w, `<text x="%.0f" y="%.0f" text-anchor="middle">requests per second offered (model time)</text>`+"\n", left+plotW/2, bottom+36)
	if rp.SLO > 0 {
		fmt.Fprintf(w, `<line class="slo" x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#000" stroke-dasharray="6 4"/><text x="%.0f" y="%.1f">SLO %g ms</text>`+"\n",
			left, y(rp.SLO), left+plotW, y(rp.SLO), left+4, y(rp.SLO)-4, rp.SLO)
	}
	for i, pr := range rp.Policies {
		c := sweepColors[i%len(sweepColors)]
		pts := slices.Clone(pr.Points)
		slices.SortFunc(pts, func(a, b bench.SweepPoint) int { return cmp.Compare(a.Offered, b.Offered) })
		var line strings.Builder
		for _, pt := range pts {
			fmt.Fprintf(&line, "%.1f,%.1f ", x(pt.Offered), y(pt.TTFT.P90))
		}
		fmt.Fprintf(w, `<polyline class="policy" data-policy="%s" points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n",
			html.EscapeString(pr.Policy), strings.TrimSpace(line.String()), c)
		for _, pt := range pts {
			p90 := "fail"
			if pt.TTFT.P90 > 0 {
				p90 = fmt.Sprintf("%.0f ms", pt.TTFT.P90)
			}
			fmt.Fprintf(w, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s at %.2f req/s: TTFT p90 %s, goodput %.2f req/s, hit %.1f%%</title></circle>`+"\n",
				x(pt.Offered), y(pt.TTFT.P90), c, html.EscapeString(pr.Policy), pt.Offered, p90, pt.GoodReqPerSec, 100*pt.HitRatio)
		}
		ly := top + float64(i)*18
		fmt.Fprintf(w, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="%s" stroke-width="2"/><text x="%.0f" y="%.0f">%s</text>`+"\n",
			left+plotW+12, ly, left+plotW+32, ly, c, left+plotW+36, ly+4, html.EscapeString(fmt.Sprintf("%s: %.2f req/s", pr.Policy, pr.MaxOffered)))
	}
	_, err := fmt.Fprintln(w, "</svg>")
	return err
}

// niceCeil rounds v up to a round axis end: 1, 1.5, 2, 2.5, 3, 4, 5, 6
// or 8 times a power of ten.
func niceCeil(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}
