package relaytest

// The parts a Cluster is made of, for tests that put a fleet together
// themselves: several relays, gossip tuning, an agent's own configuration,
// engines that answer what a test wants. Each part runs until the test ends
// or it is stopped; nothing is faked below the HTTP answer of an engine.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

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

// Addr is the relay's first libp2p address with its peer ID, what an
// agent's Relay or Relays setting names.
func (r *Relay) Addr() string {
	addrs := r.Addrs()
	if len(addrs) == 0 {
		return ""
	}
	return addrs[0].String()
}

// AgentConfig is the configuration tests give an agent named name in front
// of upstream, joining the relays (multiaddrs, see Relay.Addr) with token:
// a loopback QUIC port, reconnects after 20 ms backing off to 500 ms, a 2 s
// drain, logs discarded. Tests change what they are about before RunAgent.
func AgentConfig(name, token, upstream string, relays ...string) agentpkg.Config {
	return agentpkg.Config{
		Relays:       relays,
		Token:        token,
		Upstream:     upstream,
		Name:         name,
		ListenAddrs:  []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Logger:       zerolog.New(io.Discard),
		MinBackoff:   20 * time.Millisecond,
		MaxBackoff:   500 * time.Millisecond,
		DrainTimeout: 2 * time.Second,
	}
}

// Agent is package agent's Agent, running.
type Agent struct {
	*agentpkg.Agent
	Name string
	// Config is what it runs on: RunAgent(t, a.Config) after Stop is the
	// same agent restarted (same identity, if it has an IdentityFile).
	Config agentpkg.Config

	pf     *packetFilter
	cancel context.CancelFunc
	done   chan struct{}
}

// RunAgent builds an agent from cfg and runs it until t ends or Stop is
// called, on the product's own sockets.
func RunAgent(t testing.TB, cfg agentpkg.Config) *Agent {
	t.Helper()
	return runAgent(t, cfg, false)
}

// RunKillableAgent is RunAgent with every packet of the agent's host
// through a filter, so that Kill can silence it. The filter's sockets read
// and write packet by packet: benchmarks of the path use RunAgent.
func RunKillableAgent(t testing.TB, cfg agentpkg.Config) *Agent {
	t.Helper()
	return runAgent(t, cfg, true)
}

func runAgent(t testing.TB, cfg agentpkg.Config, killable bool) *Agent {
	t.Helper()
	a, err := launch(cfg, killable, func(error) {})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	return a
}

// launch builds an agent from cfg and runs it until Stop or Kill, then
// hands Run's error to stopped. With killable its host's packets pass a
// filter that Kill closes.
func launch(cfg agentpkg.Config, killable bool, stopped func(error)) (*Agent, error) {
	var pf *packetFilter
	run := cfg
	if killable {
		pf = &packetFilter{}
		run.HostOptions = append(slices.Clip(cfg.HostOptions), libp2p.QUICReuse(pf.connManager))
	}
	a, err := agentpkg.New(run)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	ra := &Agent{Agent: a, Name: cfg.Name, Config: cfg, pf: pf, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(ra.done)
		if pf != nil {
			defer pf.close() // libp2p does not close a socket manager it was given
		}
		stopped(a.Run(ctx))
	}()
	return ra, nil
}

// Stop drains the agent, leaves its relays and closes its host, and returns
// once it has. After Kill it waits for the silenced agent to end.
func (a *Agent) Stop() {
	a.cancel()
	<-a.done
}

// Kill silences the agent without a goodbye, as when its machine loses
// power or its network: every packet of its host is dropped from now on,
// both ways, then it is stopped behind that black hole (its leave and its
// connection close never reach anyone). Kill does not wait for it to end;
// Stop does. Only an agent of RunKillableAgent can be killed.
func (a *Agent) Kill() {
	if a.pf == nil {
		panic("relaytest: Kill of an agent not started by RunKillableAgent")
	}
	a.pf.dropped.Store(true)
	a.cancel()
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

// Front serves, on a loopback port until t ends, a front of the engine at
// upstream, as a proxy or a faulty build would stand before it: serve gets
// every request and answers what it wants, handing the rest to next (a
// reverse proxy to upstream that flushes streams at once). It returns the
// front's base URL, an agent's upstream.
func Front(t testing.TB, upstream string, serve func(w http.ResponseWriter, r *http.Request, next http.Handler)) string {
	t.Helper()
	u, err := url.Parse(upstream)
	if err != nil {
		t.Fatal(err)
	}
	next := httputil.NewSingleHostReverseProxy(u)
	next.FlushInterval = -1
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { serve(w, r, next) }))
	t.Cleanup(srv.Close)
	return srv.URL
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
