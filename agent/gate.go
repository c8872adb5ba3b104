package agent

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// The gate.
//
// The agent lets at most its dispatch limit of requests reach the engine at
// once (scheduler.Limiter: the engine's batch, measured from its metrics,
// or fixed by the operator) and announces that limit to its relays as its
// capacity, so that each relay keeps the requests it cannot place in its
// own fair queue. Several relays share the engine, and each places up to
// the whole limit: the requests beyond it wait here, in the same fair
// order (scheduler.Queue) by the client each relay names in
// transport.HeaderFlow, so
// that a client on one relay is not served after a flood on another.

// errGateFull is the answer when too many requests wait at the gate.
var errGateFull = errors.New("too many requests are waiting for this agent's engine")

// gate admits requests to the engine up to the dispatch limit.
type gate struct {
	mu       sync.Mutex // guards the following fields
	lim      *scheduler.Limiter
	limit    int // 0: no gate
	batch    int // the engine's own batch size the limit is fixed at; 0: none
	inFlight int // admitted, not yet released
	q        *scheduler.Queue[chan struct{}]
}

// newGate returns a gate; disabled gates admit everything and announce
// no limit.
func newGate(cfg scheduler.LimitConfig, disabled bool) *gate {
	q, err := scheduler.NewQueue[chan struct{}](scheduler.QueueConfig{})
	if err != nil {
		panic(err) // the default configuration is valid
	}
	g := &gate{q: q}
	if !disabled {
		g.lim = scheduler.NewLimiter(cfg)
		g.limit = g.lim.Limit()
	}
	return g
}

// Limit returns the dispatch limit announced to relays; 0 means none.
func (g *gate) Limit() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.limit
}

// setBatch fixes the limit at the batch the engine says it runs (n > 0),
// unless the limit is off or the operator fixed it (fixed); a batch of 0
// returns to measuring. It reports the limit and whether it changed.
func (g *gate) setBatch(n, max int, fixed bool) (limit int, changed bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.lim == nil || fixed || n == g.batch {
		return g.limit, false
	}
	g.batch = n
	if max > 0 {
		n = min(n, max)
	}
	g.lim = scheduler.NewLimiter(scheduler.LimitConfig{Fixed: n, Max: max})
	if g.limit == g.lim.Limit() {
		return g.limit, false
	}
	g.limit = g.lim.Limit()
	g.dispatchLocked()
	return g.limit, true
}

// waiting returns the requests waiting at the gate.
func (g *gate) waiting() int { return g.q.Len() }

// observe feeds a metrics sample to the limiter and reports whether the
// limit changed.
func (g *gate) observe(met EngineMetrics, known bool, now time.Time) (limit int, changed bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.lim == nil {
		return 0, false
	}
	known = known && (met.Engine != "" || met.Running+met.Waiting > 0)
	n := g.lim.Observe(scheduler.LimitSample{At: now, Known: known, InFlight: g.inFlight,
		Running: met.Running, Waiting: met.Waiting, KVCacheUsage: met.KVCacheUsage})
	if n == g.limit {
		return n, false
	}
	g.limit = n
	g.dispatchLocked()
	return n, true
}

// enter waits until the request may reach the engine, in fair order among
// those waiting, and returns the function that releases its place. It
// fails when ctx ends first or too many wait.
func (g *gate) enter(ctx context.Context, f transport.Flow) (release func(), err error) {
	rel := func() { g.release(f) }
	g.mu.Lock()
	if g.limit == 0 || (g.inFlight < g.limit && g.q.Len() == 0) {
		g.inFlight++
		g.q.Serving(f.Client, f.Cost)
		g.mu.Unlock()
		return rel, nil
	}
	ch := make(chan struct{})
	it, err := g.q.Push("", f.Client, f.Class, f.Weight, f.Cost, ch)
	g.mu.Unlock()
	if err != nil {
		return nil, errGateFull
	}
	select {
	case <-ch:
		return rel, nil
	case <-ctx.Done():
		if g.q.Remove(it) {
			return nil, ctx.Err()
		}
		<-ch // dispatched meanwhile: give the place back
		rel()
		return nil, ctx.Err()
	}
}

// release ends the place of a request of f and admits the next waiting
// ones.
func (g *gate) release(f transport.Flow) {
	g.mu.Lock()
	g.inFlight--
	g.q.Done(f.Client, f.Cost)
	g.dispatchLocked()
	g.mu.Unlock()
}

func (g *gate) dispatchLocked() {
	for g.limit == 0 || g.inFlight < g.limit {
		it := g.q.Peek("")
		if it == nil || !g.q.Pop(it) {
			return
		}
		g.inFlight++
		close(it.Value)
	}
}

// gateError answers a request the gate did not admit.
func gateError(w http.ResponseWriter, err error) {
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusTooManyRequests, "agent_busy", err.Error())
}
