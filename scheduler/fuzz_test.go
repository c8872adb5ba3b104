package scheduler

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"
)

// FuzzPick drives a scheduler with an arbitrary sequence of registrations,
// health changes, picks, outcomes and clock moves, and checks after every
// pick that the chosen endpoint was allowed: known, enabled, not draining,
// serving the model, not dead-keyed or used in this request (tracked here
// independently of the scheduler), its breaker admitting, within capacity
// and probe limits, and not avoided while an unavoided endpoint was free.
// Failed picks must be justified too.
func FuzzPick(f *testing.F) {
	f.Add([]byte{0, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 4})
	f.Add([]byte{1, 0, 3, 3, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 4, 4, 4, 4})
	f.Add([]byte{4, 3, 1, 2, 3, 4, 4, 4, 4, 5, 13, 29, 45, 61, 6, 31, 4, 4, 4, 4})
	f.Add([]byte{2, 0, 11, 0, 22, 3, 3, 4, 4, 5, 21, 4, 5, 37, 6, 3, 4, 4})
	f.Add([]byte{3, 0, 7, 0, 23, 1, 3, 3, 3, 4, 4, 4, 4, 5, 5, 1, 4, 4, 7})
	f.Add([]byte("\x00\x03\x14\x24\x34\x44\x05\x15\x25\x35\x06\x16\x26\x04\x14\x24\x34\x07"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 || len(data) > 512 {
			return
		}
		fz := newFuzzer(t, Policy(data[0]%8))
		for i := 1; i < len(data); i++ {
			fz.step(data[i], data[(i+1)%len(data)])
		}
		fz.finish()
	})
}

var (
	fuzzIDs      = []string{"e0", "e1", "e2", "e3", "e4", "e5"}
	fuzzKeys     = []string{"", "s1", "s2", "s3", "s4", "s5", "s6", "s7"}
	fuzzModels   = []string{"m0", "m1", "m2"}
	fuzzOutcomes = []Outcome{
		{Status: 200, Latency: 50 * time.Millisecond},
		{Status: 200, Latency: 2 * time.Second},
		{Status: 401}, {Status: 403},
		{Status: 429}, {Status: 429, RetryAfter: 5 * time.Second},
		{Status: 500}, {Status: 503}, {Status: 400},
		{Err: errors.New("connection refused")},
		{Err: context.DeadlineExceeded, Latency: 10 * time.Second},
		{Err: context.Canceled},
	}
	fuzzSteps = []time.Duration{0, time.Second, 10 * time.Second, 31 * time.Second, 61 * time.Second, 5 * time.Minute}
)

type fuzzAttempt struct {
	a          *Attempt
	dead, used []string
	open       []Choice
}

type fuzzer struct {
	t        *testing.T
	s        *Scheduler
	clk      *fakeClock
	attempts []*fuzzAttempt
}

func newFuzzer(t *testing.T, p Policy) *fuzzer {
	s, clk := newTest(t, Config{Policy: p, ColdStartSamples: 3, MaxSessions: 5, VirtualNodes: 4})
	return &fuzzer{t: t, s: s, clk: clk}
}

func (fz *fuzzer) step(b, arg byte) {
	id := fuzzIDs[arg%6]
	switch b % 8 {
	case 0:
		var models []string
		for i, m := range fuzzModels {
			if arg&(1<<i) != 0 {
				models = append(models, m)
			}
		}
		fz.s.Upsert(Endpoint{ID: id, Models: models, Disabled: arg&0x08 != 0 && arg&0x40 != 0,
			Capacity: int(arg>>4) % 3, Weight: float64(arg>>6) + 0.5, Priority: int(arg >> 7)})
	case 1:
		fz.s.SetHealth(id, Health{Suspect: arg&1 != 0, Draining: arg&2 != 0 && arg&4 != 0,
			Running: int(arg>>3) % 4, Waiting: int(arg>>5) % 2, KVCacheUsage: float64(arg>>4) / 15})
	case 2:
		if arg%4 == 0 {
			fz.s.Remove(id)
		}
	case 3:
		if len(fz.attempts) < 4 {
			r := Request{Model: fuzzModels[arg%3]}
			if arg&0x10 != 0 {
				r.Model = "unknown"
			}
			if k := arg >> 5; k != 0 {
				r.SessionKey = fuzzKeys[k]
			}
			if arg&0x08 != 0 {
				// A prompt prefix, some of it published by an endpoint.
				r.Prefix = []uint64{1, 2, 3, uint64(arg)}
				fz.s.IndexApply(fmt.Sprint("e", arg%4), r.Prefix[:arg%4], nil)
			}
			fz.attempts = append(fz.attempts, &fuzzAttempt{a: fz.s.Begin(r)})
		}
	case 4:
		if len(fz.attempts) > 0 {
			fz.pick(fz.attempts[int(arg)%len(fz.attempts)])
		}
	case 5:
		if len(fz.attempts) > 0 {
			i := int(arg) % len(fz.attempts)
			fa := fz.attempts[i]
			if len(fa.open) == 0 {
				fz.attempts = slices.Delete(fz.attempts, i, i+1)
				return
			}
			c := fa.open[0]
			fa.open = fa.open[1:]
			switch fa.a.Report(c, fuzzOutcomes[int(arg>>2)%len(fuzzOutcomes)]) {
			case ClassDeadKey:
				fa.dead = append(fa.dead, c.EndpointID)
			case ClassRateLimited:
				fa.used = append(fa.used, c.EndpointID)
			}
		}
	case 6:
		fz.clk.Advance(fuzzSteps[int(arg)%len(fuzzSteps)])
	case 7:
		for _, st := range fz.s.Snapshot() {
			if st.InFlight < 0 || st.Probes < 0 || st.Probes > 3 || st.Probes > st.InFlight {
				fz.t.Fatalf("bad accounting: %+v", st)
			}
		}
	}
}

func (fz *fuzzer) pick(fa *fuzzAttempt) {
	t, s := fz.t, fz.s
	r := fa.a.Request()
	c, err := fa.a.Pick()
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	// What the scheduler should have seen as admitted, from state alone.
	admitted := func(e *endpoint) (ok, avoid bool) {
		if e.disabled || e.health.Draining || !e.serves(r.Model) ||
			slices.Contains(fa.dead, e.id) || slices.Contains(fa.used, e.id) {
			return false, false
		}
		return fa.a.admit(e, now, true)
	}
	if err != nil {
		if errors.Is(err, ErrUnknownModel) {
			for _, e := range s.endpoints {
				if e.serves(r.Model) {
					t.Fatalf("ErrUnknownModel for %q, but %s serves it", r.Model, e.id)
				}
			}
			return
		}
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("unexpected error %v", err)
		}
		for _, e := range s.endpoints {
			if ok, _ := admitted(e); ok {
				t.Fatalf("unavailable, but %s was admitted", e.id)
			}
		}
		return
	}
	fa.open = append(fa.open, c)
	e := s.endpoints[c.EndpointID]
	switch {
	case e == nil:
		t.Fatalf("picked unknown endpoint %s", c.EndpointID)
	case e.disabled:
		t.Fatalf("picked disabled %s", e.id)
	case e.health.Draining:
		t.Fatalf("picked draining %s", e.id)
	case !e.serves(r.Model):
		t.Fatalf("picked %s for model %q; it serves %v", e.id, r.Model, e.models)
	case slices.Contains(fa.dead, e.id):
		t.Fatalf("picked %s after it answered 401/403 in this request", e.id)
	case slices.Contains(fa.used, e.id):
		t.Fatalf("picked %s after it answered 429 in this request", e.id)
	case e.breakerState(now) == BreakerOpen:
		t.Fatalf("picked %s with its breaker open", e.id)
	case e.br == BreakerHalfOpen && (!c.Probe || e.probes > 3):
		t.Fatalf("half-open %s: probe %v, %d probes", e.id, c.Probe, e.probes)
	case e.capacity > 0 && c.Affinity != AffinityHit && e.inFlight > e.capacity:
		t.Fatalf("placed on %s beyond capacity: %d in flight of %d", e.id, e.inFlight, e.capacity)
	case e.capacity > 0 && e.inFlight > 2*e.capacity:
		t.Fatalf("affinity hit on %s beyond twice its capacity: %d in flight of %d", e.id, e.inFlight, e.capacity)
	}
	if e.health.Suspect || slices.Contains(fa.a.failed, e.id) {
		for _, o := range s.endpoints {
			if ok, avoid := admitted(o); o != e && ok && !avoid {
				t.Fatalf("picked avoided %s while %s was free", e.id, o.id)
			}
		}
	}
}

// finish reports everything still open and checks that the accounting
// returns to zero.
func (fz *fuzzer) finish() {
	for _, fa := range fz.attempts {
		for _, c := range fa.open {
			fa.a.Report(c, Outcome{Status: 200})
		}
	}
	for _, st := range fz.s.Snapshot() {
		if st.InFlight != 0 || st.Probes != 0 {
			fz.t.Fatalf("accounting leaked: %+v", st)
		}
	}
}
