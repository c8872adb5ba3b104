package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// enterAsync enters g for f in a goroutine and reports on the returned
// channel once admitted.
func enterAsync(t *testing.T, g *gate, ctx context.Context, f transport.Flow, admitted chan<- string, releases chan func()) {
	t.Helper()
	go func() {
		rel, err := g.enter(ctx, f)
		if err != nil {
			admitted <- "error: " + err.Error()
			return
		}
		admitted <- f.Client
		releases <- rel
	}()
}

// waitQueued polls until n requests wait at g.
func waitQueued(t *testing.T, g *gate, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for g.waiting() != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d waiting, want %d", g.waiting(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestGateFairOrder(t *testing.T) {
	g := newGate(scheduler.LimitConfig{Fixed: 1}, false)
	ctx := context.Background()
	first, err := g.enter(ctx, transport.Flow{Client: "heavy"})
	if err != nil {
		t.Fatal(err)
	}
	admitted, releases := make(chan string, 10), make(chan func(), 10)
	// The heavy client queues three, then the light one arrives.
	for i := range 3 {
		enterAsync(t, g, ctx, transport.Flow{Client: "heavy", Cost: 1000}, admitted, releases)
		waitQueued(t, g, i+1)
	}
	enterAsync(t, g, ctx, transport.Flow{Client: "light", Cost: 10}, admitted, releases)
	waitQueued(t, g, 4)
	first()
	var order []string
	for range 4 {
		order = append(order, <-admitted)
		(<-releases)()
	}
	if fmt.Sprint(order) != "[light heavy heavy heavy]" {
		t.Fatalf("admitted %v; want the light client first: the heavy one has a request in service", order)
	}
	if g.inFlight != 0 || g.waiting() != 0 {
		t.Fatalf("in flight %d, waiting %d after all released", g.inFlight, g.waiting())
	}
}

func TestGateCancelAndLimitChange(t *testing.T) {
	g := newGate(scheduler.LimitConfig{Initial: 1}, false)
	bg := context.Background()
	rel, _ := g.enter(bg, transport.Flow{Client: "a"})
	ctx, cancel := context.WithCancel(bg)
	admitted, releases := make(chan string, 10), make(chan func(), 10)
	enterAsync(t, g, ctx, transport.Flow{Client: "gone"}, admitted, releases)
	waitQueued(t, g, 1)
	cancel()
	if got := <-admitted; got != "error: "+context.Canceled.Error() {
		t.Fatalf("cancelled request: %s", got)
	}
	if g.waiting() != 0 {
		t.Fatal("a cancelled request still waits")
	}
	// Two wait; the limit grows to 2 (the engine runs the whole limit
	// and queues nothing): one goes in, the other when a place frees.
	enterAsync(t, g, bg, transport.Flow{Client: "b"}, admitted, releases)
	enterAsync(t, g, bg, transport.Flow{Client: "c"}, admitted, releases)
	waitQueued(t, g, 2)
	now := time.Now()
	limit, changed := g.observe(EngineMetrics{Engine: "vllm", Running: 1}, true, now)
	if !changed || limit != 2 {
		t.Fatalf("limit %d (changed %v), want 2", limit, changed)
	}
	<-admitted
	(<-releases)()
	rel()
	<-admitted
	(<-releases)()
	if g.inFlight != 0 {
		t.Fatalf("in flight %d", g.inFlight)
	}
}

func TestGateBounded(t *testing.T) {
	g := newGate(scheduler.LimitConfig{Fixed: 1}, false)
	rel, _ := g.enter(context.Background(), transport.Flow{Client: "a"})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make(chan error, scheduler.DefaultMaxQueuedPerFlow+10)
	for range scheduler.DefaultMaxQueuedPerFlow + 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := g.enter(ctx, transport.Flow{Client: "flood"})
			errs <- err
		}()
	}
	// The flood's excess is refused at once; the rest wait.
	for range 10 {
		if err := <-errs; !errors.Is(err, errGateFull) {
			t.Fatalf("flood beyond its bound: %v", err)
		}
	}
	waitQueued(t, g, scheduler.DefaultMaxQueuedPerFlow)
	// Another client still gets in line.
	admitted, releases := make(chan string, 1), make(chan func(), 1)
	enterAsync(t, g, context.Background(), transport.Flow{Client: "other"}, admitted, releases)
	waitQueued(t, g, scheduler.DefaultMaxQueuedPerFlow+1)
	cancel()
	wg.Wait()
	rel()
	if got := <-admitted; got != "other" {
		t.Fatalf("admitted %s", got)
	}
	(<-releases)()
	if g.inFlight != 0 || g.waiting() != 0 {
		t.Fatalf("in flight %d, waiting %d", g.inFlight, g.waiting())
	}
}

func TestGateDisabled(t *testing.T) {
	g := newGate(scheduler.LimitConfig{}, true)
	for range 100 {
		if _, err := g.enter(context.Background(), transport.Flow{}); err != nil {
			t.Fatal(err)
		}
	}
	if g.Limit() != 0 {
		t.Fatalf("disabled gate announces %d", g.Limit())
	}
	if _, changed := g.observe(EngineMetrics{Running: 1, Waiting: 9}, true, time.Now()); changed {
		t.Fatal("disabled gate changed its limit")
	}
}

// TestGateTakesEngineBatch: an engine that says how many requests it runs at
// once (llama.cpp's total_slots) fixes the dispatch limit there; the
// operator's --dispatch-limit wins over it.
func TestGateTakesEngineBatch(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"m","owned_by":"llamacpp"}]}`)
	})
	mux.HandleFunc("/props", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"total_slots":3,"default_generation_settings":{"n_ctx":4096}}`)
	})
	a := newIndexedAgent(t, mux, 0)
	if got := a.gate.Limit(); got == 3 {
		t.Fatalf("limit %d before the engine was read", got)
	}
	a.refresh(t.Context())
	if got := a.gate.Limit(); got != 3 {
		t.Fatalf("dispatch limit %d, want the engine's 3 slots", got)
	}
	if got, _ := a.gate.setBatch(0, 0, false); got != 8 {
		t.Fatalf("without a batch the limit is %d, want the initial 8 to measure from", got)
	}

	g := newGate(scheduler.LimitConfig{Fixed: 5}, false)
	if got, changed := g.setBatch(3, 0, true); got != 5 || changed {
		t.Fatalf("with the operator's limit 5 the engine's batch made it %d (changed %v)", got, changed)
	}
}

func TestParseEngineBatch(t *testing.T) {
	if ti, ok := ParseTGIInfo([]byte(`{"model_id":"x","router":"text-generation-router","max_batch_size":16}`)); !ok || ti.MaxBatchSize != 16 {
		t.Fatalf("TGI max_batch_size: %+v %v", ti, ok)
	}
	if ti, ok := ParseTGIInfo([]byte(`{"model_id":"x","router":"text-generation-router","max_batch_size":null}`)); !ok || ti.MaxBatchSize != 0 {
		t.Fatalf("TGI max_batch_size null: %+v %v", ti, ok)
	}
	if si, ok := ParseSGLangServerInfo([]byte(`{"model_path":"x","tp_size":1,"max_running_requests":48}`)); !ok || si.MaxRunningRequests != 48 {
		t.Fatalf("SGLang max_running_requests: %+v %v", si, ok)
	}
}
