package relaytest

// The parts a Cluster is made of, for tests that put a fleet together
// themselves: several relays, gossip tuning, an agent's own configuration,
// engines that answer what a test wants. Each part runs until the test ends
// or it is stopped; nothing is faked below the HTTP answer of an engine.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/libp2p/go-libp2p/core/peer"

	agentpkg "github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
)

// Relay is a relay serving its HTTP API on a loopback port.
type Relay struct {
	*relay.Relay
	URL string // the API's base URL, http://127.0.0.1:port

	cancel context.CancelFunc
	done   chan error
}

// ServeRelay builds a relay from cfg and serves its HTTP API on a loopback
// port until t ends or Stop is called.
func ServeRelay(t testing.TB, cfg relay.Config) *Relay {
	t.Helper()
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = r.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	sr := &Relay{Relay: r, URL: "http://" + ln.Addr().String(), cancel: cancel, done: make(chan error, 1)}
	go func() { sr.done <- r.Serve(ctx, ln) }()
	t.Cleanup(sr.Stop)
	return sr
}

// Stop stops serving and closes the relay, as SIGTERM does: requests in
// flight get the shutdown timeout. A second call does nothing.
func (r *Relay) Stop() {
	if r.cancel == nil {
		return
	}
	r.cancel()
	<-r.done
	r.cancel = nil
}

// Info is the relay's libp2p identity and addresses, for dialing it.
func (r *Relay) Info() peer.AddrInfo {
	return peer.AddrInfo{ID: r.Host().ID(), Addrs: r.Host().Addrs()}
}

// Agent is package agent's Agent, running.
type Agent struct {
	*agentpkg.Agent
	Name string

	cancel context.CancelFunc
	done   chan error
}

// RunAgent builds an agent from cfg and runs it until t ends or Stop is
// called.
func RunAgent(t testing.TB, cfg agentpkg.Config) *Agent {
	t.Helper()
	a, err := agentpkg.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ra := &Agent{Agent: a, Name: cfg.Name, cancel: cancel, done: make(chan error, 1)}
	go func() { ra.done <- a.Run(ctx) }()
	t.Cleanup(ra.Stop)
	return ra
}

// Stop drains the agent, leaves its relays and closes its host. A second
// call does nothing.
func (a *Agent) Stop() {
	if a.cancel == nil {
		return
	}
	a.cancel()
	<-a.done
	a.cancel = nil
}

// EngineConfig configures a FakeEngine.
type EngineConfig struct {
	// Name is in every answer: "hello from <Name>".
	Name string
	// Models are what /v1/models lists. Empty means "m1".
	Models []string
	// VLLMMetrics serves vLLM's load gauges at /metrics (see
	// FakeEngine.Running); without it /metrics is 404, as on an engine
	// the agent learns nothing from.
	VLLMMetrics bool
}

// FakeEngine is an OpenAI-compatible engine on a loopback port, for tests
// of what the fleet does with answers rather than how fast they come
// (simengine is the engine with a speed and a cache). It lists its models,
// answers every JSON request under /v1/ with a chat completion saying
// "hello from <name>" (an event stream when asked), and can hold streams
// (Hold), go down and come back on its address (Down, Up).
type FakeEngine struct {
	Name   string
	Models []string
	// Hits counts the JSON requests it answered. The agent's probe of
	// optional APIs sends a body that is not JSON and is not counted.
	Hits atomic.Int64
	// Running, Waiting and KVMilli (KV cache use in thousandths) are the
	// gauges /metrics reports with EngineConfig.VLLMMetrics.
	Running, Waiting, KVMilli atomic.Int64
	// MetricsBroken makes /metrics answer 500.
	MetricsBroken atomic.Bool

	vllm   bool
	gate   atomic.Pointer[StreamGate]
	answer atomic.Pointer[http.HandlerFunc]
	addr   string

	mu  sync.Mutex // guards srv
	srv *httptest.Server
}

// StreamGate holds every stream of an engine after its first event until
// Release; Done closes when the handler of the stream it held returns.
type StreamGate struct {
	release, done      chan struct{}
	released, finished sync.Once
}

// Release lets the held streams finish.
func (g *StreamGate) Release() { g.released.Do(func() { close(g.release) }) }

// Done is closed once the first stream the gate held has ended.
func (g *StreamGate) Done() <-chan struct{} { return g.done }

// NewFakeEngine starts an engine on a loopback port until t ends.
func NewFakeEngine(t testing.TB, cfg EngineConfig) *FakeEngine {
	e := &FakeEngine{Name: cfg.Name, Models: cfg.Models, vllm: cfg.VLLMMetrics}
	if len(e.Models) == 0 {
		e.Models = []string{"m1"}
	}
	e.srv = httptest.NewServer(http.HandlerFunc(e.serve))
	e.addr = e.srv.Listener.Addr().String()
	t.Cleanup(e.Down)
	return e
}

// URL is the engine's base URL, an agent's upstream.
func (e *FakeEngine) URL() string { return "http://" + e.addr }

// Hold makes the engine's streams wait after their first event until the
// gate returned is released; Unhold stops that for the streams after.
func (e *FakeEngine) Hold() *StreamGate {
	g := &StreamGate{release: make(chan struct{}), done: make(chan struct{})}
	e.gate.Store(g)
	return g
}

// SetAnswer makes h answer every request but /v1/models in the engine's
// place (nil: the engine's own answers again).
func (e *FakeEngine) SetAnswer(h http.HandlerFunc) {
	if h == nil {
		e.answer.Store(nil)
		return
	}
	e.answer.Store(&h)
}

// Unhold lets new streams run without waiting.
func (e *FakeEngine) Unhold() { e.gate.Store(nil) }

// Down stops the engine's server: connections to it are refused.
func (e *FakeEngine) Down() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.srv != nil {
		e.srv.Close()
		e.srv = nil
	}
}

// Up serves again on the address the engine had.
func (e *FakeEngine) Up(t testing.TB) {
	t.Helper()
	ln, err := net.Listen("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(e.serve))
	_ = srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	e.mu.Lock()
	e.srv = srv
	e.mu.Unlock()
}

func (e *FakeEngine) serve(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/v1/models":
		var data []string
		for _, m := range e.Models {
			data = append(data, fmt.Sprintf(`{"id":%q,"object":"model","owned_by":"test"}`, m))
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[%s]}`, strings.Join(data, ","))
		return
	case e.answer.Load() != nil:
		(*e.answer.Load())(w, r)
		return
	case r.URL.Path == "/metrics" && e.vllm:
		if e.MetricsBroken.Load() {
			http.Error(w, "exporter broken", http.StatusInternalServerError)
			return
		}
		m := e.Models[0]
		fmt.Fprintf(w, "vllm:num_requests_running{model_name=%q} %d\nvllm:num_requests_waiting{model_name=%q} %d\nvllm:kv_cache_usage_perc{model_name=%q} %g\n",
			m, e.Running.Load(), m, e.Waiting.Load(), m, float64(e.KVMilli.Load())/1000)
		return
	case !strings.HasPrefix(r.URL.Path, "/v1/"):
		http.NotFound(w, r)
		return
	}
	var req struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
	}
	if json.NewDecoder(r.Body).Decode(&req) == nil {
		// A body that is not JSON is no request: the agent's probe for
		// optional APIs sends one (and takes this 200 for no route).
		e.Hits.Add(1)
	}
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"x","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hello from %s"},"finish_reason":"stop"}]}`, req.Model, e.Name)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hello\"}}]}\n\n")
	w.(http.Flusher).Flush()
	if g := e.gate.Load(); g != nil {
		defer g.finished.Do(func() { close(g.done) })
		select {
		case <-g.release:
		case <-r.Context().Done():
			return
		}
	}
	fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" from %s\"}}]}\n\ndata: [DONE]\n\n", e.Name)
}

// RunSimEngine runs a simulated engine configured by cfg (Listen is always
// a free loopback port) until t ends or stop is called; stop waits for it
// and may be called more than once.
func RunSimEngine(t testing.TB, cfg simengine.Config) (srv *simengine.Server, stop func()) {
	t.Helper()
	cfg.Listen = "127.0.0.1:0"
	srv, err := simengine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return srv, stop
}
