package main

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/computeflux/computeflux/relay/ledger"
)

// runUsage prints a relay's usage ledger from its admin API: per client,
// agent, model or provider endpoint since a time, with cache savings.
func runUsage(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := adminClientFlags("usage", stderr)
	since := fs.String("since", "7d", "report from this long ago (7d, 36h, 90m) or from an RFC 3339 `time`")
	by := fs.String("by", "client", "group by client, agent, model or provider")
	format := fs.String("format", "table", "output `format`: table, csv or json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("usage: unexpected arguments %q", fs.Args())
	}
	c, err := newAdminClient(fs)
	if err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	if _, err := ledger.ParseBy(*by); err != nil {
		return fmt.Errorf("usage: --%w", err)
	}
	if _, err := ledger.ParseSince(*since, time.Now()); err != nil {
		return fmt.Errorf("usage: --%w", err)
	}
	var print func(io.Writer, ledger.Report) error
	switch *format {
	case "table":
		print = printUsage
	case "csv":
		print = writeUsageCSV
	case "json":
		print = func(w io.Writer, r ledger.Report) error {
			enc := json.NewEncoder(w)
			enc.SetIndent("", "  ")
			return enc.Encode(r)
		}
	default:
		return fmt.Errorf("usage: --format %q: want table, csv or json", *format)
	}
	var rep ledger.Report
	q := url.Values{"since": {*since}, "by": {*by}}
	if err := c.do(ctx, http.MethodGet, "/admin/v1/usage?"+q.Encode(), nil, &rep); err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	if !rep.Ledger.OK {
		fmt.Fprintf(stderr, "warning: the relay's usage ledger cannot write its file (%s); counts since then are in its memory only\n", rep.Ledger.Error)
	}
	return print(stdout, rep)
}

// printUsage writes a report for a terminal, the total last.
func printUsage(w io.Writer, r ledger.Report) error {
	return printUsageTotal(w, r, "TOTAL (all requests)")
}

// printUsageTotal is printUsage with the total's label.
func printUsageTotal(w io.Writer, r ledger.Report, total string) error {
	fmt.Fprintf(w, "usage by %s from %s to %s (UTC)\n", r.By, r.Since.UTC().Format("2006-01-02 15:04"), r.Until.UTC().Format("2006-01-02 15:04"))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%s\tREQUESTS\tPROMPT\tCACHED\tCACHED %%\tCOMPLETION\tERRORS\tESTIMATED\tSERVING\tCOST\tSAVED\t\n", strings.ToUpper(r.By))
	line := func(key string, c ledger.Counts) {
		pct := "-"
		if c.PromptTokens > 0 {
			pct = strconv.FormatFloat(100*float64(c.CachedTokens)/float64(c.PromptTokens), 'f', 1, 64)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\t%d\t%d\t%d\t%s\t%.4f\t%.4f\t\n", key, c.Requests, c.PromptTokens, c.CachedTokens, pct,
			c.CompletionTokens, c.Errors, c.Estimated, c.Serving.Round(time.Second), c.Cost.Float64(), c.Saved.Float64())
	}
	for _, row := range r.Rows {
		line(row.Key, row.Counts)
	}
	line(total, r.Total)
	return tw.Flush()
}

// writeUsageCSV writes a report's rows as CSV with a header; the total,
// which counts every request whatever the grouping, is in the JSON form.
func writeUsageCSV(w io.Writer, r ledger.Report) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{r.By, "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "estimated", "serving_seconds", "cost", "saved"})
	i := func(v int64) string { return strconv.FormatInt(v, 10) }
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	for _, row := range r.Rows {
		c := row.Counts
		_ = cw.Write([]string{row.Key, i(c.Requests), i(c.PromptTokens), i(c.CachedTokens), i(c.CompletionTokens), i(c.Errors), i(c.Estimated),
			f(c.Serving.Seconds()), f(c.Cost.Float64()), f(c.Saved.Float64())})
	}
	cw.Flush()
	return cw.Error()
}
