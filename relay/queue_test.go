package relay

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/transport"
)

// gatedEngine answers each request only when the test releases it, and
// records which client each request was for, in arrival order.
type gatedEngine struct {
	mu      sync.Mutex
	order   []string
	release chan struct{}
}

func newGatedEngine(e *engine) *gatedEngine {
	g := &gatedEngine{release: make(chan struct{}, 1000)}
	e.set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		g.mu.Lock()
		g.order = append(g.order, transport.ParseFlow(r.Header.Get(transport.HeaderFlow)).Client)
		g.mu.Unlock()
		select {
		case <-g.release:
		case <-r.Context().Done():
			return
		}
		defaultEngine(w, r, body, "gated")
	})
	return g
}

func (g *gatedEngine) arrived() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.order...)
}

// queueBed is a testbed whose one agent takes one request at a time, with
// clients named in a clients file.
func queueBed(t *testing.T, edit func(*Config), clients string) (*testbed, *gatedEngine) {
	t.Helper()
	cf, err := ParseClientsFile([]byte(clients), nil)
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, nil, func(c *Config) {
		c.Clients = cf
		if edit != nil {
			edit(c)
		}
	})
	e := newEngine(t, "a")
	p := peer.ID("peer-a")
	tb.ft.mu.Lock()
	tb.ft.to[p.String()] = mustURL(e.srv.URL)
	tb.ft.mu.Unlock()
	if err := tb.relay.Registry().Joined(p, transport.JoinInfo{Name: "a", Models: []string{"m1"}, Capacity: 1}); err != nil {
		t.Fatal(err)
	}
	return tb, newGatedEngine(e)
}

const queueClients = `
clients:
  - name: heavy
    keys: [sk-heavy]
  - name: light
    keys: [sk-light]
  - name: two
    keys: [sk-two]
    weight: 2
  - name: one
    keys: [sk-one]
  - name: night
    keys: [sk-night]
    class: batch
`

// send posts a chat request of key in the background; its status goes to
// the returned channel.
func (tb *testbed) send(ctx context.Context, key, extra string) <-chan int {
	return tb.sendPrompt(ctx, key, "hi", extra)
}

// sendPrompt is send with the user message prompt (JSON-safe as it is).
func (tb *testbed) sendPrompt(ctx context.Context, key, prompt, extra string) <-chan int {
	done := make(chan int, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", tb.srv.URL+"/v1/chat/completions",
			strings.NewReader(`{"model":"m1","messages":[{"role":"user","content":"`+prompt+`"}]`+extra+`}`))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := tb.srv.Client().Do(req)
		if err != nil {
			done <- 0
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	return done
}

func (tb *testbed) waitQueued(n int) {
	tb.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for tb.relay.queue.q.Len() != n {
		if time.Now().After(deadline) {
			tb.t.Fatalf("%d requests waiting, want %d", tb.relay.queue.q.Len(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestQueueFairOrder: while a heavy client keeps requests waiting for the
// one slot, a light client's request goes next, not after the backlog;
// nothing is refused.
func TestQueueFairOrder(t *testing.T) {
	tb, g := queueBed(t, nil, queueClients)
	ctx := context.Background()
	var done []<-chan int
	done = append(done, tb.send(ctx, "sk-heavy", ""))
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	for i := range 5 {
		done = append(done, tb.send(ctx, "sk-heavy", ""))
		tb.waitQueued(i + 1)
	}
	done = append(done, tb.send(ctx, "sk-light", ""))
	tb.waitQueued(6)
	st := tb.relay.QueueStatus()
	if !st.Enabled || st.Waiting != 6 || len(st.Flows) != 2 || st.Flows[0].Client != "heavy" || st.Flows[0].Queued != 5 ||
		st.Flows[1].Client != "light" || st.Flows[1].Model != "m1" || st.Flows[1].Class != "interactive" {
		t.Fatalf("queue status %+v", st)
	}
	for range 7 {
		g.release <- struct{}{}
	}
	for i, d := range done {
		if st := <-d; st != http.StatusOK {
			t.Fatalf("request %d: status %d", i, st)
		}
	}
	if got := fmt.Sprint(g.arrived()); got != "[heavy light heavy heavy heavy heavy heavy]" {
		t.Fatalf("the engine got %s; want the light request right after the one in flight", got)
	}
}

// TestQueueWeights: two clients of weights 2 and 1 that both keep requests
// waiting get the slot 2:1.
func TestQueueWeights(t *testing.T) {
	tb, g := queueBed(t, nil, queueClients)
	ctx := context.Background()
	first := tb.send(ctx, "sk-one", "")
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	var done []<-chan int
	for i := range 15 {
		done = append(done, tb.send(ctx, "sk-two", ""), tb.send(ctx, "sk-one", ""))
		tb.waitQueued(2 * (i + 1))
	}
	counts := map[string]int{}
	for i := range 15 {
		g.release <- struct{}{}
		waitFor(t, "the next dispatch", func() bool { return len(g.arrived()) == i+2 })
		counts[g.arrived()[i+1]]++
	}
	// 15 dispatches while both wait: 10 and 5, give or take the one
	// request of one's in service when they began (fair queuing is fair
	// to within a request).
	if counts["two"] < 10 || counts["two"] > 11 || counts["one"] != 15-counts["two"] {
		t.Fatalf("dispatches while both waited: %v, want two:10 one:5, or two:11 one:4", counts)
	}
	for range 16 {
		g.release <- struct{}{}
	}
	<-first
	for _, d := range done {
		<-d
	}
}

// TestQueueBatchClass: a batch client's requests wait behind interactive
// ones; service_tier flex makes an interactive client's request batch.
func TestQueueBatchClass(t *testing.T) {
	tb, g := queueBed(t, nil, queueClients)
	ctx := context.Background()
	first := tb.send(ctx, "sk-heavy", "")
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	done := []<-chan int{
		tb.send(ctx, "sk-night", ""),
	}
	tb.waitQueued(1)
	done = append(done, tb.send(ctx, "sk-light", `,"service_tier":"flex"`))
	tb.waitQueued(2)
	done = append(done, tb.send(ctx, "sk-one", `,"service_tier":"priority"`))
	tb.waitQueued(3)
	for range 4 {
		g.release <- struct{}{}
	}
	<-first
	for _, d := range done {
		if st := <-d; st != http.StatusOK {
			t.Fatalf("status %d", st)
		}
	}
	if got := fmt.Sprint(g.arrived()); got != "[heavy one night light]" {
		t.Fatalf("order %s; want the interactive request before both batch ones", got)
	}
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","service_tier":"urgent","messages":[]}`)
	if e := apiError(t, resp); resp.StatusCode != 400 || e.Code != "invalid_service_tier" {
		t.Fatalf("unknown service_tier: %d %+v", resp.StatusCode, e)
	}
}

// TestQueueClientLeaves: a waiting request whose client goes away leaves
// the queue at once and takes no slot.
func TestQueueClientLeaves(t *testing.T) {
	tb, g := queueBed(t, nil, queueClients)
	first := tb.send(context.Background(), "sk-heavy", "")
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	ctx, cancel := context.WithCancel(context.Background())
	gone := tb.send(ctx, "sk-light", "")
	tb.waitQueued(1)
	cancel()
	<-gone
	tb.waitQueued(0)
	next := tb.send(context.Background(), "sk-heavy", "")
	tb.waitQueued(1)
	g.release <- struct{}{}
	g.release <- struct{}{}
	if st := <-first; st != 200 {
		t.Fatalf("first: %d", st)
	}
	if st := <-next; st != 200 {
		t.Fatalf("next: %d", st)
	}
	if got := fmt.Sprint(g.arrived()); got != "[heavy heavy]" {
		t.Fatalf("the engine got %s; the departed request must not reach it", got)
	}
}

// TestQueueBounds: a request that waits its bound gets 429 with a
// Retry-After; one beyond its client's bound gets 429 at once, while
// another client still gets in line.
func TestQueueBounds(t *testing.T) {
	tb, g := queueBed(t, func(c *Config) {
		c.QueueWait = 300 * time.Millisecond
		c.MaxQueuedPerClient = 2
	}, queueClients)
	first := tb.send(context.Background(), "sk-heavy", "")
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	w1, w2 := tb.send(context.Background(), "sk-heavy", ""), tb.send(context.Background(), "sk-heavy", "")
	tb.waitQueued(2)
	req, _ := http.NewRequest("POST", tb.srv.URL+"/v1/chat/completions", strings.NewReader(`{"model":"m1","messages":[]}`))
	req.Header.Set("Authorization", "Bearer sk-heavy")
	resp, err := tb.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if e := apiError(t, resp); resp.StatusCode != 429 || e.Code != "queue_full" || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("third waiting request of one client: %d %+v Retry-After %q", resp.StatusCode, e, resp.Header.Get("Retry-After"))
	}
	light := tb.send(context.Background(), "sk-light", "")
	for _, d := range []<-chan int{w1, w2, light} {
		if st := <-d; st != 429 {
			t.Fatalf("a request that waited its bound: %d, want 429", st)
		}
	}
	g.release <- struct{}{}
	<-first
	// The client's own timeout shortens the wait: half of 0.2 s.
	hold := tb.send(context.Background(), "sk-heavy", "")
	waitFor(t, "the request at the engine", func() bool { return len(g.arrived()) == 2 })
	resp = tb.do("POST", "/v1/chat/completions", `{"model":"m1","messages":[]}`, "X-Stainless-Timeout", "0.2")
	if e := apiError(t, resp); resp.StatusCode != 429 || e.Code != "queue_timeout" || !strings.Contains(e.Message, " 100ms;") {
		t.Fatalf("with the client's timeout of 0.2 s: %d %+v", resp.StatusCode, e)
	}
	g.release <- struct{}{}
	<-hold
}

// TestQueueOff: with the queue off, a full fleet answers 503 at once, as
// before the queue: what the tests above need the queue for.
func TestQueueOff(t *testing.T) {
	tb, g := queueBed(t, func(c *Config) { c.QueueWait = -1 }, queueClients)
	first := tb.send(context.Background(), "sk-heavy", "")
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","messages":[]}`)
	if resp.StatusCode != 503 {
		t.Fatalf("full fleet without a queue: %d, want 503", resp.StatusCode)
	}
	resp.Body.Close()
	g.release <- struct{}{}
	<-first
}

// TestQueueRestartHold: a relay with no agent yet holds a request until
// one joins, instead of answering 503.
func TestQueueRestartHold(t *testing.T) {
	tb := newTestbed(t, nil, func(c *Config) { c.RestartHold = 10 * time.Second })
	done := tb.send(context.Background(), testKey, "")
	tb.waitQueued(1)
	tb.addAgent("late", []string{"m1"})
	if st := <-done; st != 200 {
		t.Fatalf("held request: %d, want 200 once an agent joined", st)
	}
	// The hold is bounded: with no agent, a request gets 503 after it.
	tb2 := newTestbed(t, nil, func(c *Config) { c.RestartHold = 200 * time.Millisecond })
	resp := tb2.do("POST", "/v1/chat/completions", `{"model":"m1","messages":[]}`)
	if e := apiError(t, resp); resp.StatusCode != 503 || e.Code != "no_healthy_agent" {
		t.Fatalf("no agent within the hold: %d %+v", resp.StatusCode, e)
	}
}

func mustURL(s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		panic(err)
	}
	return u
}
