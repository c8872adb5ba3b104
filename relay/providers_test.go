package relay

import (
	"context"
	"fmt"
	"io"
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
)

// fakeProvider is a hosted OpenAI-compatible API over TLS that checks API
// keys: each key's answer is set by the test. It records the keys of every
// inference request in order.
type fakeProvider struct {
	name   string
	srv    *httptest.Server
	models []string

	mu     sync.Mutex
	answer map[string]func(w http.ResponseWriter, r *http.Request, body []byte) // by key; guarded by mu
	seen   []string                                                             // keys of inference requests, in order
	paths  []string
	hits   atomic.Int64
}

// providerOK answers like OpenAI, naming the provider in the content.
func providerOK(name string) func(w http.ResponseWriter, r *http.Request, body []byte) {
	return func(w http.ResponseWriter, r *http.Request, body []byte) { defaultEngine(w, r, body, name) }
}

func answerStatus(status int, retryAfter string) func(w http.ResponseWriter, r *http.Request, body []byte) {
	return func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		if retryAfter != "" {
			w.Header().Set("Retry-After", retryAfter)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"error":{"message":"status %d","type":"x","code":"x"}}`, status)
	}
}

func newFakeProvider(t testing.TB, name string, models []string, keys ...string) *fakeProvider {
	fp := &fakeProvider{name: name, models: models, answer: map[string]func(http.ResponseWriter, *http.Request, []byte){}}
	for _, k := range keys {
		fp.answer[k] = providerOK(name)
	}
	fp.srv = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		fp.mu.Lock()
		h, ok := fp.answer[key]
		fp.mu.Unlock()
		if !ok {
			h = answerStatus(http.StatusUnauthorized, "")
		}
		if r.URL.Path == "/v1/models" && r.Method == http.MethodGet && ok {
			var list struct {
				Data []modelObject `json:"data"`
			}
			for _, m := range fp.models {
				list.Data = append(list.Data, modelObject{ID: m, Object: "model"})
			}
			writeJSON(w, http.StatusOK, list)
			return
		}
		body, _ := io.ReadAll(r.Body)
		fp.hits.Add(1)
		fp.mu.Lock()
		fp.seen = append(fp.seen, key)
		fp.paths = append(fp.paths, r.URL.Path)
		fp.mu.Unlock()
		h(w, r, body)
	}))
	t.Cleanup(fp.srv.Close)
	return fp
}

func (fp *fakeProvider) set(key string, h func(w http.ResponseWriter, r *http.Request, body []byte)) {
	fp.mu.Lock()
	fp.answer[key] = h
	fp.mu.Unlock()
}

// takeSeen returns the keys seen since the last call.
func (fp *fakeProvider) takeSeen() []string {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	s := fp.seen
	fp.seen = nil
	return s
}

func (fp *fakeProvider) url() string { return fp.srv.URL + "/v1" }

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// providerBed is a testbed whose relay reads an endpoints file and trusts
// the fake providers' certificate.
func providerBed(t *testing.T, agents []string, file string, edit func(*Config)) (*testbed, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "endpoints.yaml")
	writeFile(t, path, file)
	tls := httptest.NewTLSServer(http.NotFoundHandler()) // its client trusts every httptest TLS server
	t.Cleanup(tls.Close)
	tr := tls.Client().Transport.(*http.Transport).Clone()
	t.Cleanup(tr.CloseIdleConnections)
	tb := newTestbed(t, agents, func(c *Config) {
		c.EndpointsFile = path
		c.ProviderTransport = tr
		if edit != nil {
			edit(c)
		}
	})
	return tb, path
}

const chatM1 = `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`

func chatOK(t *testing.T, tb *testbed, body string, hdr ...string) (agent, content string) {
	t.Helper()
	resp := tb.do("POST", "/v1/chat/completions", body, hdr...)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	return resp.Header.Get(HeaderAgent), string(b)
}

// countLines counts log lines holding every one of subs.
func countLines(logs string, subs ...string) int {
	n := 0
	for _, l := range strings.Split(logs, "\n") {
		ok := l != ""
		for _, s := range subs {
			ok = ok && strings.Contains(l, s)
		}
		if ok {
			n++
		}
	}
	return n
}

// The first target: 401 on the first key, 429 on the second, the
// third serves, in one request, with one log line per attempt; later
// requests try the 401 key again; the 429 key waits out its Retry-After.
func TestProviderKeyFailover(t *testing.T) {
	fp := newFakeProvider(t, "cloud", []string{"m1"}, "sk-one", "sk-two", "sk-three")
	fp.set("sk-one", answerStatus(http.StatusUnauthorized, ""))
	fp.set("sk-two", answerStatus(http.StatusTooManyRequests, "7"))
	clk := newStepClock()
	tb, _ := providerBed(t, nil, fmt.Sprintf(`
endpoints:
  - name: cloud
    url: %s
    keys: [sk-one, sk-two, sk-three]
    models: [m1]
`, fp.url()), func(c *Config) { c.Clock = clk })

	agent, _ := chatOK(t, tb, chatM1)
	if agent != "cloud" {
		t.Fatalf("served by %q", agent)
	}
	if got := fp.takeSeen(); !slices.Equal(got, []string{"sk-one", "sk-two", "sk-three"}) {
		t.Fatalf("keys tried: %v", got)
	}
	logs := tb.logs.String()
	if n := countLines(logs, `"attempt failed"`, `"agent":"cloud"`); n != 2 {
		t.Errorf("%d attempt-failed lines, want 2:\n%s", n, logs)
	}
	if countLines(logs, `"attempt failed"`, `"key":1`, "401") != 1 || countLines(logs, `"attempt failed"`, `"key":2`, "429") != 1 {
		t.Errorf("attempt lines do not name keys 1 (401) and 2 (429):\n%s", logs)
	}
	if n := countLines(logs, `"message":"request"`, `"attempts":3`, `"status":200`); n != 1 {
		t.Errorf("%d request lines with 3 attempts and 200, want 1:\n%s", n, logs)
	}

	// The refused key is tried again by the next request; the limited
	// one is skipped until its Retry-After has passed.
	fp.set("sk-one", providerOK("cloud"))
	chatOK(t, tb, chatM1)
	if got := fp.takeSeen(); !slices.Equal(got, []string{"sk-one"}) {
		t.Fatalf("second request tried %v, want the refused key first", got)
	}
	fp.set("sk-one", answerStatus(http.StatusForbidden, ""))
	chatOK(t, tb, chatM1)
	if got := fp.takeSeen(); !slices.Equal(got, []string{"sk-one", "sk-three"}) {
		t.Fatalf("within Retry-After: tried %v, want sk-one then sk-three", got)
	}
	row := tableRow(t, tb.relay, "cloud")
	if row.Keys[1].State != "open" || row.Keys[1].BreakerUntil == nil || !row.Keys[1].BreakerUntil.Equal(clk.Now().Add(7*time.Second)) {
		t.Fatalf("key 2 state %+v, want open until now+7s", row.Keys[1])
	}
	clk.add(7 * time.Second)
	fp.set("sk-two", providerOK("cloud"))
	chatOK(t, tb, chatM1)
	if got := fp.takeSeen(); !slices.Equal(got, []string{"sk-one", "sk-two"}) {
		t.Fatalf("after Retry-After: tried %v, want sk-one then sk-two", got)
	}
	assertNoSecrets(t, tb.logs.String(), "sk-one", "sk-two", "sk-three")
}

func assertNoSecrets(t *testing.T, text string, secrets ...string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(text, s) {
			t.Errorf("secret %q appears in:\n%s", s, text)
		}
	}
}

func tableRow(t *testing.T, r *Relay, name string) TableRow {
	t.Helper()
	for _, row := range r.Table() {
		if row.Name == name {
			return row
		}
	}
	t.Fatalf("no row %q in %+v", name, r.Table())
	return TableRow{}
}

// The seed's exclusions, in order, each through the relay.
func TestProviderExclusions(t *testing.T) {
	t.Run("disabled", func(t *testing.T) {
		fp := newFakeProvider(t, "cloud", []string{"m1"}, "k1")
		tb, _ := providerBed(t, []string{"home"}, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [k1], models: [m1], priority: 0, weight: 100}\n", fp.url()), nil)
		if err := tb.relay.SetAdmin("cloud", "disable", 0); err != nil {
			t.Fatal(err)
		}
		for range 10 {
			if agent, _ := chatOK(t, tb, chatM1); agent != "home" {
				t.Fatalf("served by %s", agent)
			}
		}
		if n := fp.hits.Load(); n != 0 {
			t.Fatalf("disabled provider got %d requests", n)
		}
		if err := tb.relay.SetAdmin("home", "disable", 0); err != nil {
			t.Fatal(err)
		}
		resp := tb.do("POST", "/v1/chat/completions", chatM1)
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("everything disabled: status %d", resp.StatusCode)
		}
		apiError(t, resp)
	})
	t.Run("dead keys", func(t *testing.T) {
		fp := newFakeProvider(t, "cloud", []string{"m1"})
		tb, _ := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [k1, k2], models: [m1]}\n", fp.url()), nil)
		resp := tb.do("POST", "/v1/chat/completions", chatM1)
		if resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("every key refused: status %d", resp.StatusCode)
		}
		apiError(t, resp)
		if got := fp.takeSeen(); !slices.Equal(got, []string{"k1", "k2"}) {
			t.Fatalf("keys tried %v: each once", got)
		}
		// Not a breaker: the next request tries them again.
		resp = tb.do("POST", "/v1/chat/completions", chatM1)
		resp.Body.Close()
		if got := fp.takeSeen(); !slices.Equal(got, []string{"k1", "k2"}) {
			t.Fatalf("next request tried %v", got)
		}
	})
	t.Run("used keys", func(t *testing.T) {
		fp := newFakeProvider(t, "cloud", []string{"m1"}, "k1", "k2")
		fp.set("k1", answerStatus(http.StatusTooManyRequests, "30"))
		fp.set("k2", answerStatus(http.StatusTooManyRequests, "12"))
		tb, _ := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [k1, k2], models: [m1]}\n", fp.url()), nil)
		resp := tb.do("POST", "/v1/chat/completions", chatM1)
		if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "30" {
			t.Fatalf("every key limited: status %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		apiError(t, resp)
		if got := fp.takeSeen(); !slices.Equal(got, []string{"k1", "k2"}) {
			t.Fatalf("keys tried %v", got)
		}
		// Both breakers open: the provider is not called at all.
		resp = tb.do("POST", "/v1/chat/completions", chatM1)
		if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "12" {
			t.Fatalf("breakers open: status %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		resp.Body.Close()
		if got := fp.takeSeen(); len(got) != 0 {
			t.Fatalf("limited keys called: %v", got)
		}
	})
	t.Run("model mismatch", func(t *testing.T) {
		fp := newFakeProvider(t, "cloud", []string{"other"}, "k1")
		tb, _ := providerBed(t, []string{"home"}, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [k1], models: [other], priority: 0, weight: 100}\n", fp.url()), nil)
		for range 5 {
			if agent, _ := chatOK(t, tb, chatM1); agent != "home" {
				t.Fatalf("m1 served by %s", agent)
			}
		}
		if agent, _ := chatOK(t, tb, `{"model":"other","messages":[]}`); agent != "cloud" {
			t.Fatalf("other served by %s", agent)
		}
		if n := fp.hits.Load(); n != 1 {
			t.Fatalf("provider got %d requests, want only the one for its model", n)
		}
		resp := tb.do("POST", "/v1/chat/completions", `{"model":"nope","messages":[]}`)
		if resp.StatusCode != http.StatusNotFound {
			t.Fatalf("unknown model: %d", resp.StatusCode)
		}
		apiError(t, resp)
	})
}

// A 5xx or a connection failure counts against the endpoint: the retry goes
// to another endpoint, not to the same provider's next key.
func TestProviderFailureCountsAgainstEndpoint(t *testing.T) {
	bad := newFakeProvider(t, "bad", []string{"m1"}, "k1", "k2")
	bad.set("k1", answerStatus(http.StatusInternalServerError, ""))
	good := newFakeProvider(t, "good", []string{"m1"}, "g1")
	tb, _ := providerBed(t, nil, fmt.Sprintf(`endpoints:
  - {name: bad, url: %s, keys: [k1, k2], models: [m1], weight: 100}
  - {name: good, url: %s, keys: [g1], models: [m1]}
  - {name: gone, url: "https://127.0.0.1:1/v1", keys: [x], models: [m1], priority: 2}
`, bad.url(), good.url()), nil)
	if agent, _ := chatOK(t, tb, chatM1); agent != "good" {
		t.Fatalf("served by %s", agent)
	}
	if got := bad.takeSeen(); !slices.Equal(got, []string{"k1"}) {
		t.Fatalf("bad provider saw %v: its second key must not be the retry", got)
	}
	row := tableRow(t, tb.relay, "bad")
	if row.SuccessRate >= 1 {
		t.Fatalf("a 5xx left the success rate at %v", row.SuccessRate)
	}

	// A connection failure: only the unreachable provider is left.
	if err := tb.relay.SetAdmin("bad", "disable", 0); err != nil {
		t.Fatal(err)
	}
	if err := tb.relay.SetAdmin("good", "disable", 0); err != nil {
		t.Fatal(err)
	}
	resp := tb.do("POST", "/v1/chat/completions", chatM1)
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("unreachable provider: %d", resp.StatusCode)
	}
	apiError(t, resp)
	if row := tableRow(t, tb.relay, "gone"); row.SuccessRate >= 1 || row.Keys[0].DeadKeys != 0 {
		t.Fatalf("connection failure not counted against the endpoint: %+v", row)
	}
}

// Garbage, redirects and hangs are handled as for agents: retried before
// the first byte.
func TestProviderBadAnswersRetried(t *testing.T) {
	cases := map[string]func(w http.ResponseWriter, r *http.Request, body []byte){
		"garbage": func(w http.ResponseWriter, _ *http.Request, _ []byte) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, "<html>not json")
		},
		"redirect": func(w http.ResponseWriter, r *http.Request, _ []byte) {
			http.Redirect(w, r, "https://example.invalid/elsewhere", http.StatusFound)
		},
		"hang": func(_ http.ResponseWriter, r *http.Request, _ []byte) {
			<-r.Context().Done()
		},
	}
	for name, h := range cases {
		t.Run(name, func(t *testing.T) {
			bad := newFakeProvider(t, "bad", []string{"m1"}, "k1")
			bad.set("k1", h)
			good := newFakeProvider(t, "good", []string{"m1"}, "g1")
			tb, _ := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - {name: bad, url: %s, keys: [k1], models: [m1], weight: 100}\n  - {name: good, url: %s, keys: [g1], models: [m1]}\n", bad.url(), good.url()),
				func(c *Config) { c.TTFBTimeout = 300 * time.Millisecond })
			agent, body := chatOK(t, tb, chatM1)
			if agent != "good" || !strings.Contains(body, "good") {
				t.Fatalf("served by %s: %s", agent, body)
			}
			if bad.hits.Load() != 1 {
				t.Fatalf("bad provider tried %d times", bad.hits.Load())
			}
		})
	}
}

// Models are discovered from GET /models with a key when the file lists
// none; the request path keeps the provider's base path.
func TestProviderDiscoveryAndPath(t *testing.T) {
	fp := newFakeProvider(t, "cloud", []string{"llama-3.1-8b", "m1"}, "good")
	keyFile := filepath.Join(t.TempDir(), "cloud.key")
	writeFile(t, keyFile, "# refused first, then the good one\nbad-key\ngood\n")
	tb, _ := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - name: cloud\n    url: %s\n    key_files: [%s]\n", fp.url(), keyFile), nil)
	row := tableRow(t, tb.relay, "cloud")
	if !slices.Equal(row.Models, []string{"llama-3.1-8b", "m1"}) || row.Tier != DefaultProviderPriority || len(row.Keys) != 2 {
		t.Fatalf("row %+v", row)
	}
	resp := tb.do("GET", "/v1/models", "")
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "llama-3.1-8b") {
		t.Fatalf("/v1/models: %s", b)
	}
	chatOK(t, tb, `{"model":"llama-3.1-8b","messages":[]}`)
	fp.mu.Lock()
	paths := slices.Clone(fp.paths)
	fp.mu.Unlock()
	if paths[len(paths)-1] != "/v1/chat/completions" {
		t.Fatalf("provider saw path %v", paths)
	}
	// The provider's cookies and account headers stay with the relay.
	fp.set("good", func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Set-Cookie", "__cf_bm=operator-cookie")
		w.Header().Set("Openai-Organization", "operator-org")
		defaultEngine(w, r, body, "cloud")
	})
	resp = tb.do("POST", "/v1/chat/completions", `{"model":"m1","messages":[]}`)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Set-Cookie") != "" || resp.Header.Get("Openai-Organization") != "" {
		t.Fatalf("provider headers reached the client: %d %v", resp.StatusCode, resp.Header)
	}
	// The client's relay key is never forwarded.
	if got := fp.takeSeen(); slices.Contains(got, testKey) {
		t.Fatalf("client key forwarded: %v", got)
	}
}

// A malformed file is refused at start with line and field; on reload the
// old table stays, with the error logged.
func TestEndpointsFileReload(t *testing.T) {
	fp := newFakeProvider(t, "cloud", []string{"m1"}, "k1", "k2")
	slow := make(chan struct{})
	fp.set("k1", func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-slow:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: [DONE]\n\n")
	})
	tb, path := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [k1], models: [m1]}\n", fp.url()), nil)

	// A stream in flight across two reloads, one of which changes the keys.
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","stream":true,"messages":[]}`, "X-Session-ID", "s1")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("stream status %d", resp.StatusCode)
	}
	writeFile(t, path, "endpoints:\n  - {name: cloud, url: "+fp.url()+", keys: [k2, k1], models: [m1]\n")
	err := tb.relay.ReloadEndpoints(context.Background())
	if err == nil || !strings.Contains(err.Error(), "line") {
		t.Fatalf("malformed reload: %v", err)
	}
	if !strings.Contains(tb.logs.String(), "routing table in force stays") {
		t.Fatalf("reload error not logged:\n%s", tb.logs.String())
	}
	writeFile(t, path, "endpoints:\n  - {name: cloud, url: "+fp.url()+", keys: [k2, k1], models: [m1], weight: 3}\n")
	if err := tb.relay.ReloadEndpoints(context.Background()); err != nil {
		t.Fatal(err)
	}
	close(slow)
	all, _ := io.ReadAll(resp.Body) // to the end, so the relay sees the stream finish
	resp.Body.Close()
	events := readEvents(t, strings.NewReader(string(all)))
	if len(events) != 3 || events[2] != "[DONE]" {
		t.Fatalf("in-flight stream across reload: %v", events)
	}
	waitFor(t, "the stream's report", func() bool { return tableRow(t, tb.relay, "cloud").InFlight == 0 })
	row := tableRow(t, tb.relay, "cloud")
	if row.Weight != 3 || row.Sessions != 1 || len(row.Keys) != 2 {
		t.Fatalf("after reload: %+v", row)
	}
	// The session survived the reload.
	resp = tb.do("POST", "/v1/chat/completions", chatM1, "X-Session-ID", "s1")
	resp.Body.Close()
	if resp.Header.Get(HeaderAffinity) != "hit" {
		t.Fatalf("session after reload: affinity %q", resp.Header.Get(HeaderAffinity))
	}
	if got := fp.takeSeen(); got[len(got)-1] != "k2" {
		t.Fatalf("new key order not in force: %v", got)
	}
	assertNoSecrets(t, tb.logs.String(), "k1\"", "k2\"")
}

func TestEndpointsFileRefusedAtStart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "e.yaml")
	writeFile(t, path, "endpoints:\n  - name: cloud\n    url: http://api.example.com/v1\n    keys: [sk-secret-zz]\n")
	_, err := New(Config{NoP2P: true, Transport: http.DefaultTransport, NoAuth: true, EndpointsFile: path})
	if err == nil || !strings.Contains(err.Error(), "line 3") || !strings.Contains(err.Error(), "url") || strings.Contains(err.Error(), "sk-secret-zz") {
		t.Fatalf("error %v: want line 3, url, no key", err)
	}
}

func TestParseEndpointsFile(t *testing.T) {
	files := map[string][]byte{"/k": []byte("sk-from-file\n")}
	read := func(p string) ([]byte, error) {
		if b, ok := files[p]; ok {
			return b, nil
		}
		return nil, os.ErrNotExist
	}
	good := `
endpoints:
  - name: cloud
    url: https://api.example.com/v1/
    keys: [sk-1, sk-2]          # or key_files
    key_files: [/k]
    models: [llama-3.1-8b]
    weight: 2
    priority: 0
    max_concurrency: 64
  - name: lan-vllm
    url: http://192.168.1.20:8000/v1
agents:
  - {name: gpu1, weight: 8, priority: 1}
  - {name: gpu2, disabled: true}
`
	ef, err := ParseEndpointsFile([]byte(good), read)
	if err != nil {
		t.Fatal(err)
	}
	c := ef.Endpoints[0]
	if c.URL.String() != "https://api.example.com/v1" || !slices.Equal(c.Keys, []string{"sk-1", "sk-2", "sk-from-file"}) ||
		c.Weight != 2 || c.Priority != 0 || c.MaxConcurrency != 64 || !slices.Equal(c.Models, []string{"llama-3.1-8b"}) {
		t.Fatalf("cloud: %+v", c)
	}
	if l := ef.Endpoints[1]; l.Priority != DefaultProviderPriority || len(l.Keys) != 0 {
		t.Fatalf("lan: %+v", l)
	}
	if a := ef.Agents; len(a) != 2 || a[0].Weight != 8 || *a[0].Priority != 1 || !a[1].Disabled {
		t.Fatalf("agents: %+v", a)
	}

	// The same as JSON.
	js := `{"endpoints":[{"name":"cloud","url":"https://api.example.com/v1","keys":["sk-1"],"priority":2}],"agents":[{"name":"gpu1","weight":3}]}`
	ef, err = ParseEndpointsFile([]byte(js), nil)
	if err != nil || ef.Endpoints[0].Priority != 2 || ef.Agents[0].Weight != 3 {
		t.Fatalf("JSON: %+v %v", ef, err)
	}
	if ef, err := ParseEndpointsFile(nil, nil); err != nil || len(ef.Endpoints) != 0 {
		t.Fatalf("empty file: %v", err)
	}

	bad := []struct{ name, file, want string }{
		{"unknown field", "endpoints:\n  - name: a\n    url: https://x/v1\n    kyes: [k]\n", "line 4: field kyes not found in an endpoint"},
		{"wrong type", "endpoints:\n  - name: a\n    url: https://x/v1\n    weight: heavy\n", "line 4"},
		{"no url", "endpoints:\n  - name: a\n", "line 2: endpoints[0] (\"a\"): url: required"},
		{"plain http to the internet", "endpoints:\n  - name: a\n    url: http://api.example.com/v1\n", "line 3: endpoints[0] (\"a\"): url: plain http"},
		{"credentials in url", "endpoints:\n  - name: a\n    url: https://u:p@x/v1\n", "url: credentials"},
		{"bad name", "endpoints:\n  - name: a b\n    url: https://x/v1\n", "line 2: endpoints[0] (\"a b\"): name"},
		{"duplicate", "endpoints:\n  - {name: a, url: https://x/v1}\n  - {name: a, url: https://y/v1}\n", "line 3: endpoints[1] (\"a\"): name"},
		{"negative weight", "endpoints:\n  - name: a\n    url: https://x/v1\n    weight: -1\n", "line 4: endpoints[0] (\"a\"): weight"},
		{"bad priority", "endpoints:\n  - name: a\n    url: https://x/v1\n    priority: -2\n", "line 4: endpoints[0] (\"a\"): priority"},
		{"bad concurrency", "endpoints:\n  - name: a\n    url: https://x/v1\n    max_concurrency: -2\n", "line 4: endpoints[0] (\"a\"): max_concurrency"},
		{"key with space", "endpoints:\n  - name: a\n    url: https://x/v1\n    keys: [\"sk secret\"]\n", "line 4: endpoints[0] (\"a\"): keys: key 1"},
		{"missing key file", "endpoints:\n  - name: a\n    url: https://x/v1\n    key_files: [/nope]\n", "line 4: endpoints[0] (\"a\"): key_files"},
		{"agent without name", "agents:\n  - weight: 2\n", "line 2: agents[0] (\"\"): name"},
		{"agent named like an endpoint", "endpoints:\n  - {name: a, url: https://x/v1}\nagents:\n  - {name: a}\n", "line 4: agents[0] (\"a\"): name"},
		{"top-level typo", "endpoint:\n  - name: a\n", "line 1: field endpoint not found at the top level"},
		{"not yaml", "endpoints: [\n", "line"},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseEndpointsFile([]byte(tt.file), read)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want it to contain %q", err, tt.want)
			}
			if strings.Contains(err.Error(), "sk secret") {
				t.Fatalf("error shows a key: %v", err)
			}
		})
	}
}

func TestLocalHost(t *testing.T) {
	for host, want := range map[string]bool{
		"localhost": true, "127.0.0.1": true, "::1": true, "192.168.1.5": true, "10.1.2.3": true, "fd00::1": true,
		"gpu-box": true, "vllm.lan": true, "box.local": true, "x.home.arpa": true,
		"api.example.com": false, "8.8.8.8": false, "2001:db8::1": false, "example.com.": false,
	} {
		if got := localHost(host); got != want {
			t.Errorf("localHost(%q) = %v, want %v", host, got, want)
		}
	}
}

func TestParseModelList(t *testing.T) {
	got, err := parseModelList([]byte(`{"object":"list","data":[{"id":"b"},{"id":"a"},{"id":"b"},{"id":""}]}`))
	if err != nil || !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("%v %v", got, err)
	}
	for _, bad := range []string{`{}`, `[]`, `{"data":[]}`, `nope`} {
		if _, err := parseModelList([]byte(bad)); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

func FuzzParseEndpointsFile(f *testing.F) {
	f.Add([]byte("endpoints:\n  - {name: a, url: https://x/v1, keys: [k], models: [m], weight: 1, priority: 1, max_concurrency: 2}\nagents:\n  - {name: g, weight: 2}\n"))
	f.Add([]byte(`{"endpoints":[{"name":"a","url":"http://127.0.0.1:8000/v1"}]}`))
	f.Add([]byte("endpoints: [\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ef, err := ParseEndpointsFile(b, nil)
		if err != nil {
			return
		}
		for _, e := range ef.Endpoints {
			if !validName.MatchString(e.Name) || e.URL == nil || e.Priority < 0 || e.Weight < 0 || e.MaxConcurrency < 0 {
				t.Fatalf("accepted a bad endpoint: %+v", e)
			}
			if e.URL.Scheme == "http" && !localHost(e.URL.Hostname()) {
				t.Fatalf("accepted plain http to %s", e.URL.Host)
			}
		}
	})
}

func FuzzParseModelList(f *testing.F) {
	f.Add([]byte(`{"object":"list","data":[{"id":"m1"},{"id":"m2"}]}`))
	f.Add([]byte(`{"data":[{"id":""}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		models, err := parseModelList(b)
		if err != nil {
			return
		}
		if len(models) == 0 || !slices.IsSorted(models) {
			t.Fatalf("bad list %v", models)
		}
		for _, m := range models {
			if m == "" {
				t.Fatal("empty model")
			}
		}
	})
}

// A provider whose models cannot be discovered is listed with the error,
// serves nothing, and is retried until discovery works.
func TestProviderRediscovery(t *testing.T) {
	fp := newFakeProvider(t, "cloud", []string{"m9"})
	tb, _ := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [late-key]}\n", fp.url()), nil)
	row := tableRow(t, tb.relay, "cloud")
	if row.State != "no-models" || !strings.Contains(row.Error, "status 401") || strings.Contains(row.Error, "late-key") {
		t.Fatalf("row %+v", row)
	}
	tb.relay.providers.reload.Lock()
	looping := tb.relay.providers.looping
	tb.relay.providers.reload.Unlock()
	if !looping {
		t.Fatal("no rediscovery scheduled")
	}
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m9","messages":[]}`)
	if resp.StatusCode == http.StatusOK {
		t.Fatal("served a model it was never found to have")
	}
	resp.Body.Close()
	fp.set("late-key", providerOK("cloud"))
	if tb.relay.providers.rediscover() {
		t.Fatal("still missing after the provider answered")
	}
	if row := tableRow(t, tb.relay, "cloud"); row.State != "ok" || !slices.Equal(row.Models, []string{"m9"}) {
		t.Fatalf("after rediscovery: %+v", row)
	}
	if agent, _ := chatOK(t, tb, `{"model":"m9","messages":[]}`); agent != "cloud" {
		t.Fatalf("served by %s", agent)
	}
}

// A provider's stream that breaks after its first byte ends with an error
// event, as an agent's does.
func TestProviderStreamBreaks(t *testing.T) {
	fp := newFakeProvider(t, "cloud", []string{"m1"}, "k1")
	fp.set("k1", func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	})
	tb, _ := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [k1], models: [m1]}\n", fp.url()), nil)
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","stream":true,"messages":[]}`)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderAgent) != "cloud" {
		t.Fatalf("status %d from %q", resp.StatusCode, resp.Header.Get(HeaderAgent))
	}
	events := readEvents(t, resp.Body)
	if len(events) != 2 || !strings.Contains(events[1], `"upstream_failed"`) {
		t.Fatalf("events %v: want the chunk, then an error event", events)
	}
}
