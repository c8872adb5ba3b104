package ledger

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/internal/threadcpu"
)

// benchEntries are requests over a fixed set of rows: the steady state.
func benchEntries(now time.Time) []Entry {
	var es []Entry
	for i := range 1024 {
		e := Entry{Time: now, Client: fmt.Sprintf("client-%04d", i%1000), Model: fmt.Sprint("model-", i%4),
			PromptTokens: 1500, CachedTokens: 1000, CompletionTokens: 200, Serving: 800 * time.Millisecond}
		if i%20 == 0 {
			e.Provider = "provider-1"
		} else {
			e.Agent = fmt.Sprintf("agent-%03d", i%100)
		}
		es = append(es, e)
	}
	return es
}

func benchLedger(b testing.TB) (*Ledger, []Entry) {
	l, err := Open(Config{Path: filepath.Join(b.TempDir(), "ledger.db")})
	if err != nil {
		b.Fatal(err)
	}
	l.SetPrices(map[string]Prices{"provider-1": {Input: 2.5, CachedInput: 1.25, Output: 10}})
	es := benchEntries(time.Now())
	for _, e := range es {
		l.Record(e)
	}
	return l, es
}

// BenchmarkRecord is the request path's cost, with the flusher running
// every 2 s beside it.
func BenchmarkRecord(b *testing.B) {
	l, es := benchLedger(b)
	defer l.Close()
	b.ReportAllocs()
	b.ResetTimer()
	threadcpu.Measure(b, func() {
		for i := 0; i < b.N; i++ {
			l.Record(es[i%len(es)])
		}
	})
}

// BenchmarkRecordParallel records from every P at once.
func BenchmarkRecordParallel(b *testing.B) {
	l, es := benchLedger(b)
	defer l.Close()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := rand.IntN(len(es))
		for pb.Next() {
			l.Record(es[i%len(es)])
			i++
		}
	})
}

// BenchmarkCheck is a budget check with two peers' reports.
func BenchmarkCheck(b *testing.B) {
	l, es := benchLedger(b)
	defer l.Close()
	now := time.Now()
	for _, p := range []string{"relay-2", "relay-3"} {
		l.SetPeer(p, l.AppendSpent(nil, now))
	}
	budget := Budget{TokensPerDay: 1e12, TokensPerMonth: 1e13, CostPerMonth: 1e6}
	b.ReportAllocs()
	b.ResetTimer()
	threadcpu.Measure(b, func() {
		for i := 0; i < b.N; i++ {
			if l.Check(es[i%len(es)].Client, budget, now).Over {
				b.Fatal("over")
			}
		}
	})
}

// Recording into existing rows allocates nothing, and neither does a
// budget check.
func TestRecordAndCheckAllocateNothing(t *testing.T) {
	l, es := benchLedger(t)
	defer l.Close()
	i := 0
	if n := testing.AllocsPerRun(10_000, func() { l.Record(es[i%len(es)]); i++ }); n != 0 {
		t.Fatalf("Record allocates %v times per call", n)
	}
	now := time.Now()
	l.SetPeer("relay-2", l.AppendSpent(nil, now))
	b := Budget{TokensPerDay: 1e12}
	if n := testing.AllocsPerRun(10_000, func() { l.Check(es[i%len(es)].Client, b, now); i++ }); n != 0 {
		t.Fatalf("Check allocates %v times per call", n)
	}
}

// The large ledger: 10 million requests from 1,000 clients served by 100
// agents (and 3 providers) over 31 days. Built when LEDGER_LARGE names a
// file (kept there for the benchmark; built again if missing).
const largeRequests = 10_000_000

var largeStart = utc("2026-01-01T00:00:00Z")

func largeLedgerPath(tb testing.TB) string {
	path := os.Getenv("LEDGER_LARGE")
	if path == "" {
		tb.Skip("set LEDGER_LARGE=/path/to/file to build and measure the 10-million-request ledger")
	}
	if _, err := os.Stat(path); err == nil {
		return path
	}
	c := newClock(largeStart.Format(time.RFC3339))
	st, err := OpenBolt(path, DefaultMaxNames, DefaultMaxFileBytes)
	if err != nil {
		tb.Fatal(err)
	}
	st.noSync = true // building a month in seconds; the layout is the same
	st.fail()        // reopen with noSync
	l, err := Open(Config{Store: st, FlushInterval: time.Hour, Now: c.Now})
	if err != nil {
		tb.Fatal(err)
	}
	l.SetPrices(map[string]Prices{"provider-0": {Input: 2.5, CachedInput: 1.25, Output: 10},
		"provider-1": {Input: 0.15, CachedInput: 0.075, Output: 0.6}, "provider-2": {Input: 1, CachedInput: 1, Output: 4}})
	rng := rand.New(rand.NewPCG(3, 4))
	step := 31 * 24 * time.Hour / largeRequests
	built := time.Now()
	for i := range largeRequests {
		client := rng.IntN(1000)
		model := client % 4
		if rng.IntN(10) == 0 {
			model = rng.IntN(4)
		}
		e := Entry{Time: c.Now(), Client: fmt.Sprintf("client-%04d", client), Model: fmt.Sprint("model-", model),
			PromptTokens: int64(200 + rng.IntN(3800)), CompletionTokens: int64(50 + rng.IntN(450)),
			Error: rng.IntN(100) == 0, Estimated: rng.IntN(50) == 0, Serving: time.Duration(rng.IntN(3000)) * time.Millisecond}
		e.CachedTokens = e.PromptTokens * int64(rng.IntN(100)) / 100
		if rng.IntN(20) == 0 {
			e.Provider = fmt.Sprint("provider-", rng.IntN(3))
		} else {
			e.Agent = fmt.Sprintf("agent-%03d", model+4*rng.IntN(25)) // each agent serves one model
		}
		l.Record(e)
		c.Add(step)
		if i%1000 == 999 {
			if err := l.Flush(); err != nil {
				tb.Fatal(err)
			}
		}
	}
	if err := l.Close(); err != nil {
		tb.Fatal(err)
	}
	tb.Logf("built %s in %v", path, time.Since(built).Round(time.Second))
	return path
}

func openLarge(tb testing.TB) (*Ledger, *clock) {
	path := largeLedgerPath(tb)
	c := newClock(largeStart.Add(31*24*time.Hour - time.Minute).Format(time.RFC3339))
	l, err := Open(Config{Path: path, FlushInterval: time.Hour, Now: c.Now})
	if err != nil {
		tb.Fatal(err)
	}
	if h := l.Health(); !h.OK {
		tb.Fatal(h.Error)
	}
	return l, c
}

// The large ledger's file is under 100 MiB and holds every request.
func TestLargeLedger(t *testing.T) {
	l, c := openLarge(t)
	defer l.Close()
	fi, err := os.Stat(os.Getenv("LEDGER_LARGE"))
	if err != nil {
		t.Fatal(err)
	}
	r := mustUsage(t, l, c.Now().Add(-40*24*time.Hour), ByClient)
	var hourly, daily int
	_ = l.store.Scan(Hourly, 0, 1<<32, func(Row) { hourly++ })
	_ = l.store.Scan(Daily, 0, 1<<32, func(Row) { daily++ })
	t.Logf("file %.1f MiB; %d hourly and %d daily rows; %d requests, %d clients in the report", float64(fi.Size())/(1<<20), hourly, daily, r.Total.Requests, len(r.Rows))
	if r.Total.Requests != largeRequests || len(r.Rows) != 1000 {
		t.Fatalf("%d requests from %d clients, want %d from 1000", r.Total.Requests, len(r.Rows), largeRequests)
	}
	if fi.Size() >= 100<<20 {
		t.Fatalf("the file is %d bytes, over 100 MiB", fi.Size())
	}
}

// BenchmarkUsage30Days is a 30-day report of the large ledger, by each
// grouping.
func BenchmarkUsage30Days(b *testing.B) {
	l, c := openLarge(b)
	defer l.Close()
	since := c.Now().Add(-30 * 24 * time.Hour)
	for _, by := range []By{ByClient, ByAgent, ByModel, ByProvider} {
		b.Run(by.String(), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := l.Usage(since, by); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	// The same client report from hourly rows alone: what the daily rows
	// save.
	b.Run("client-from-hourly-rows", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			g := newGrouper(ByClient)
			if err := l.store.Scan(Hourly, hourOf(since), hourOf(c.Now())+1, func(r Row) { g.add(r.Kind, r.Name, r.Model, r.Counts) }); err != nil {
				b.Fatal(err)
			}
			if g.total.Requests == 0 {
				b.Fatal("no rows")
			}
		}
	})
}
