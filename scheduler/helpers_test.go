package scheduler

import (
	"errors"
	"sync"
	"testing"
	"time"
)

// fakeClock is a Clock that moves only when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newTest returns a scheduler on a fake clock with a fixed seed and eps
// registered.
func newTest(t testing.TB, cfg Config, eps ...Endpoint) (*Scheduler, *fakeClock) {
	t.Helper()
	clk := newFakeClock()
	cfg.Clock = clk
	if cfg.Seed == 0 {
		cfg.Seed = 1
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, ep := range eps {
		s.Upsert(ep)
	}
	return s, clk
}

func ep(id string, models ...string) Endpoint {
	if len(models) == 0 {
		models = []string{"m"}
	}
	return Endpoint{ID: id, Models: models}
}

var (
	ok200   = Outcome{Status: 200, Latency: 100 * time.Millisecond}
	fail500 = Outcome{Status: 500}
	connErr = Outcome{Err: errors.New("connection refused")}
)

// pick picks for req on a fresh attempt and fails the test on error.
func mustPick(t testing.TB, a *Attempt) Choice {
	t.Helper()
	c, err := a.Pick()
	if err != nil {
		t.Fatalf("Pick(%+v): %v", a.req, err)
	}
	return c
}

// do runs one request to completion: Begin, Pick, Report(o).
func do(t testing.TB, s *Scheduler, r Request, o Outcome) Choice {
	t.Helper()
	a := s.Begin(r)
	c := mustPick(t, a)
	a.Report(c, o)
	return c
}

func status(t testing.TB, s *Scheduler, id string) EndpointStatus {
	t.Helper()
	for _, st := range s.Snapshot() {
		if st.ID == id {
			return st
		}
	}
	t.Fatalf("no endpoint %q in snapshot", id)
	return EndpointStatus{}
}

func wantUnavailable(t testing.TB, err error) *UnavailableError {
	t.Helper()
	var ue *UnavailableError
	if !errors.As(err, &ue) || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("got error %v, want *UnavailableError", err)
	}
	return ue
}
