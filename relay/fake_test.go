package relay

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/relaytest/poll"
	"github.com/computeflux/computeflux/transport"
)

const testKey = "sk-test-0123456789"

// engine is a fake OpenAI engine behind an httptest server. By default it
// answers chat completions (streamed when asked) and embeddings; handle
// replaces that behaviour.
type engine struct {
	name   string
	srv    *httptest.Server
	hits   atomic.Int64
	mu     sync.Mutex
	handle func(w http.ResponseWriter, r *http.Request, body []byte) // guarded by mu
	last   http.Header                                               // guarded by mu
}

func newEngine(t testing.TB, name string) *engine {
	e := &engine{name: name}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.hits.Add(1)
		body, _ := io.ReadAll(r.Body)
		e.mu.Lock()
		h := e.handle
		e.last = r.Header.Clone()
		e.mu.Unlock()
		if h != nil {
			h(w, r, body)
			return
		}
		defaultEngine(w, r, body, e.name)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *engine) set(h func(w http.ResponseWriter, r *http.Request, body []byte)) {
	e.mu.Lock()
	e.handle = h
	e.mu.Unlock()
}

func (e *engine) lastHeader() http.Header {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.last
}

// defaultEngine answers like an OpenAI server: JSON, or SSE when stream is true.
func defaultEngine(w http.ResponseWriter, r *http.Request, body []byte, name string) {
	var req struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		http.Error(w, `{"error":{"message":"bad json","type":"invalid_request_error"}}`, http.StatusBadRequest)
		return
	}
	if r.URL.Path == "/v1/embeddings" {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":%q,"usage":{"prompt_tokens":1,"total_tokens":1}}`, req.Model)
		return
	}
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hello from %s"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}`, req.Model, name)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	f := w.(http.Flusher)
	for i, tok := range []string{"hello", " from", " " + name} {
		fmt.Fprintf(w, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":%q,\"choices\":[{\"index\":0,\"delta\":{\"content\":%q},\"finish_reason\":null}]}\n\n", req.Model, tok)
		_ = i
		f.Flush()
	}
	fmt.Fprintf(w, "data: [DONE]\n\n")
	f.Flush()
}

// fakeTransport carries http://<peerID>/... to the engine registered for
// the peer, or fails like a broken link.
type fakeTransport struct {
	base *http.Transport
	mu   sync.Mutex
	to   map[string]*url.URL // peer ID string -> engine URL
	down map[string]bool
	sent map[string]int // attempts per peer ID string, failed or not
}

func newFakeTransport(t testing.TB) *fakeTransport {
	ft := &fakeTransport{base: &http.Transport{}, to: map[string]*url.URL{}, down: map[string]bool{}, sent: map[string]int{}}
	t.Cleanup(ft.base.CloseIdleConnections)
	return ft
}

var errLinkDown = errors.New("fake link down")

func (ft *fakeTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ft.mu.Lock()
	u, ok := ft.to[req.URL.Host]
	down := ft.down[req.URL.Host]
	ft.sent[req.URL.Host]++
	ft.mu.Unlock()
	if !ok || down {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, fmt.Errorf("dial %s: %w", req.URL.Host, errLinkDown)
	}
	out := req.Clone(req.Context())
	out.URL.Scheme, out.URL.Host = u.Scheme, u.Host
	return ft.base.RoundTrip(out)
}

func (ft *fakeTransport) CloseIdleConnections() { ft.base.CloseIdleConnections() }

// attempts returns how many requests were sent towards peer p.
func (ft *fakeTransport) attempts(p peer.ID) int {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	return ft.sent[p.String()]
}

func (ft *fakeTransport) setDown(p peer.ID, down bool) {
	ft.mu.Lock()
	ft.down[p.String()] = down
	ft.mu.Unlock()
}

// testbed is a relay without libp2p in front of fake engines.
type testbed struct {
	t       testing.TB
	relay   *Relay
	srv     *httptest.Server
	ft      *fakeTransport
	engines map[string]*engine
	peers   map[string]peer.ID
	logs    *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// newTestbed starts a relay with agents named after engines, all serving
// model "m1". edit may change the Config before New.
func newTestbed(t testing.TB, names []string, edit func(*Config)) *testbed {
	t.Helper()
	tb := &testbed{t: t, ft: newFakeTransport(t), engines: map[string]*engine{}, peers: map[string]peer.ID{}, logs: &syncBuffer{}}
	cfg := Config{
		NoP2P:     true,
		Transport: tb.ft,
		APIKeys:   []string{"sk-other", testKey},
		Logger:    zerolog.New(tb.logs),
		// A request for a model no agent serves waits this long after the
		// start for agents to rejoin (the restart hold) before its 404;
		// the testbed's agents are there from the start. The hold's own
		// tests set it.
		RestartHold: 250 * time.Millisecond,
	}
	cfg.Scheduler.Seed = 1
	if edit != nil {
		edit(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	tb.relay = r
	t.Cleanup(func() { _ = r.Close() })
	tb.srv = httptest.NewServer(r.Handler())
	t.Cleanup(tb.srv.Close)
	for _, n := range names {
		tb.addAgent(n, []string{"m1"})
	}
	return tb
}

func (tb *testbed) addAgent(name string, models []string) *engine {
	tb.t.Helper()
	e := newEngine(tb.t, name)
	p := peer.ID("peer-" + name)
	u, _ := url.Parse(e.srv.URL)
	tb.ft.mu.Lock()
	tb.ft.to[p.String()] = u
	tb.ft.mu.Unlock()
	tb.engines[name], tb.peers[name] = e, p
	if err := tb.relay.Registry().Joined(p, transport.JoinInfo{Name: name, Models: models}); err != nil {
		tb.t.Fatal(err)
	}
	return e
}

// do sends a request to the relay with the test key.
func (tb *testbed) do(method, path, body string, hdr ...string) *http.Response {
	tb.t.Helper()
	return tb.doCtx(context.Background(), method, path, body, hdr...)
}

func (tb *testbed) doCtx(ctx context.Context, method, path, body string, hdr ...string) *http.Response {
	tb.t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, tb.srv.URL+path, strings.NewReader(body))
	if err != nil {
		tb.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+testKey)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		if hdr[i+1] == "" {
			req.Header.Del(hdr[i])
		} else {
			req.Header.Set(hdr[i], hdr[i+1])
		}
	}
	resp, err := tb.srv.Client().Do(req)
	if err != nil {
		tb.t.Fatal(err)
	}
	return resp
}

// chat sends a non-streamed chat completion and returns the status, the
// serving agent and the body.
func (tb *testbed) chat(session string) (int, string, string) {
	tb.t.Helper()
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`, "X-Session-ID", session)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get(HeaderAgent), string(b)
}

// apiError decodes OpenAI's error JSON, failing the test if the shape is wrong.
func apiError(t *testing.T, resp *http.Response) errorObject {
	t.Helper()
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("error Content-Type = %q", ct)
	}
	var raw map[string]map[string]any
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatalf("error body %q: %v", b, err)
	}
	e, ok := raw["error"]
	if !ok {
		t.Fatalf("no error object in %s", b)
	}
	for _, k := range []string{"message", "type", "code"} {
		if s, _ := e[k].(string); s == "" {
			t.Errorf("error.%s missing in %s", k, b)
		}
	}
	msg, _ := e["message"].(string)
	typ, _ := e["type"].(string)
	code, _ := e["code"].(string)
	return errorObject{Message: msg, Type: typ, Code: code}
}

// readEvents reads SSE data payloads until EOF or [DONE].
func readEvents(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if d, ok := strings.CutPrefix(line, "data: "); ok {
			out = append(out, d)
			if d == "[DONE]" {
				break
			}
		}
	}
	return out
}

// waitFor polls cond until it holds or a generous deadline passes.
var waitFor = poll.Eventually
