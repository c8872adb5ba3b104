package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/transport"
)

// fixtureEngine serves an engine's recorded answers from
// testdata/engines/<name> (see its README).
func fixtureEngine(t *testing.T, name string) *httptest.Server {
	t.Helper()
	dir := filepath.Join("testdata", "engines", name)
	var post []string
	if b, err := os.ReadFile(filepath.Join(dir, "post_routes")); err == nil {
		post = strings.Fields(string(b))
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			io.Copy(io.Discard, r.Body)
			if slices.Contains(post, r.URL.Path) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusBadRequest)
				io.WriteString(w, `{"error":{"code":400,"message":"missing field","type":"invalid_request_error"}}`)
				return
			}
			http.NotFound(w, r)
			return
		}
		base := strings.ReplaceAll(strings.TrimPrefix(r.URL.Path, "/"), "/", "_")
		for _, f := range []string{base, base + ".json", base + ".txt"} {
			if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
				if !strings.HasSuffix(f, ".json") {
					w.Header().Set("Content-Type", "text/plain; version=0.0.4")
				} else {
					w.Header().Set("Content-Type", "application/json")
				}
				w.Write(b)
				return
			}
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func fixtureAgent(t *testing.T, upstream string, log io.Writer) *Agent {
	t.Helper()
	a, err := New(Config{Relay: "/ip4/127.0.0.1/udp/1/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A",
		Token: "t", Upstream: upstream, Name: "fixture", Logger: zerolog.New(log)})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestEngineRecognition identifies each engine from its fixture and reads
// its load and KV capacity under the engine's own names.
func TestEngineRecognition(t *testing.T) {
	cases := []struct {
		name     string
		kind     EngineKind
		version  string
		capacity int // KV capacity in tokens
		running  int
		waiting  int
		kv       float64
		apis     []string
		models   []string
	}{
		// 27,926 GPU blocks of 16 tokens (vllm:cache_config_info).
		{"vllm", EngineVLLM, "0.11.0", 27926 * 16, 3, 2, 0.4215, []string{"/v1/responses", "/v1/messages"}, []string{"meta-llama/Llama-3.1-8B-Instruct"}},
		{"sglang", EngineSGLang, "0.5.4", 471258, 4, 7, 0.63, []string{"/v1/responses"}, []string{"Qwen/Qwen2.5-7B-Instruct"}},
		{"tgi", EngineTGI, "3.3.6", 131072, 12, 5, 0, nil, []string{"mistralai/Mistral-7B-Instruct-v0.3"}},
		// Four slots of 8,192 tokens (/slots).
		{"llamacpp", EngineLlamaCpp, "b6940-2e76e0137", 4 * 8192, 2, 1, 0, []string{"/v1/responses", "/v1/messages"}, []string{"Qwen3-8B-Q4_K_M.gguf"}},
		// The loaded models' context_length (/api/ps); no queue figures.
		{"ollama", EngineOllama, "0.12.6", 8192 + 2048, 0, 0, 0, []string{"/v1/responses", "/v1/messages"}, []string{"llama3.2:latest", "nomic-embed-text:latest"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			srv := fixtureEngine(t, c.name)
			var log bytes.Buffer
			a := fixtureAgent(t, srv.URL, &log)
			a.refresh(context.Background())
			e := a.Engine()
			if e.Kind != c.kind || e.Version != c.version || !slices.Equal(e.APIs, c.apis) {
				t.Fatalf("engine %+v, want kind %s version %s APIs %v", e, c.kind, c.version, c.apis)
			}
			if got := a.KVCapacityTokens(); got != c.capacity {
				t.Fatalf("KV capacity %d tokens, want %d", got, c.capacity)
			}
			m := a.Metrics()
			if m.Running != c.running || m.Waiting != c.waiting || m.KVCacheUsage != c.kv {
				t.Fatalf("load %+v, want running %d waiting %d kv %v", m, c.running, c.waiting, c.kv)
			}
			info := a.Info()
			if !slices.Equal(info.Models, c.models) || !slices.Equal(info.APIs, c.apis) || info.Draining {
				t.Fatalf("join info %+v", info)
			}
			if !strings.Contains(log.String(), `"engine":"`+string(c.kind)+`"`) || !strings.Contains(log.String(), "engine recognised") {
				t.Fatalf("log does not say what was found: %s", log.String())
			}
			// The agent forwards exactly the optional APIs listed.
			for _, p := range optionalAPIs {
				if _, _, ok := a.optionalRoute(p, http.MethodPost); ok != slices.Contains(c.apis, p) {
					t.Errorf("route %s forwarded: %v", p, ok)
				}
			}
		})
	}
}

// TestUnknownEngine: an engine that is none of the known kinds still
// serves its models, with one clear log line and no load figures.
func TestUnknownEngine(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"someone"}]}`)
			return
		}
		http.NotFound(w, r)
	}))
	defer srv.Close()
	var log bytes.Buffer
	a := fixtureAgent(t, srv.URL, &log)
	a.refresh(context.Background())
	if e := a.Engine(); e.Kind != EngineUnknown || len(e.APIs) != 0 || a.KVCapacityTokens() != 0 {
		t.Fatalf("engine %+v", e)
	}
	if info := a.Info(); !slices.Equal(info.Models, []string{"m"}) || info.Draining {
		t.Fatalf("info %+v", info)
	}
	if n := strings.Count(log.String(), "engine not recognised"); n != 1 {
		t.Fatalf("want one log line, got %d: %s", n, log.String())
	}
	a.refresh(context.Background())
	if n := strings.Count(log.String(), "engine not recognised"); n != 1 {
		t.Fatalf("the log line repeats on every refresh: %s", log.String())
	}
	if _, _, ok := a.optionalRoute("/v1/responses", http.MethodPost); ok {
		t.Fatal("an unknown engine's /v1/responses is forwarded unasked")
	}
}

func TestCacheConfigTokens(t *testing.T) {
	for line, want := range map[string]int{
		`vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0`:             1600,
		`vllm:cache_config_info{num_gpu_blocks="None",block_size="16"} 1.0`:            0,
		`vllm:cache_config_info{a="x\"y",block_size="32",num_gpu_blocks="10"} 1`:       320,
		`vllm:cache_config_info{block_size="16",num_gpu_blocks="99999999999999999"} 1`: 0,
		`vllm:cache_config_info{block_size=16} 1`:                                      0,
	} {
		if got := cacheConfigTokens(line); got != want {
			t.Errorf("%s: %d, want %d", line, got, want)
		}
	}
}

// TestFindEngine finds and identifies an engine on its 127.0.0.1 port, skips
// a port whose /v1/models is no model list, and says what to pass when no
// port answered.
func TestFindEngine(t *testing.T) {
	port := func(srv *httptest.Server) int {
		t.Helper()
		u, err := url.Parse(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		p, err := strconv.Atoi(u.Port())
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	vllm := fixtureEngine(t, "vllm")
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"object":"list"}`) // 200, but no data
	}))
	t.Cleanup(other.Close)
	found, err := FindEngine(context.Background(), []EnginePort{{port(other), "x"}, {port(vllm), "vLLM"}}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != 1 || found[0].URL != vllm.URL || found[0].Engine.Kind != EngineVLLM ||
		!slices.Equal(found[0].Models, []string{"meta-llama/Llama-3.1-8B-Instruct"}) {
		t.Fatalf("found %+v, want the vLLM fixture only", found)
	}

	_, err = FindEngine(context.Background(), []EnginePort{{port(other), "x"}}, 0)
	if !errors.Is(err, ErrNoEngine) || !strings.Contains(err.Error(), "--upstream") {
		t.Fatalf("error %v, want ErrNoEngine saying what to pass", err)
	}
}

// loadingEngine serves the fixture of engine name behind a switch: while
// loading, every path but /v1/models answers 503, as llama.cpp's server
// does while it loads its model ({"error":{"message":"Loading model",
// "type":"unavailable_error"}}). It counts the GETs of each path.
type loadingEngine struct {
	*httptest.Server
	loading atomic.Bool
	// metricsDown: /metrics alone answers 503 (a proxy in front of a
	// metrics endpoint not up).
	metricsDown atomic.Bool
	// silent: every path but /v1/models has its connection closed with no
	// answer, as by an engine that dies or resets mid-request.
	silent atomic.Bool
	mu     sync.Mutex // guards gets
	gets   map[string]int
}

func newLoadingEngine(t *testing.T, name string) *loadingEngine {
	t.Helper()
	fix := fixtureEngine(t, name)
	target, err := url.Parse(fix.URL)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	e := &loadingEngine{gets: map[string]int{}}
	e.loading.Store(true)
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			e.mu.Lock()
			e.gets[r.URL.Path]++
			e.mu.Unlock()
		}
		if e.silent.Load() && r.URL.Path != "/v1/models" {
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				c.Close()
			}
			return
		}
		if e.loading.Load() && r.URL.Path != "/v1/models" || e.metricsDown.Load() && r.URL.Path == "/metrics" {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, `{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}`)
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(e.Close)
	return e
}

func (e *loadingEngine) count(path string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.gets[path]
}

// TestEngineIdentifiedAfterLoading: a llama.cpp still loading its model
// when the agent starts answers /v1/models but 503 on /props, /slots and
// /metrics. The agent serves the model meanwhile, and identifies the engine
// again once it has loaded: kind, version, KV capacity (the index sized
// from it) and optional APIs. Once identified, it asks /props no more.
func TestEngineIdentifiedAfterLoading(t *testing.T) {
	eng := newLoadingEngine(t, "llamacpp")
	var log bytes.Buffer
	a := fixtureAgent(t, eng.URL, &log)
	ctx := context.Background()
	a.refresh(ctx)
	if e := a.Engine(); e.Kind != EngineUnknown || a.KVCapacityTokens() != 0 {
		t.Fatalf("while loading: engine %+v, capacity %d; want nothing known yet", e, a.KVCapacityTokens())
	}
	if info := a.Info(); !slices.Equal(info.Models, []string{"Qwen3-8B-Q4_K_M.gguf"}) || info.Draining {
		t.Fatalf("while loading: join info %+v, want the model served", info)
	}
	if eng.count("/props") == 0 {
		t.Fatal("identification never asked /props")
	}

	eng.loading.Store(false)
	const maxRefreshes = 10 // a minute and a half of refreshes at the default interval
	n := 0
	for ; n < maxRefreshes && a.Engine().Kind != EngineLlamaCpp; n++ {
		a.refresh(ctx)
	}
	e := a.Engine()
	if e.Kind != EngineLlamaCpp || e.Version != "b6940-2e76e0137" || !slices.Equal(e.APIs, []string{"/v1/responses", "/v1/messages"}) {
		t.Fatalf("after %d refreshes of a loaded engine: %+v; want llama.cpp b6940-2e76e0137 with both APIs", n, e)
	}
	if got := a.KVCapacityTokens(); got != 4*8192 {
		t.Fatalf("KV capacity %d tokens, want %d", got, 4*8192)
	}
	if got := a.index.stats().CapacityTokens; got != 4*8192 {
		t.Fatalf("index sized %d tokens, want %d", got, 4*8192)
	}
	if !strings.Contains(log.String(), `"engine":"llamacpp"`) {
		t.Fatalf("the log does not say llama.cpp was recognised: %s", log.String())
	}
	t.Logf("identified %d refreshes after the engine loaded", n)

	props := eng.count("/props")
	for range 8 {
		a.refresh(ctx)
	}
	if got := eng.count("/props"); got != props {
		t.Fatalf("/props read %d more times after identification", got-props)
	}
}

// TestEngineIdentifiedAfterNoAnswer: identity probes that get no answer at
// all (the connection closed unanswered) leave the engine to be identified
// again, as a 503 does, rather than named unrecognised for good.
func TestEngineIdentifiedAfterNoAnswer(t *testing.T) {
	eng := newLoadingEngine(t, "llamacpp")
	eng.silent.Store(true)
	var log bytes.Buffer
	a := fixtureAgent(t, eng.URL, &log)
	ctx := context.Background()
	a.refresh(ctx)
	if e := a.Engine(); e.Kind != EngineUnknown {
		t.Fatalf("with no answers: engine %+v, want nothing known yet", e)
	}
	if strings.Contains(log.String(), "not recognised") {
		t.Fatalf("an engine that did not answer is named unrecognised: %s", log.String())
	}
	eng.silent.Store(false)
	eng.loading.Store(false)
	n := 0
	for ; n < 10 && a.Engine().Kind != EngineLlamaCpp; n++ {
		a.refresh(ctx)
	}
	if e := a.Engine(); e.Kind != EngineLlamaCpp || a.KVCapacityTokens() != 4*8192 {
		t.Fatalf("after %d refreshes of an answering engine: %+v, capacity %d; want llama.cpp with %d tokens",
			n, e, a.KVCapacityTokens(), 4*8192)
	}
}

// TestUnknownEngineIdentifiedOnce: an engine that refuses every identity
// endpoint (404) is identified once; the agent does not keep asking.
func TestUnknownEngineIdentifiedOnce(t *testing.T) {
	var props atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/models":
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"someone"}]}`)
		case "/props":
			props.Add(1)
			http.NotFound(w, r)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	a := fixtureAgent(t, srv.URL, io.Discard)
	for range 8 {
		a.refresh(context.Background())
	}
	if a.Engine().Kind != EngineUnknown {
		t.Fatalf("engine %+v", a.Engine())
	}
	if n := props.Load(); n != 1 {
		t.Fatalf("/props asked %d times over 8 refreshes, want once", n)
	}
}

// TestEngineStillLoadingBacksOff: an engine that keeps answering 503 is
// identified again after 1, 2, 4, then every 6 refreshes, never on each.
func TestEngineStillLoadingBacksOff(t *testing.T) {
	eng := newLoadingEngine(t, "llamacpp")
	var log bytes.Buffer
	a := fixtureAgent(t, eng.URL, &log)
	for range 20 {
		a.refresh(context.Background())
	}
	// Identifications at refreshes 1, 2, 4, 8, 14 and 20.
	if got := eng.count("/props"); got != 6 {
		t.Fatalf("/props asked %d times over 20 refreshes, want 6", got)
	}
	if n := strings.Count(log.String(), "engine not identified yet"); n != 1 || strings.Contains(log.String(), "not recognised") {
		t.Fatalf("want one log line saying the engine is not identified yet, got %d: %s", n, log.String())
	}
	if info := a.Info(); info.Draining || len(info.Models) != 1 {
		t.Fatalf("join info %+v: the model is not served while the engine loads", info)
	}
}

// TestEngineKindKeptThroughRetry: an engine identified with a probe left
// unanswered is asked again later; a later identification that learns less
// (the engine reloading its model, 503 on everything but /v1/models) does
// not unlearn what an earlier one found.
func TestEngineKindKeptThroughRetry(t *testing.T) {
	eng := newLoadingEngine(t, "llamacpp")
	eng.loading.Store(false)
	eng.metricsDown.Store(true)
	a := fixtureAgent(t, eng.URL, io.Discard)
	ctx := context.Background()
	a.refresh(ctx)
	if e := a.Engine(); e.Kind != EngineLlamaCpp {
		t.Fatalf("engine %+v, want llama.cpp from /props", e)
	}
	props := eng.count("/props")
	eng.loading.Store(true)
	for i := range 8 {
		a.refresh(ctx)
		if e := a.Engine(); e.Kind != EngineLlamaCpp || a.KVCapacityTokens() != 4*8192 {
			t.Fatalf("refresh %d while reloading: engine %+v, capacity %d", i+1, e, a.KVCapacityTokens())
		}
	}
	if eng.count("/props") == props {
		t.Fatal("the engine was not asked again")
	}
}

// genericEngine is an OpenAI-compatible server the agent recognises as
// nothing (no metrics, no identity endpoint). It serves /v1/models and the
// POST routes in routes; how it answers a body that is not JSON, and a
// path it does not serve, is set per case. generated counts the requests it
// took as real ones (the tokens it would have generated).
type genericEngine struct {
	srv       *httptest.Server
	generated atomic.Int64
	posts     atomic.Int64
}

type genericConfig struct {
	routes []string
	// lenient takes `{}` as a request (defaults for model and input).
	lenient bool
	// unknownOK answers 200 with an error for a path it does not serve, as
	// LM Studio does; otherwise 404.
	unknownOK bool
	// parseFirst reads every POST body before routing, as a server with a
	// global JSON body parser does: a body that is not JSON is a 400
	// whatever the path.
	parseFirst bool
	// openapi lists the routes in /openapi.json.
	openapi bool
}

func newGenericEngine(t *testing.T, c genericConfig) *genericEngine {
	t.Helper()
	g := &genericEngine{}
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/v1/models":
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"organization_owner"}]}`)
			return
		case r.Method == http.MethodGet && r.URL.Path == "/openapi.json" && c.openapi:
			paths := make([]string, 0, len(c.routes))
			for _, p := range c.routes {
				paths = append(paths, strconv.Quote(p)+`:{"post":{}}`)
			}
			io.WriteString(w, `{"openapi":"3.1.0","paths":{`+strings.Join(paths, ",")+`}}`)
			return
		case r.Method != http.MethodPost:
			http.NotFound(w, r)
			return
		}
		g.posts.Add(1)
		b, _ := io.ReadAll(r.Body)
		var req map[string]any
		bad := json.Unmarshal(b, &req) != nil
		if bad && c.parseFirst {
			http.Error(w, `{"error":"invalid JSON"}`, http.StatusBadRequest)
			return
		}
		if !slices.Contains(c.routes, r.URL.Path) {
			if c.unknownOK {
				io.WriteString(w, `{"error":"Unexpected endpoint or method. (POST `+r.URL.Path+`)"}`)
				return
			}
			http.NotFound(w, r)
			return
		}
		switch {
		case bad:
			w.WriteHeader(http.StatusUnprocessableEntity)
			io.WriteString(w, `{"error":{"message":"body is not JSON","type":"invalid_request_error"}}`)
		case req["model"] == nil && !c.lenient:
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":{"message":"model is required","type":"invalid_request_error"}}`)
		default:
			g.generated.Add(1)
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"id":"resp_1","object":"response","status":"completed","output":[]}`)
		}
	}))
	t.Cleanup(g.srv.Close)
	return g
}

// TestUnknownEngineOptionalAPIs: an engine recognised as nothing still
// gets the optional APIs it serves, found from its OpenAPI document or by
// sending each path a body that is not JSON, which no engine can take for
// a request: nothing is ever generated by the discovery, even on an engine
// that would take `{}` as a request; 200s with an error for unknown routes
// count for nothing, and an engine that rejects every body before routing
// gets no API from its answers: both are unknown, forwarded for the first
// real answer to settle.
func TestUnknownEngineOptionalAPIs(t *testing.T) {
	cases := []struct {
		name    string
		cfg     genericConfig
		want    []string
		posts   int64    // POSTs the discovery may send (-1: any)
		unknown []string // APIs left to the first real answer
	}{
		{"responses served", genericConfig{routes: []string{"/v1/chat/completions", "/v1/responses"}}, []string{"/v1/responses"}, -1, nil},
		{"both served", genericConfig{routes: []string{"/v1/responses", "/v1/messages"}}, []string{"/v1/responses", "/v1/messages"}, -1, nil},
		{"lenient with {}", genericConfig{routes: []string{"/v1/responses"}, lenient: true}, []string{"/v1/responses"}, -1, nil},
		{"200 for unknown routes", genericConfig{routes: []string{"/v1/responses"}, unknownOK: true}, []string{"/v1/responses"}, -1, nil},
		{"none served", genericConfig{routes: []string{"/v1/chat/completions"}}, nil, -1, nil},
		{"none served, 200 for unknown routes", genericConfig{routes: []string{"/v1/chat/completions"}, unknownOK: true}, nil, -1, nil},
		{"body parsed before routing", genericConfig{routes: []string{"/v1/chat/completions"}, parseFirst: true}, nil, -1, optionalAPIs},
		{"OpenAPI document", genericConfig{routes: []string{"/v1/responses", "/v1/messages"}, openapi: true, lenient: true}, []string{"/v1/responses", "/v1/messages"}, 0, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := newGenericEngine(t, c.cfg)
			var log bytes.Buffer
			a := fixtureAgent(t, g.srv.URL, &log)
			a.refresh(context.Background())
			e := a.Engine()
			if e.Kind != EngineUnknown || !slices.Equal(e.APIs, c.want) || !slices.Equal(e.UnknownAPIs, c.unknown) {
				t.Fatalf("engine %+v, want not recognised with APIs %v, unknown %v", e, c.want, c.unknown)
			}
			if info := a.Info(); !slices.Equal(info.APIs, c.want) {
				t.Fatalf("join info APIs %v, want %v", info.APIs, c.want)
			}
			if n := g.generated.Load(); n != 0 {
				t.Fatalf("the discovery made the engine generate %d times", n)
			}
			if c.posts >= 0 && g.posts.Load() != c.posts {
				t.Fatalf("%d POSTs, want %d", g.posts.Load(), c.posts)
			}
			for _, p := range optionalAPIs {
				if _, _, ok := a.optionalRoute(p, http.MethodPost); ok != (slices.Contains(c.want, p) || slices.Contains(c.unknown, p)) {
					t.Errorf("route %s forwarded: %v", p, ok)
				}
			}
			// Asked once: later refreshes send no more probes.
			posts := g.posts.Load()
			a.refresh(context.Background())
			if g.posts.Load() != posts {
				t.Errorf("a second refresh probed again (%d POSTs, then %d)", posts, g.posts.Load())
			}
		})
	}
}

// vllmLike is an engine with vLLM's metrics that publishes no OpenAPI
// document (vLLM started with --disable-fastapi-docs, or a fork): it
// serves chat and, with responses, /v1/responses. An empty request to a
// route it serves gets unknownModel's 404 (vLLM's: "The model “ does not
// exist."); any other path its not-found page, notFound. generated counts
// real answers.
type vllmLike struct {
	srv       *httptest.Server
	generated atomic.Int64
	asked     sync.Map // path -> *atomic.Int64: POSTs received
}

func newVLLMLike(t *testing.T, responses bool, notFound func() string, unknownModel func(string) string) *vllmLike {
	t.Helper()
	metrics, err := os.ReadFile(filepath.Join("testdata", "engines", "vllm", "metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	v := &vllmLike{}
	v.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/metrics":
			w.Write(metrics)
			return
		case r.Method == http.MethodGet && r.URL.Path == "/v1/models":
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`)
			return
		case r.Method == http.MethodGet && r.URL.Path == "/version":
			io.WriteString(w, `{"version":"0.11.0"}`)
			return
		}
		n, _ := v.asked.LoadOrStore(r.URL.Path, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		route := r.Method == http.MethodPost && (r.URL.Path == "/v1/chat/completions" || responses && r.URL.Path == "/v1/responses")
		if !route {
			w.WriteHeader(http.StatusNotFound)
			io.WriteString(w, notFound())
			return
		}
		var req struct{ Model string }
		json.NewDecoder(r.Body).Decode(&req)
		if req.Model != "m" {
			w.WriteHeader(http.StatusNotFound)
			io.WriteString(w, unknownModel(req.Model))
			return
		}
		v.generated.Add(1)
		io.WriteString(w, `{"id":"resp_1","object":"response","status":"completed","model":"m","output":[]}`)
	}))
	t.Cleanup(v.srv.Close)
	return v
}

// vllmUnknownModel is vLLM's 404 for a model it does not serve.
func vllmUnknownModel(model string) string {
	return `{"error":{"message":"The model ` + "`" + model + "`" + ` does not exist.","type":"NotFoundError","param":null,"code":404}}`
}

func (v *vllmLike) posts(path string) int64 {
	if n, ok := v.asked.Load(path); ok {
		return n.(*atomic.Int64).Load()
	}
	return 0
}

// TestOptionalAPIsFromTheProbe: an engine recognised by its metrics, with
// no OpenAPI document, that answers an empty request to /v1/responses with
// a 404 for the model it names (none) and every path it lacks with its
// not-found page: the probe tells the two apart, /v1/responses is served
// and /v1/messages is not, and nothing was generated. (Reading every 404
// as a missing route, the agent found no API here.)
func TestOptionalAPIsFromTheProbe(t *testing.T) {
	v := newVLLMLike(t, true, func() string { return `{"detail":"Not Found"}` }, vllmUnknownModel)
	a := fixtureAgent(t, v.srv.URL, io.Discard)
	a.refresh(context.Background())
	e := a.Engine()
	if e.Kind != EngineVLLM || !slices.Equal(e.APIs, []string{"/v1/responses"}) || len(e.UnknownAPIs) != 0 {
		t.Fatalf("engine %+v, want vllm serving /v1/responses, nothing unknown", e)
	}
	if n := v.generated.Load(); n != 0 {
		t.Fatalf("the probe made the engine generate %d times", n)
	}
}

// TestOptionalAPIsFromTheFirstAnswer: an engine whose not-found page is
// different for every request (it carries a request id), and the one it
// gives a request naming no model it serves too: its answers to the probes show nothing, so both optional
// APIs are unknown, forwarded, and each is settled by the engine's first
// real answer: /v1/responses answered is served from then on; /v1/messages
// answered with the engine's not-found page is missing, marked so for the
// relay (transport.HeaderAPIMissing), and no longer forwarded.
func TestOptionalAPIsFromTheFirstAnswer(t *testing.T) {
	var reqID atomic.Int64
	notFound := func() string { return fmt.Sprintf(`{"detail":"Not Found","request_id":"%d"}`, reqID.Add(1)) }
	v := newVLLMLike(t, true, notFound, func(string) string { return notFound() })
	a := fixtureAgent(t, v.srv.URL, io.Discard)
	a.refresh(context.Background())
	if e := a.Engine(); e.Kind != EngineVLLM || len(e.APIs) != 0 || !slices.Equal(e.UnknownAPIs, optionalAPIs) {
		t.Fatalf("engine %+v, want vllm with both optional APIs unknown", e)
	}
	if info := a.Info(); !slices.Equal(info.UnknownAPIs, optionalAPIs) {
		t.Fatalf("join info %+v: the relay is not told what is unknown", info)
	}
	post := func(path string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		a.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, strings.NewReader(`{"model":"m","input":"hi"}`)))
		return rec
	}
	if rec := post("/v1/responses"); rec.Code != http.StatusOK || rec.Header().Get(transport.HeaderAPIMissing) != "" {
		t.Fatalf("/v1/responses: %d %v %s", rec.Code, rec.Header(), rec.Body)
	}
	if e := a.Engine(); !slices.Equal(e.APIs, []string{"/v1/responses"}) || !slices.Equal(e.UnknownAPIs, []string{"/v1/messages"}) {
		t.Fatalf("after a real answer on /v1/responses: %+v", e)
	}
	rec := post("/v1/messages")
	if rec.Code != http.StatusNotFound || rec.Header().Get(transport.HeaderAPIMissing) != "/v1/messages" || !strings.Contains(rec.Body.String(), "Not Found") {
		t.Fatalf("/v1/messages: %d %v %s", rec.Code, rec.Header(), rec.Body)
	}
	if e := a.Engine(); !slices.Equal(e.APIs, []string{"/v1/responses"}) || len(e.UnknownAPIs) != 0 {
		t.Fatalf("after the engine's not-found on /v1/messages: %+v", e)
	}
	if info := a.Info(); !slices.Equal(info.APIs, []string{"/v1/responses"}) || len(info.UnknownAPIs) != 0 {
		t.Fatalf("join info after learning: %+v", info)
	}
	before := v.posts("/v1/messages")
	if rec := post("/v1/messages"); rec.Code != http.StatusNotFound || v.posts("/v1/messages") != before {
		t.Fatalf("/v1/messages after it was learned missing: %d, forwarded %d times more", rec.Code, v.posts("/v1/messages")-before)
	}
	if n := v.generated.Load(); n != 1 {
		t.Fatalf("the engine generated %d times, want once (the one real request)", n)
	}
}

// The verdicts on probe answers and on real answers, case by case.
func TestRouteVerdicts(t *testing.T) {
	missing := answerOf(noSuchAPI, 404, []byte(`{"detail":"Not Found"}`))
	llamaMissing := answerOf(noSuchAPI, 404, []byte(`{"error":{"code":404,"message":"no route POST `+noSuchAPI+`"}}`))
	for _, c := range []struct {
		name    string
		path    string
		status  int
		body    string
		missing probeAnswer
		probe   routeVerdict // routeShown
		real    routeVerdict // classifyAnswer
	}{
		{"a rejection", "/v1/responses", 400, `{"error":"input is required"}`, missing, routeServed, routeServed},
		{"vLLM's unknown model", "/v1/responses", 404, "{\"error\":{\"message\":\"The model `` does not exist.\"}}", missing, routeServed, routeUnknown},
		{"the not-found page", "/v1/messages", 404, `{"detail":"Not Found"}`, missing, routeMissing, routeMissing},
		{"a not-found naming its path", "/v1/messages", 404, `{"error":{"code":404,"message":"no route POST /v1/messages"}}`, llamaMissing, routeMissing, routeMissing},
		{"405", "/v1/messages", 405, `{"detail":"Method Not Allowed"}`, missing, routeUnknown, routeMissing},
		{"another 404", "/v1/messages", 404, `{"detail":"gone","id":7}`, missing, routeUnknown, routeMissing},
		{"no answer", "/v1/messages", 0, ``, missing, routeUnknown, routeUnknown},
		{"busy", "/v1/responses", 429, `{}`, missing, routeServed, routeUnknown},
		{"loading", "/v1/responses", 503, `{}`, missing, routeUnknown, routeUnknown},
		{"a success", "/v1/responses", 200, `{"id":"resp_1"}`, missing, routeServed, routeServed},
	} {
		st := c.status
		if transientStatus(st) {
			st = 0 // as probe reads it
		}
		if got := routeShown(answerOf(c.path, st, []byte(c.body)), c.missing); got != c.probe {
			t.Errorf("%s: probe verdict %d, want %d", c.name, got, c.probe)
		}
		if got := classifyAnswer(c.path, c.status, []byte(c.body), c.missing); got != c.real {
			t.Errorf("%s: answer verdict %d, want %d", c.name, got, c.real)
		}
	}
}
