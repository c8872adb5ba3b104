package scheduler

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// benchScheduler returns a scheduler with n warm endpoints (past cold
// start, with success counts, latency samples and some load), all serving
// model "m".
func benchScheduler(b *testing.B, n int) *Scheduler {
	// The real clock: time moves between picks, as in production, so the
	// decay arithmetic is paid for.
	s, err := New(Config{ColdStartSamples: 1, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	for i := range n {
		s.Upsert(Endpoint{ID: "agent-" + strconv.Itoa(i), Models: []string{"m", "other"}, Capacity: 64})
	}
	s.mu.Lock()
	for i, e := range s.groups["m"].eps {
		e.requests = 100
		e.good = 90
		e.bad = float64(i % 7)
		e.ewma, e.hasEWMA = float64(time.Duration(50+i%200)*time.Millisecond), true
		e.health = Health{Running: i % 5, KVCacheUsage: float64(i%10) / 10}
	}
	s.mu.Unlock()
	return s
}

// measure runs f as the benchmark loop and reports cpu-ns/op.
func measure(b *testing.B, f func()) {
	b.ReportAllocs()
	b.ResetTimer()
	start, n := cpuTime(), 0
	for b.Loop() {
		f()
		n++
	}
	b.ReportMetric(float64(cpuTime()-start)/float64(max(n, 1)), "cpu-ns/op")
}

// BenchmarkPick measures one Pick and its Report on a reused Attempt:
// "sticky" is an affinity hit; "endpoints=N" is a scored pick among N
// endpoints without a session key. The parallel variants run the same from
// GOMAXPROCS goroutines.
func BenchmarkPick(b *testing.B) {
	ok := Outcome{Status: 200, Latency: 80 * time.Millisecond}
	b.Run("sticky", func(b *testing.B) {
		s := benchScheduler(b, 1000)
		a := s.Begin(Request{Model: "m", SessionKey: "session-1"})
		a.Report(mustPick(b, a), ok)
		measure(b, func() {
			c, _ := a.Pick()
			if c.Affinity != AffinityHit {
				b.Fatal("not a hit")
			}
			a.Report(c, ok)
		})
	})
	for _, n := range []int{10, 1000, 10000} {
		b.Run(fmt.Sprintf("endpoints=%d", n), func(b *testing.B) {
			s := benchScheduler(b, n)
			a := s.Begin(Request{Model: "m"})
			measure(b, func() {
				c, err := a.Pick()
				if err != nil {
					b.Fatal(err)
				}
				a.Report(c, ok)
			})
		})
	}
	// A keyless chat request of 32 KiB, hashed (PromptBlocks) and placed
	// by its prefix: every endpoint holds the system prompt, and a few
	// hold longer parts of the conversation.
	for _, n := range []int{16, 1000} {
		b.Run(fmt.Sprintf("prefix-32KiB/endpoints=%d", n), func(b *testing.B) {
			s := benchScheduler(b, n)
			sys := strings.Repeat("You are a careful assistant; answer briefly. ", 80)
			conv := strings.Repeat("user asks about caches, assistant explains paging. ", 32<<10/51)
			body, err := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
				{"role": "system", "content": sys}, {"role": "user", "content": conv}}})
			if err != nil {
				b.Fatal(err)
			}
			chain := PromptBlocks(nil, body, PrefixConfig{})
			for i := range n {
				held := len(chain) / 8
				if i%4 == 0 {
					held = len(chain) * (i%16 + 1) / 17
				}
				s.IndexReset("agent-"+strconv.Itoa(i), chain[:held])
			}
			dst := make([]uint64, 0, DefaultMaxBlocks)
			a := s.Begin(Request{Model: "m"})
			b.SetBytes(int64(len(body)))
			measure(b, func() {
				dst = PromptBlocks(dst[:0], body, PrefixConfig{})
				a.req.Prefix = dst
				c, err := a.Pick()
				if err != nil || c.CachedBlocks == 0 {
					b.Fatal(err, c.CachedBlocks)
				}
				a.Report(c, ok)
			})
		})
	}
	for _, name := range []string{"sticky", "endpoints=10", "endpoints=1000"} {
		b.Run("parallel/"+name, func(b *testing.B) {
			n := 10
			if name != "endpoints=10" {
				n = 1000
			}
			s := benchScheduler(b, n)
			var g atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			start := cpuTime()
			defer func() { b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op") }()
			b.RunParallel(func(pb *testing.PB) {
				r := Request{Model: "m"}
				if name == "sticky" {
					r.SessionKey = "session-" + strconv.Itoa(int(g.Add(1)))
				}
				a := s.Begin(r)
				for pb.Next() {
					c, err := a.Pick()
					if err != nil {
						b.Error(err)
						return
					}
					a.Report(c, ok)
				}
			})
		})
	}
}

// BenchmarkRequest measures a whole request's scheduling: Begin, Pick and
// Report, with a session affinity hit.
func BenchmarkRequest(b *testing.B) {
	s := benchScheduler(b, 1000)
	r := Request{Model: "m", SessionKey: "session-1"}
	do(b, s, r, ok200)
	measure(b, func() {
		a := s.Begin(r)
		c, _ := a.Pick()
		a.Report(c, ok200)
	})
}
