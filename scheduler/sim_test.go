package scheduler

import (
	"container/heap"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// simResult is what a simulated multi-turn chat workload measured.
type simResult struct {
	requests  map[string]int
	cacheHits int // requests sent to the engine that served the session's previous turn
	followUps int // requests that were not a session's first turn (the oracle's hits)
	total     int
	refused   int // picks refused for lack of capacity (retried later)
}

func (r simResult) imbalance() float64 {
	maxN, sum := 0, 0
	for _, n := range r.requests {
		maxN, sum = max(maxN, n), sum+n
	}
	return float64(maxN) / (float64(sum) / float64(len(r.requests)))
}

type simEvent struct {
	at   time.Duration
	sess int
	done bool // a response arrives (else: the session sends its next turn)
	att  *Attempt
	c    Choice
}

type simQueue []simEvent

func (q simQueue) Len() int           { return len(q) }
func (q simQueue) Less(i, j int) bool { return q[i].at < q[j].at }
func (q simQueue) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *simQueue) Push(x any)        { *q = append(*q, x.(simEvent)) }
func (q *simQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// simulate runs sessions of 2..16 turns with think time between turns
// against engines that answer a turn in 0.3 s when it lands where the
// session's previous turn ran (its KV cache is there) and in 2.5 s
// otherwise. Sessions arrive every 400 ms on average. Picks refused for
// capacity are retried 200 ms later, as a relay would queue them.
func simulate(t *testing.T, p Policy, engines, capacity, sessions int, seed uint64) simResult {
	return simulateWith(t, p, engines, capacity, sessions, seed, 400*time.Millisecond, 2*time.Second, 9)
}

// simulateWith is simulate with the mean gap between session arrivals and
// the think time between turns (min, plus up to spread-1 seconds) given.
func simulateWith(t *testing.T, p Policy, engines, capacity, sessions int, seed uint64, gap, think time.Duration, spread int) simResult {
	s, clk := newTest(t, Config{Policy: p, Seed: int64(seed)})
	for i := range engines {
		s.Upsert(Endpoint{ID: fmt.Sprint("engine-", i), Models: []string{"m"}, Capacity: capacity})
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	res := simResult{requests: map[string]int{}}
	turnsLeft := make([]int, sessions)
	last := make([]string, sessions)
	var q simQueue
	var at time.Duration
	for i := range sessions {
		at += time.Duration(rng.ExpFloat64() * float64(gap))
		turnsLeft[i] = 2 + rng.IntN(15)
		heap.Push(&q, simEvent{at: at, sess: i})
	}
	start := clk.Now()
	for steps := 0; q.Len() > 0 && steps < 1_000_000; steps++ {
		ev := heap.Pop(&q).(simEvent)
		clk.Advance(ev.at - clk.Now().Sub(start))
		key := fmt.Sprint("session-", ev.sess)
		if ev.done {
			lat := 2500 * time.Millisecond
			if ev.c.EndpointID == last[ev.sess] {
				lat = 300 * time.Millisecond
			}
			ev.att.Report(ev.c, Outcome{Status: 200, Latency: lat})
			last[ev.sess] = ev.c.EndpointID
			if turnsLeft[ev.sess]--; turnsLeft[ev.sess] > 0 {
				think := think + time.Duration(rng.IntN(spread))*time.Second
				heap.Push(&q, simEvent{at: ev.at + lat + think, sess: ev.sess})
			}
			continue
		}
		a := s.Begin(Request{Model: "m", SessionKey: key})
		c, err := a.Pick()
		if errors.Is(err, ErrUnavailable) {
			res.refused++
			heap.Push(&q, simEvent{at: ev.at + 200*time.Millisecond, sess: ev.sess})
			continue
		} else if err != nil {
			t.Fatal(err)
		}
		res.total++
		res.requests[c.EndpointID]++
		if last[ev.sess] != "" {
			res.followUps++
			if c.EndpointID == last[ev.sess] {
				res.cacheHits++
			}
		}
		// The response time is decided when it completes; the event
		// carries the pick.
		lat := 2500 * time.Millisecond
		if c.EndpointID == last[ev.sess] {
			lat = 300 * time.Millisecond
		}
		heap.Push(&q, simEvent{at: ev.at + lat, sess: ev.sess, done: true, att: a, c: c})
	}
	for _, st := range s.Snapshot() {
		if st.InFlight != 0 {
			t.Fatalf("simulation leaked slots: %+v", st)
		}
	}
	return res
}

// TestStickyMultiTurnChat checks, on a simulated multi-turn chat workload,
// that the sticky policy keeps at least 90% of an oracle's KV-cache hits
// (the oracle sends every follow-up turn to the engine holding its cache)
// while keeping requests per engine within 1.3 of the mean.
func TestStickyMultiTurnChat(t *testing.T) {
	for _, tt := range []struct {
		name              string
		engines, capacity int
		sessions          int
	}{
		{"4 engines, unlimited", 4, 0, 300},
		{"4 engines, capacity 8", 4, 8, 300},
		{"8 engines, capacity 2", 8, 2, 400},
		{"3 engines, capacity 3 under pressure", 3, 3, 400},
		{"4 engines, sparse arrivals, long thinking", 4, 0, 100},
	} {
		t.Run(tt.name, func(t *testing.T) {
			gap, think, spread := 400*time.Millisecond, 2*time.Second, 9
			if strings.Contains(tt.name, "sparse") {
				gap, think, spread = 3*time.Second, time.Second, 20
			}
			for seed := uint64(1); seed <= 3; seed++ {
				r := simulateWith(t, PolicySticky, tt.engines, tt.capacity, tt.sessions, seed, gap, think, spread)
				hit, oracle := float64(r.cacheHits)/float64(r.total), float64(r.followUps)/float64(r.total)
				t.Logf("seed %d: sticky hit ratio %.3f, oracle %.3f (%.1f%%), imbalance %.3f, refused picks %d",
					seed, hit, oracle, 100*hit/oracle, r.imbalance(), r.refused)
				if tt.capacity == 0 && seed == 1 {
					// The workload is one where placement matters.
					rr := simulate(t, PolicyRoundRobin, tt.engines, tt.capacity, tt.sessions, seed)
					if rrHit := float64(rr.cacheHits) / float64(rr.total); rrHit > 0.5*oracle {
						t.Errorf("round-robin hit ratio %.3f: the workload does not reward affinity", rrHit)
					}
				}
				if hit < 0.9*oracle {
					t.Errorf("seed %d: sticky KV hit ratio %.3f is below 90%% of the oracle's %.3f", seed, hit, oracle)
				}
				if im := r.imbalance(); im >= 1.3 {
					t.Errorf("seed %d: load imbalance %.3f (requests per engine %v)", seed, im, r.requests)
				}
			}
		})
	}
}
