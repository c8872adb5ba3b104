package ledger

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m)
}

// clock is a settable clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock(s string) *clock { return &clock{t: utc(s)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// open opens a ledger whose flusher never ticks by itself: tests flush.
func open(t *testing.T, cfg Config, c *clock) *Ledger {
	t.Helper()
	cfg.Now = c.Now
	if cfg.FlushInterval == 0 {
		cfg.FlushInterval = time.Hour
	}
	l, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func mustUsage(t *testing.T, l *Ledger, since time.Time, by By) Report {
	t.Helper()
	r, err := l.Usage(since, by)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func rowOf(r Report, key string) Counts {
	for _, row := range r.Rows {
		if row.Key == key {
			return row.Counts
		}
	}
	return Counts{}
}

// Counts survive a restart and continue; budgets count what was spent
// before the restart.
func TestRestartContinuesTotals(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	c := newClock("2026-03-10T12:00:00Z")
	l := open(t, Config{Path: path}, c)
	l.SetPrices(map[string]Prices{"openai": {Input: 2, CachedInput: 1, Output: 8}})
	for i := range 10 {
		l.Record(Entry{Time: c.Now(), Client: "alice", Model: "llama", Agent: "gpu-1", PromptTokens: 100, CachedTokens: 60, CompletionTokens: 10, Serving: time.Second})
		l.Record(Entry{Time: c.Now(), Client: "bob", Model: "gpt", Provider: "openai", PromptTokens: 1000, CachedTokens: 500, CompletionTokens: 100, Error: i == 0, Estimated: i < 3})
	}
	// Not flushed yet: queries and budgets see it already.
	if r := mustUsage(t, l, c.Now().Add(-time.Hour), ByClient); r.Total.Requests != 20 {
		t.Fatalf("before a flush: %+v", r.Total)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	c.Add(2 * time.Hour)
	l = open(t, Config{Path: path}, c)
	l.SetPrices(map[string]Prices{"openai": {Input: 2, CachedInput: 1, Output: 8}})
	l.Record(Entry{Time: c.Now(), Client: "alice", Model: "llama", Agent: "gpu-1", PromptTokens: 1, CompletionTokens: 1})
	r := mustUsage(t, l, c.Now().Add(-24*time.Hour), ByClient)
	alice, bob := rowOf(r, "alice"), rowOf(r, "bob")
	if alice.Requests != 11 || alice.PromptTokens != 1001 || alice.CachedTokens != 600 || alice.CompletionTokens != 101 {
		t.Fatalf("alice %+v", alice)
	}
	// bob: 10 x (500 input x 2 + 500 cached x 1 + 100 output x 8) per million.
	wantCost := moneyOf(10 * (500*2 + 500*1 + 100*8) / 1e6)
	wantSaved := moneyOf(10 * 500 * (2 - 1) / 1e6)
	if bob.Requests != 10 || bob.Errors != 1 || bob.Estimated != 3 || bob.Cost != wantCost || bob.Saved != wantSaved {
		t.Fatalf("bob %+v, want cost %d saved %d", bob, wantCost, wantSaved)
	}
	if r.Total.Requests != 21 || r.Total.Cost != wantCost {
		t.Fatalf("total %+v", r.Total)
	}
	if s := l.Spent("bob", c.Now()); s.DayTokens != 11000 || s.MonthTokens != 11000 || s.MonthCost != wantCost {
		t.Fatalf("bob's spending after the restart %+v", s)
	}
	if v := l.Check("bob", Budget{TokensPerDay: 11000}, c.Now()); !v.Over || v.Limit != LimitDay {
		t.Fatalf("bob's day budget after the restart: %+v", v)
	}
	if v := l.Check("bob", Budget{TokensPerDay: 11001}, c.Now()); v.Over {
		t.Fatalf("bob under budget refused: %+v", v)
	}
	ra := mustUsage(t, l, c.Now().Add(-24*time.Hour), ByAgent)
	if g := rowOf(ra, "gpu-1"); g.Requests != 11 || g.Serving != 10*time.Second {
		t.Fatalf("agent row %+v", g)
	}
	rp := mustUsage(t, l, c.Now().Add(-24*time.Hour), ByProvider)
	if p := rowOf(rp, "openai"); p.Requests != 10 || p.Cost != wantCost {
		t.Fatalf("provider row %+v", p)
	}
	rm := mustUsage(t, l, c.Now().Add(-24*time.Hour), ByModel)
	if rowOf(rm, "gpt").Requests != 10 || rowOf(rm, "llama").Requests != 11 {
		t.Fatalf("model rows %+v", rm.Rows)
	}
	// An agent's own view: its rows by model, its total, no one else's.
	l.Record(Entry{Time: c.Now(), Client: "carol", Model: "qwen", Agent: "gpu-2", PromptTokens: 7, CompletionTokens: 3})
	l.Record(Entry{Time: c.Now(), Client: "carol", Model: "llama", Agent: "gpu-1", PromptTokens: 5, CompletionTokens: 5})
	own, err := l.AgentUsage(c.Now().Add(-24*time.Hour), "gpu-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(own.Rows) != 1 || own.Rows[0].Key != "llama" || own.Rows[0].Requests != 12 || own.Total.Requests != 12 || own.By != "model" {
		t.Fatalf("gpu-1's own usage %+v", own)
	}
	if other, err := l.AgentUsage(c.Now().Add(-24*time.Hour), "gpu-2"); err != nil || len(other.Rows) != 1 || other.Rows[0].Key != "qwen" || other.Total.Requests != 1 {
		t.Fatalf("gpu-2's own usage %+v, %v", other, err)
	}
	if none, err := l.AgentUsage(c.Now().Add(-24*time.Hour), "gpu-9"); err != nil || len(none.Rows) != 0 || none.Total.Requests != 0 {
		t.Fatalf("an agent that served nothing %+v, %v", none, err)
	}
}

// Queries over spans of hours and days agree with a plain sum of what was
// recorded, whether it sits in hourly rows, daily rows or memory; old
// hourly rows are pruned and daily rows still count them.
func TestUsageOverTime(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	c := newClock("2026-01-25T00:30:00Z")
	l := open(t, Config{Path: path, HourlyRetention: 10 * 24 * time.Hour, DailyRetention: 40 * 24 * time.Hour}, c)
	type rec struct {
		at     time.Time
		tokens int64
	}
	var recs []rec
	// Every 5 hours for 60 days, one request of a growing size; a flush
	// after each (the last few stay pending).
	for i := range 60 * 24 / 5 {
		e := Entry{Time: c.Now(), Client: fmt.Sprint("c", i%3), Model: "m", Agent: "a", PromptTokens: int64(i + 1)}
		l.Record(e)
		recs = append(recs, rec{c.Now(), e.PromptTokens})
		if i < 60*24/5-3 {
			if err := l.Flush(); err != nil {
				t.Fatal(err)
			}
		}
		c.Add(5 * time.Hour)
	}
	now := c.Now()
	for _, since := range []time.Duration{3 * time.Hour, 13 * time.Hour, 7 * 24 * time.Hour, 9*24*time.Hour + 7*time.Hour, 30 * 24 * time.Hour, 39 * 24 * time.Hour} {
		r := mustUsage(t, l, now.Add(-since), ByClient)
		var want int64
		var n int64
		for _, x := range recs {
			if !x.at.Before(r.Since) {
				want += x.tokens
				n++
			}
		}
		if r.Total.PromptTokens != want || r.Total.Requests != n {
			t.Errorf("since %v (report from %s): %d requests %d tokens, want %d %d", since, r.Since.Format(time.RFC3339), r.Total.Requests, r.Total.PromptTokens, n, want)
		}
		if since < 10*24*time.Hour && !r.Since.Equal(now.Add(-since).Truncate(time.Hour)) {
			t.Errorf("since %v: report from %s, want the hour", since, r.Since)
		}
		if since > 10*24*time.Hour && !r.Since.Equal(now.Add(-since).UTC().Truncate(24*time.Hour)) {
			t.Errorf("since %v: report from %s, want the day (hourly rows are gone)", since, r.Since)
		}
	}
	// Hourly rows older than 10 days are gone, daily rows older than 40.
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	oldest := map[Resolution]int64{}
	for _, res := range []Resolution{Hourly, Daily} {
		oldest[res] = 1 << 40
		if err := l.store.Scan(res, 0, 1<<32, func(r Row) { oldest[res] = min(oldest[res], r.Period) }); err != nil {
			t.Fatal(err)
		}
	}
	if h := oldest[Hourly]; h < hourOf(now)-10*24 {
		t.Errorf("an hourly row of %s is kept past 10 days", hourTime(h))
	}
	if d := oldest[Daily]; d != dayOf(now)-40 {
		t.Errorf("the oldest daily row is of %s, want 40 days back", dayTime(d))
	}
}

// faultyStore wraps a store with injected faults.
type faultyStore struct {
	Store
	mu sync.Mutex
	// applyThenFail: the next Apply commits, then reports an error (an
	// fsync that failed after the data reached the disk).
	applyThenFail int
	// failApply: the next Applies fail without committing.
	failApply int
}

func (f *faultyStore) Apply(seq uint64, d []Delta) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.failApply > 0:
		f.failApply--
		return false, errors.New("disk full")
	case f.applyThenFail > 0:
		f.applyThenFail--
		_, err := f.Store.Apply(seq, d)
		return false, errors.Join(err, errors.New("fsync: input/output error"))
	}
	return f.Store.Apply(seq, d)
}

// A commit that reached the file but reported failure is retried and not
// counted twice; a commit that failed is retried and not lost. While it
// fails, Health says so and budgets fail as configured.
func TestFailedCommitsNeitherLoseNorDoubleCount(t *testing.T) {
	for _, failClosed := range []bool{false, true} {
		t.Run(fmt.Sprint("fail closed ", failClosed), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ledger.db")
			bs, err := OpenBolt(path, 100, 0)
			if err != nil {
				t.Fatal(err)
			}
			fs := &faultyStore{Store: bs}
			c := newClock("2026-03-10T12:00:00Z")
			l := open(t, Config{Store: fs, FailClosed: failClosed}, c)
			rec := func(n int) {
				for range n {
					l.Record(Entry{Time: c.Now(), Client: "alice", Model: "m", PromptTokens: 10})
				}
			}
			budget := Budget{TokensPerDay: 1000}
			rec(5)
			fs.applyThenFail = 1
			if err := l.Flush(); err == nil {
				t.Fatal("the injected failure was not reported")
			}
			h := l.Health()
			if h.OK || !strings.Contains(h.Error, "fsync") || h.FailedFlushes != 1 || h.Since == nil {
				t.Fatalf("health after a failed flush: %+v", h)
			}
			v := l.Check("alice", budget, c.Now())
			if v.Over != failClosed || (failClosed && v.Limit != LimitUnavailable) {
				t.Fatalf("check while failing (fail closed %v): %+v", failClosed, v)
			}
			if r := mustUsage(t, l, c.Now().Add(-time.Hour), ByClient); r.Total.Requests != 5 {
				t.Fatalf("a query while a batch waits: %d requests, want 5", r.Total.Requests)
			}
			rec(3)
			fs.failApply = 2
			for range 2 {
				if l.Flush() == nil {
					t.Fatal("the injected failure was not reported")
				}
			}
			rec(2)
			if err := l.Flush(); err != nil {
				t.Fatal(err)
			}
			if h := l.Health(); !h.OK || h.FlushedRequests != 10 || h.FailedFlushes != 3 {
				t.Fatalf("health after recovery: %+v", h)
			}
			if v := l.Check("alice", budget, c.Now()); v.Over {
				t.Fatalf("check after recovery: %+v", v)
			}
			r := mustUsage(t, l, c.Now().Add(-time.Hour), ByClient)
			if r.Total.Requests != 10 || r.Total.PromptTokens != 100 {
				t.Fatalf("after failed commits: %d requests %d tokens, want 10 and 100 (once each)", r.Total.Requests, r.Total.PromptTokens)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			// And in the file, read afresh.
			bs2, err := OpenBolt(path, 100, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer bs2.Close()
			var n int64
			_ = bs2.Scan(Hourly, 0, 1<<32, func(r Row) {
				if r.Kind == KindClient {
					n += r.Requests
				}
			})
			if n != 10 {
				t.Fatalf("the file holds %d requests, want 10", n)
			}
		})
	}
}

// A corrupt file: the ledger counts in memory, says so, and writes what it
// counted once the file is usable again.
func TestCorruptFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	if err := os.WriteFile(path, []byte(strings.Repeat("not a database ", 1000)), 0o600); err != nil {
		t.Fatal(err)
	}
	c := newClock("2026-03-10T12:00:00Z")
	l := open(t, Config{Path: path}, c)
	h := l.Health()
	if h.OK || !strings.Contains(h.Error, path) || h.FailClosed {
		t.Fatalf("health with a corrupt file: %+v", h)
	}
	l.Record(Entry{Time: c.Now(), Client: "alice", Model: "m", PromptTokens: 10})
	if _, err := l.Usage(c.Now().Add(-time.Hour), ByClient); err == nil {
		t.Fatal("a query of a corrupt file succeeded")
	}
	if v := l.Check("alice", Budget{TokensPerDay: 10}, c.Now()); !v.Over || v.Limit != LimitDay {
		t.Fatalf("fail open counts in memory: %+v", v)
	}
	// The operator moves the file aside: the next flush starts a new one
	// and writes what was counted.
	if err := os.Rename(path, path+".corrupt"); err != nil {
		t.Fatal(err)
	}
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	if r := mustUsage(t, l, c.Now().Add(-time.Hour), ByClient); r.Total.Requests != 1 || !r.Ledger.OK {
		t.Fatalf("after the file was replaced: %+v", r)
	}
}

// A file that cannot grow (full disk): flushes fail loudly, counts wait,
// budgets fail closed when the operator chose so.
func TestFullFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	c := newClock("2026-03-10T12:00:00Z")
	l := open(t, Config{Path: path, MaxFileBytes: 64 << 10, FailClosed: true}, c)
	if !l.Health().OK {
		t.Fatalf("a fresh file: %+v", l.Health())
	}
	var err error
	for i := 0; i < 200 && err == nil; i++ {
		for j := range 100 {
			l.Record(Entry{Time: c.Now(), Client: fmt.Sprint("client-", i, "-", j), Model: "m", PromptTokens: 1})
		}
		err = l.Flush()
	}
	if err == nil || !strings.Contains(err.Error(), "maximum size") {
		t.Fatalf("a file past its bound: %v", err)
	}
	if v := l.Check("client-0-0", Budget{TokensPerMonth: 1e9}, c.Now()); !v.Over || v.Limit != LimitUnavailable || v.RetryAfter(c.Now()) != time.Minute {
		t.Fatalf("fail closed: %+v", v)
	}
	if v := l.Check("client-0-0", Budget{}, c.Now()); v.Over {
		t.Fatalf("a client without a budget was refused: %+v", v)
	}
}

// A second relay on the same file does not wait forever for it.
func TestLockedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	c := newClock("2026-03-10T12:00:00Z")
	open(t, Config{Path: path}, c)
	l2 := open(t, Config{Path: path}, c)
	if h := l2.Health(); h.OK || !strings.Contains(h.Error, "another process holds the file") {
		t.Fatalf("health of the second ledger: %+v", h)
	}
}

// Peers' reports add to a client's own use in Check, for their day and
// month only.
func TestCheckWithPeers(t *testing.T) {
	c := newClock("2026-03-10T12:00:00Z")
	l := open(t, Config{Path: filepath.Join(t.TempDir(), "ledger.db")}, c)
	l.Record(Entry{Time: c.Now(), Client: "alice", Model: "m", PromptTokens: 40})
	b := Budget{TokensPerDay: 100}
	if v := l.Check("alice", b, c.Now()); v.Over {
		t.Fatalf("own use alone: %+v", v)
	}
	now := c.Now()
	l.SetPeer("relay-2", []ClientSpent{{Client: "alice", Spent: Spent{Day: dayOf(now), Month: monthOf(now), DayTokens: 30, MonthTokens: 30}}})
	l.SetPeer("relay-3", []ClientSpent{{Client: "alice", Spent: Spent{Day: dayOf(now), Month: monthOf(now), DayTokens: 30, MonthTokens: 30}}})
	v := l.Check("alice", b, now)
	if !v.Over || v.Used != 100 {
		t.Fatalf("own 40 + peers 60 against 100: %+v", v)
	}
	l.ForgetPeer("relay-3")
	if v := l.Check("alice", b, now); v.Over {
		t.Fatalf("after forgetting a peer: %+v", v)
	}
	l.SetPeer("relay-2", []ClientSpent{{Client: "alice", Spent: Spent{Day: dayOf(now) - 1, Month: monthOf(now), DayTokens: 1000, MonthTokens: 1000}}})
	if v := l.Check("alice", b, now); v.Over {
		t.Fatalf("a peer's report of yesterday spent today: %+v", v)
	}
	got := l.AppendSpent(nil, now)
	if len(got) != 1 || got[0].Client != "alice" || got[0].DayTokens != 40 {
		t.Fatalf("AppendSpent %+v: want own use only", got)
	}
}

func TestMergePeer(t *testing.T) {
	c := newClock("2026-03-10T12:00:00Z")
	l := open(t, Config{Path: filepath.Join(t.TempDir(), "ledger.db")}, c)
	now := c.Now()
	spent := func(n int64) Spent { return Spent{Day: dayOf(now), Month: monthOf(now), DayTokens: n, MonthTokens: n} }
	b := Budget{TokensPerDay: 100}
	// A report in two parts: both count, and a later part replaces only
	// the clients it names.
	l.MergePeer("relay-2", []ClientSpent{{Client: "alice", Spent: spent(60)}})
	l.MergePeer("relay-2", []ClientSpent{{Client: "bob", Spent: spent(100)}})
	if v := l.Check("alice", b, now); v.Over {
		t.Fatalf("alice after the first part: %+v", v)
	}
	if v := l.Check("alice", Budget{TokensPerDay: 60}, now); !v.Over || v.Used != 60 {
		t.Fatalf("alice after the first part, against 60: %+v", v)
	}
	if v := l.Check("bob", b, now); !v.Over {
		t.Fatalf("bob after the second part: %+v", v)
	}
	l.MergePeer("relay-2", []ClientSpent{{Client: "alice", Spent: spent(100)}})
	if v := l.Check("alice", b, now); !v.Over || v.Used != 100 {
		t.Fatalf("alice's newer report: %+v", v)
	}
	if v := l.Check("bob", b, now); !v.Over {
		t.Fatalf("bob dropped by a part that did not name him: %+v", v)
	}
	// Bounded: a peer naming more clients than MaxPeerClients keeps the
	// first ones.
	many := make([]ClientSpent, MaxPeerClients+10)
	for i := range many {
		many[i] = ClientSpent{Client: fmt.Sprintf("c%d", i), Spent: spent(1)}
	}
	l.MergePeer("relay-3", many)
	l.peersMu.RLock()
	n := len(l.peers["relay-3"])
	l.peersMu.RUnlock()
	if n != MaxPeerClients {
		t.Fatalf("relay-3's report holds %d clients, want %d", n, MaxPeerClients)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Path: "x", HourlyRetention: time.Minute},
		{Path: "x", DailyRetention: time.Hour},
		{Path: "x", MaxModelsPerHour: -1},
		{Path: "x", FlushInterval: -time.Second},
	} {
		if _, err := Open(cfg); err == nil {
			t.Errorf("Open(%+v) accepted", cfg)
		}
	}
}

// A flood of distinct model names from clients: every request counts, the
// names past the cap count as Other, and memory and the file keep at most
// the cap's names.
func TestModelNamesBounded(t *testing.T) {
	c := newClock("2026-03-10T12:00:00Z")
	l := open(t, Config{Path: filepath.Join(t.TempDir(), "ledger.db"), MaxModelsPerHour: 100}, c)
	for i := range 5000 {
		l.Record(Entry{Time: c.Now(), Client: "mallory", Model: fmt.Sprint("model-", i), Agent: "gpu-1", PromptTokens: 1})
		if i%1000 == 0 {
			if err := l.Flush(); err != nil {
				t.Fatal(err)
			}
		}
	}
	h := l.Health()
	if h.Folded != 2*4900 || h.PendingRows > 2*101 {
		t.Fatalf("health %+v: want 4,900 requests folded in the client's and the agent's rows, at most 202 rows", h)
	}
	r := mustUsage(t, l, c.Now().Add(-time.Hour), ByModel)
	if len(r.Rows) != 101 || r.Total.Requests != 5000 || rowOf(r, Other).Requests != 4900 {
		t.Fatalf("%d model rows, %d requests, %d under %q", len(r.Rows), r.Total.Requests, rowOf(r, Other).Requests, Other)
	}
	if s := l.Spent("mallory", c.Now()); s.DayTokens != 5000 {
		t.Fatalf("the client's spending %+v: folded requests must still count", s)
	}
}

// Records, flushes and queries at once: a query counts every request
// recorded before it began and none not yet started, never one twice or
// none in a flush in flight; at the end the file has them all.
func TestConcurrentRecordFlushQuery(t *testing.T) {
	c := newClock("2026-03-10T12:00:00Z")
	l := open(t, Config{Path: filepath.Join(t.TempDir(), "ledger.db")}, c)
	const writers, each = 4, 3000
	var started, done atomic.Int64
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				started.Add(1)
				l.Record(Entry{Time: c.Now(), Client: fmt.Sprint("c", w), Model: fmt.Sprint("m", i%3), Agent: "a", PromptTokens: 1})
				done.Add(1)
			}
		}()
	}
	stop := make(chan struct{})
	flushed := make(chan error, 1)
	go func() {
		var err error
		for {
			select {
			case <-stop:
				flushed <- err
				return
			default:
				err = errors.Join(err, l.Flush())
			}
		}
	}()
	queries := 0
	for done.Load() < writers*each {
		lo := done.Load()
		r := mustUsage(t, l, c.Now().Add(-time.Hour), ByClient)
		hi := started.Load()
		if r.Total.Requests < lo || r.Total.Requests > hi {
			t.Fatalf("a query counted %d requests; %d were done before it and %d started by its end", r.Total.Requests, lo, hi)
		}
		queries++
	}
	wg.Wait()
	close(stop)
	if err := <-flushed; err != nil {
		t.Fatal(err)
	}
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	if r := mustUsage(t, l, c.Now().Add(-time.Hour), ByClient); r.Total.Requests != writers*each || r.Total.PromptTokens != writers*each {
		t.Fatalf("at the end: %+v", r.Total)
	}
	t.Logf("%d queries while recording", queries)
}

// populate fills zero fields only: every field set by hand survives it.
func TestConfigPopulateKeepsFields(t *testing.T) {
	var cfg Config
	v := reflect.ValueOf(&cfg).Elem()
	for i := range v.NumField() {
		f := v.Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString("x")
		case reflect.Int, reflect.Int64:
			f.SetInt(7)
		case reflect.Bool:
			f.SetBool(true)
		case reflect.Func:
			f.Set(reflect.ValueOf(func() time.Time { return time.Unix(7, 0) }))
		case reflect.Interface, reflect.Struct:
			// Store and Logger: nil and the zero logger are their defaults.
		default:
			t.Fatalf("field %s of kind %s: extend this test", v.Type().Field(i).Name, f.Kind())
		}
	}
	got := cfg.populate()
	gv := reflect.ValueOf(got)
	for i := range v.NumField() {
		name := v.Type().Field(i).Name
		if name == "Now" {
			if !got.Now().Equal(time.Unix(7, 0)) {
				t.Errorf("Now replaced")
			}
			continue
		}
		if v.Field(i).Kind() != reflect.Interface && v.Field(i).Kind() != reflect.Struct && !reflect.DeepEqual(v.Field(i).Interface(), gv.Field(i).Interface()) {
			t.Errorf("%s: set %v, populate made it %v", name, v.Field(i).Interface(), gv.Field(i).Interface())
		}
	}
	if z := (Config{}).populate(); z.FlushInterval != 2*time.Second || z.HourlyRetention != 90*24*time.Hour || z.MaxModelsPerHour != 1000 || z.Now == nil {
		t.Errorf("defaults %+v", z)
	}
}

// The first identity to claim a name keeps it, across a reopen; the
// claims are bounded like the names, and a name past the bound is
// nobody's.
func TestClaimAgent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	s, err := OpenBolt(path, 3, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ agent, owner, want string }{
		{"gpu-1", "peer-a", "peer-a"},
		{"gpu-1", "peer-b", "peer-a"}, // taken by another identity
		{"gpu-1", "peer-a", "peer-a"}, // a rejoin
		{"gpu-2", "peer-b", "peer-b"},
		{"gpu-3", "peer-c", "peer-c"},
		{"gpu-4", "peer-d", ""}, // past the bound: unclaimed
	} {
		if got, err := s.Claim(c.agent, c.owner); err != nil || got != c.want {
			t.Fatalf("claim %s by %s: %q, %v; want %q", c.agent, c.owner, got, err, c.want)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = OpenBolt(path, 3, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if got, _ := s.Claim("gpu-2", "peer-z"); got != "peer-b" {
		t.Fatalf("gpu-2 after a reopen: owner %q, want peer-b", got)
	}
	if got, _ := s.Claim("gpu-5", "peer-e"); got != "" {
		t.Fatalf("a new name after a reopen at the bound: owner %q, want none", got)
	}
}
