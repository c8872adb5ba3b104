package agent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/poll"
	"github.com/computeflux/computeflux/transport"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeRelay is a libp2p host that accepts joins and records them.
type fakeRelay struct {
	h    host.Host
	join io.Closer

	mu     sync.Mutex
	events []string
	info   map[peer.ID]transport.JoinInfo
}

func (r *fakeRelay) Joined(p peer.ID, info transport.JoinInfo) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.info[p] = info
	r.events = append(r.events, "joined")
	return nil
}

func (r *fakeRelay) Updated(p peer.ID, info transport.JoinInfo) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.info[p] = info
	r.events = append(r.events, fmt.Sprintf("updated draining=%v models=%v", info.Draining, info.Models))
}

func (r *fakeRelay) Left(p peer.ID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.info, p)
	r.events = append(r.events, "left")
}

func (r *fakeRelay) current(p peer.ID) (transport.JoinInfo, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	i, ok := r.info[p]
	return i, ok
}

func (r *fakeRelay) count(ev string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.events {
		if e == ev {
			n++
		}
	}
	return n
}

const token = "join-token"

// startRelay starts a fake relay on listen (loopback QUIC) with the identity
// in idFile.
func startRelay(t *testing.T, listen, idFile string) *fakeRelay {
	t.Helper()
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{listen}, IdentityFile: idFile})
	if err != nil {
		t.Fatal(err)
	}
	r := &fakeRelay{h: h, info: map[peer.ID]transport.JoinInfo{}}
	r.join, err = transport.ServeJoin(h, []byte(token), r)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.close)
	return r
}

func (r *fakeRelay) close() {
	r.join.Close()
	r.h.Close()
}

func (r *fakeRelay) addr() string { return transport.FullAddrs(r.h)[0].String() }

func (r *fakeRelay) client() *http.Client {
	return &http.Client{Transport: transport.NewRoundTripper(r.h)}
}

// engine is an httptest OpenAI-compatible engine.
type engine struct {
	srv      *httptest.Server
	mu       sync.Mutex
	models   []string
	paths    []string
	auth     []string
	release  chan struct{} // the streaming handler waits on it between events
	canceled chan struct{} // closed when a streaming request's context ends early
	// metricsBroken makes /metrics answer 500, as a broken exporter does.
	metricsBroken atomic.Bool
}

func newEngine(t *testing.T) *engine {
	e := &engine{models: []string{"llama-3"}, release: make(chan struct{}), canceled: make(chan struct{})}
	var cancelOnce sync.Once
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		e.paths = append(e.paths, r.URL.Path)
		e.auth = append(e.auth, r.Header.Get("Authorization"))
		models := e.models
		e.mu.Unlock()
		switch r.URL.Path {
		case "/v1/models":
			var data []string
			for _, m := range models {
				data = append(data, fmt.Sprintf(`{"id":%q,"object":"model"}`, m))
			}
			fmt.Fprintf(w, `{"object":"list","data":[%s]}`, strings.Join(data, ","))
		case "/metrics":
			if e.metricsBroken.Load() {
				http.Error(w, "exporter broken", http.StatusInternalServerError)
				return
			}
			fmt.Fprint(w, "vllm:num_requests_running{model_name=\"x\"} 3\nvllm:num_requests_waiting{model_name=\"x\"} 2\nvllm:kv_cache_usage_perc{model_name=\"x\"} 0.25\n")
		case "/v1/chat/completions":
			body, _ := io.ReadAll(r.Body)
			if !strings.Contains(string(body), `"stream":true`) {
				fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}]}`)
				return
			}
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"n\":1}\n\n")
			w.(http.Flusher).Flush()
			select {
			case <-e.release:
			case <-r.Context().Done():
				cancelOnce.Do(func() { close(e.canceled) })
				return
			}
			fmt.Fprint(w, "data: {\"n\":2}\n\ndata: [DONE]\n\n")
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *engine) setModels(m ...string) {
	e.mu.Lock()
	e.models = m
	e.mu.Unlock()
}

func (e *engine) sawPath(p string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, x := range e.paths {
		if x == p {
			return true
		}
	}
	return false
}

// runAgent starts an agent and stops it (waiting for Run) at cleanup.
func runAgent(t *testing.T, cfg Config) (*Agent, context.CancelFunc) {
	t.Helper()
	if cfg.ListenAddrs == nil {
		cfg.ListenAddrs = []string{"/ip4/127.0.0.1/udp/0/quic-v1"}
	}
	if cfg.Token == "" && cfg.TokenFile == "" {
		cfg.Token = token
	}
	if cfg.RefreshInterval == 0 {
		cfg.RefreshInterval = 50 * time.Millisecond
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff, cfg.MaxBackoff = 20*time.Millisecond, 200*time.Millisecond
	}
	if cfg.Name == "" {
		cfg.Name = "gpu1"
	}
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	stop := func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	var once sync.Once
	t.Cleanup(func() { once.Do(stop) })
	return a, func() { once.Do(stop) }
}

// waitFor polls cond until it holds or a generous deadline passes.
var waitFor = poll.Eventually

func TestAgentJoinsAndStreams(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL, UpstreamAPIKey: "engine-key", MaxConcurrency: 4, Weight: 2})

	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })
	info, _ := relay.current(a.ID())
	if info.Name != "gpu1" || fmt.Sprint(info.Models) != "[llama-3]" || info.Capacity != 4 || info.Weight != 2 || info.Draining {
		t.Fatalf("relay learned %+v", info)
	}

	req, _ := http.NewRequest(http.MethodPost, "http://"+a.ID().String()+"/v1/chat/completions",
		strings.NewReader(`{"model":"llama-3","stream":true}`))
	req.Header.Set("Authorization", "Bearer client-key-must-not-pass")
	resp, err := relay.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	first, err := br.ReadString('\n')
	if err != nil || first != "data: {\"n\":1}\n" {
		t.Fatalf("first event %q %v", first, err)
	}
	// The engine is still holding the second event: streaming is live.
	close(eng.release)
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("rest %q", rest)
	}
	// Every request the engine saw, forwarded or the agent's own (models,
	// metrics, identification), carries the engine's key.
	eng.mu.Lock()
	for i, p := range eng.paths {
		if eng.auth[i] != "Bearer engine-key" {
			t.Errorf("engine saw Authorization %q on %s", eng.auth[i], p)
		}
	}
	if !slices.Contains(eng.paths, "/v1/models") || !slices.Contains(eng.paths, "/v1/chat/completions") {
		t.Errorf("engine saw %v", eng.paths)
	}
	eng.mu.Unlock()
	if m := a.Metrics(); m.Engine != "vllm" || m.Running != 3 || m.Waiting != 2 || m.KVCacheUsage != 0.25 {
		t.Errorf("metrics %+v", m)
	}
}

func TestAgentForwardsOnlyInferencePaths(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })
	base := "http://" + a.ID().String()
	for _, c := range []struct {
		method, path string
		want         int
	}{
		{"GET", "/metrics", 404},
		{"GET", "/admin", 404},
		{"GET", "/v1/models/../../etc/passwd", 404},
		{"POST", "/v1/chat/completions/x", 404},
		{"GET", "/v1/%2e%2e/secret", 404},
		{"GET", "/v1/chat/completions", 405},
		{"GET", "/v1/models", 200},
		{"POST", "/v1/chat/completions", 200},
	} {
		req, _ := http.NewRequest(c.method, base+c.path, strings.NewReader(`{}`))
		resp, err := relay.client().Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", c.method, c.path, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("%s %s: %d, want %d", c.method, c.path, resp.StatusCode, c.want)
		}
	}
	for _, p := range []string{"/admin", "/etc/passwd", "/secret", "/v1/chat/completions/x"} {
		if eng.sawPath(p) {
			t.Errorf("engine received %s", p)
		}
	}
}

func TestAgentRefusesPeersOtherThanItsRelay(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	stranger := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })
	// The stranger knows where the agent is.
	agentConn := relay.h.Network().ConnsToPeer(a.ID())[0]
	stranger.h.Peerstore().AddAddr(a.ID(), agentConn.RemoteMultiaddr(), time.Minute)
	resp, err := stranger.client().Post("http://"+a.ID().String()+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("stranger got status %d", resp.StatusCode)
	}
}

func TestAgentCancelReachesEngine(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+a.ID().String()+"/v1/chat/completions",
		strings.NewReader(`{"stream":true}`))
	resp, err := relay.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case <-eng.canceled:
	case <-time.After(15 * time.Second):
		t.Fatal("the engine's request was not cancelled")
	}
	waitFor(t, "in-flight to drop", func() bool { return a.InFlight() == 0 })
}

func TestAgentReconnectsAfterRelayRestart(t *testing.T) {
	eng := newEngine(t)
	idFile := filepath.Join(t.TempDir(), "relay.key")
	// Find a free UDP port, then give it to the relay.
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := pc.LocalAddr().(*net.UDPAddr).Port
	pc.Close()
	listen := fmt.Sprintf("/ip4/127.0.0.1/udp/%d/quic-v1", port)

	relay := startRelay(t, listen, idFile)
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL})
	waitFor(t, "first join", func() bool { _, ok := relay.current(a.ID()); return ok })
	relay.close()

	relay2 := startRelay(t, listen, idFile)
	if relay2.h.ID() != relay.h.ID() {
		t.Fatal("restarted relay has another identity")
	}
	waitFor(t, "join after the restart", func() bool { _, ok := relay2.current(a.ID()); return ok })
	resp, err := relay2.client().Get("http://" + a.ID().String() + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d after reconnect", resp.StatusCode)
	}
}

func TestAgentReportsEngineChanges(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })

	eng.setModels("llama-3", "qwen")
	waitFor(t, "models update", func() bool {
		i, _ := relay.current(a.ID())
		return fmt.Sprint(i.Models) == "[llama-3 qwen]" && !i.Draining
	})
	eng.srv.Close() // the engine stops answering
	waitFor(t, "unavailable", func() bool { i, _ := relay.current(a.ID()); return i.Draining })
}

func TestAgentDrainsOnStop(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, stop := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })
	resp, err := relay.client().Post("http://"+a.ID().String()+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	waitFor(t, "draining reported", func() bool { i, _ := relay.current(a.ID()); return i.Draining })
	if relay.count("left") != 0 {
		t.Fatal("agent left before its request finished")
	}
	close(eng.release)
	rest, err := io.ReadAll(br)
	if err != nil || !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("in-flight request cut: %q %v", rest, err)
	}
	<-stopped
	waitFor(t, "left", func() bool { return relay.count("left") == 1 })
}

func TestAgentEnforcesMaxConcurrency(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL, MaxConcurrency: 1})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })
	url := "http://" + a.ID().String() + "/v1/chat/completions"
	resp, err := relay.client().Post(url, "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	// The first request holds the only slot.
	second, err := relay.client().Post(url, "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, second.Body)
	second.Body.Close()
	if second.StatusCode != http.StatusTooManyRequests || second.Header.Get("Retry-After") == "" {
		t.Fatalf("second request: %d Retry-After=%q", second.StatusCode, second.Header.Get("Retry-After"))
	}
	close(eng.release)
	io.Copy(io.Discard, br)
}

func TestConfigValidation(t *testing.T) {
	good := Config{Relay: "/ip4/127.0.0.1/udp/1/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A", Token: "t", Upstream: "http://127.0.0.1:8000"}
	if _, err := New(good); err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tokenFile, []byte("  secret\n"), 0o600)
	cases := map[string]func(*Config){
		"no relay":           func(c *Config) { c.Relay = "" },
		"relay without /p2p": func(c *Config) { c.Relay = "/ip4/127.0.0.1/udp/1/quic-v1" },
		"no upstream":        func(c *Config) { c.Upstream = "" },
		"upstream not http":  func(c *Config) { c.Upstream = "ftp://x" },
		"no token":           func(c *Config) { c.Token = "" },
		"token and file":     func(c *Config) { c.TokenFile = tokenFile },
		"negative weight":    func(c *Config) { c.Weight = -1 },
		"negative capacity":  func(c *Config) { c.MaxConcurrency = -1 },
		"missing token file": func(c *Config) { c.Token, c.TokenFile = "", "/nonexistent/token" },
	}
	for name, mutate := range cases {
		c := good
		mutate(&c)
		if _, err := New(c); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	c := good
	c.Token, c.TokenFile = "", tokenFile
	a, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	if string(a.token) != "secret" {
		t.Fatalf("token from file %q", a.token)
	}
}

func TestJitterWithinBounds(t *testing.T) {
	for _, d := range []time.Duration{0, 1, 10 * time.Millisecond, 30 * time.Second} {
		for range 100 {
			j := jitter(d)
			if j < d/2 || j > d {
				t.Fatalf("jitter(%v) = %v", d, j)
			}
		}
	}
}

// TestAgentPassesEngineTrailers: an engine's trailers reach the relay
// through the stream server, as they would through a ReverseProxy.
func TestAgentPassesEngineTrailers(t *testing.T) {
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
			return
		}
		w.Header().Set("Trailer", "X-Engine-Check")
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"object":"list","data":[]}`)
		w.(http.Flusher).Flush()
		w.Header().Set("X-Engine-Check", "sum")
	}))
	defer eng.Close()
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.URL})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })
	req, _ := http.NewRequest(http.MethodPost, "http://"+a.ID().String()+"/v1/embeddings", strings.NewReader(`{"model":"m","input":"x"}`))
	req.Header.Set("Te", "trailers")
	resp, err := relay.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(b) != `{"object":"list","data":[]}` || resp.Trailer.Get("X-Engine-Check") != "sum" {
		t.Fatalf("%d %q, trailer %v", resp.StatusCode, b, resp.Trailer)
	}
}

// failedServer is a stream server that stopped serving on its own.
type failedServer struct{ done chan struct{} }

func (s failedServer) Done() <-chan struct{} { return s.done }
func (s failedServer) Err() error            { return errors.New("accept: listener gone") }

// A stream server that stops serving on its own is logged, with its
// error, and stops the agent's run with that cause; one closed by Run is
// not an error.
func TestStreamServerFailureIsLoggedAndStopsTheAgent(t *testing.T) {
	var logs syncLog
	a := &Agent{log: zerolog.New(&logs)}
	srv := failedServer{done: make(chan struct{})}
	close(srv.done)
	ctx, stop := context.WithCancelCause(context.Background())
	defer stop(nil)
	a.watchServer(ctx, srv, stop)
	if err := context.Cause(ctx); !errors.Is(err, errServerStopped) || !strings.Contains(err.Error(), "listener gone") {
		t.Fatalf("run's cause %v, want the stream server's failure", err)
	}
	if !strings.Contains(logs.String(), `"level":"error"`) || !strings.Contains(logs.String(), "listener gone") {
		t.Fatalf("log %q, want an error line with the cause", logs.String())
	}

	// Stopped by Close: Done closed, no error, nothing logged.
	var quiet syncLog
	b := &Agent{log: zerolog.New(&quiet)}
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	hs, err := transport.ServeHTTP(h, http.NotFoundHandler(), nil)
	if err != nil {
		t.Fatal(err)
	}
	hs.Close()
	ctx2, stop2 := context.WithCancelCause(context.Background())
	defer stop2(nil)
	b.watchServer(ctx2, hs, stop2)
	if ctx2.Err() != nil || quiet.String() != "" {
		t.Fatalf("after Close: cause %v, log %q", context.Cause(ctx2), quiet.String())
	}
}
