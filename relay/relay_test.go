package relay

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

const chatBody = `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`

func TestErrorStatuses(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.MaxBodyBytes = 1024 })
	cases := []struct {
		name, method, path, body string
		hdr                      []string
		status                   int
		code                     string
	}{
		{"malformed json", "POST", "/v1/chat/completions", `{"model":`, nil, 400, "invalid_json"},
		{"not an object", "POST", "/v1/chat/completions", `["m1"]`, nil, 400, "invalid_json"},
		{"missing model", "POST", "/v1/chat/completions", `{"messages":[]}`, nil, 400, "missing_model"},
		{"null model", "POST", "/v1/completions", `{"model":null}`, nil, 400, "missing_model"},
		{"non-string model", "POST", "/v1/chat/completions", `{"model":7}`, nil, 400, "invalid_model"},
		{"non-bool stream", "POST", "/v1/chat/completions", `{"model":"m1","stream":"yes"}`, nil, 400, "invalid_stream"},
		{"no key", "POST", "/v1/chat/completions", chatBody, []string{"Authorization", ""}, 401, "invalid_api_key"},
		{"wrong key", "POST", "/v1/chat/completions", chatBody, []string{"Authorization", "Bearer sk-wrong"}, 401, "invalid_api_key"},
		{"not bearer", "POST", "/v1/chat/completions", chatBody, []string{"Authorization", "Basic " + testKey}, 401, "invalid_api_key"},
		{"models needs key", "GET", "/v1/models", "", []string{"Authorization", ""}, 401, "invalid_api_key"},
		{"unknown model", "POST", "/v1/chat/completions", `{"model":"nope"}`, nil, 404, "model_not_found"},
		{"unknown model object", "GET", "/v1/models/nope", "", nil, 404, "model_not_found"},
		{"unknown path", "GET", "/v2/whatever", "", nil, 404, "unknown_url"},
		{"wrong method", "GET", "/v1/chat/completions", "", nil, 405, "method_not_allowed"},
		{"wrong method models", "POST", "/v1/models", "{}", nil, 405, "method_not_allowed"},
		{"too large", "POST", "/v1/chat/completions", `{"model":"m1","x":"` + strings.Repeat("x", 2000) + `"}`, nil, 413, "request_too_large"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp := tb.do(c.method, c.path, c.body, c.hdr...)
			if resp.StatusCode != c.status {
				t.Errorf("status = %d, want %d", resp.StatusCode, c.status)
			}
			if e := apiError(t, resp); e.Code != c.code {
				t.Errorf("code = %q, want %q", e.Code, c.code)
			}
		})
	}
	// A body over the limit without Content-Length (chunked) is cut too.
	t.Run("too large chunked", func(t *testing.T) {
		req, _ := http.NewRequest("POST", tb.srv.URL+"/v1/chat/completions",
			io.MultiReader(strings.NewReader(`{"model":"m1","x":"`), strings.NewReader(strings.Repeat("y", 4000)+`"}`)))
		req.Header.Set("Authorization", "Bearer "+testKey)
		req.ContentLength = -1
		resp, err := tb.srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 413 {
			t.Errorf("status = %d, want 413", resp.StatusCode)
		}
		apiError(t, resp)
	})
	if n := tb.engines["a"].hits.Load(); n != 0 {
		t.Errorf("engine saw %d requests from rejected ones", n)
	}
}

func TestUnavailableStatuses(t *testing.T) {
	t.Run("all rate limited gives 429 with Retry-After", func(t *testing.T) {
		tb := newTestbed(t, []string{"a", "b"}, nil)
		for _, e := range tb.engines {
			e.set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
				w.Header().Set("Retry-After", "7")
				http.Error(w, `{"error":{"message":"slow down"}}`, http.StatusTooManyRequests)
			})
		}
		resp := tb.do("POST", "/v1/chat/completions", chatBody)
		if resp.StatusCode != 429 {
			t.Fatalf("status = %d, want 429", resp.StatusCode)
		}
		if ra := resp.Header.Get("Retry-After"); ra == "" || ra == "0" {
			t.Errorf("Retry-After = %q", ra)
		}
		if e := apiError(t, resp); e.Type != "rate_limit_error" {
			t.Errorf("type = %q", e.Type)
		}
		// Both breakers are open now: the next request is refused at once.
		resp = tb.do("POST", "/v1/chat/completions", chatBody)
		if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" {
			t.Errorf("second request: %d Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		apiError(t, resp)
	})
	t.Run("every attempt failed gives 502", func(t *testing.T) {
		tb := newTestbed(t, []string{"a", "b", "c", "d"}, nil)
		for _, e := range tb.engines {
			e.set(func(w http.ResponseWriter, r *http.Request, _ []byte) { http.Error(w, "boom", 500) })
		}
		resp := tb.do("POST", "/v1/chat/completions", chatBody)
		if resp.StatusCode != 502 {
			t.Fatalf("status = %d, want 502", resp.StatusCode)
		}
		apiError(t, resp)
		total := int64(0)
		for _, e := range tb.engines {
			total += e.hits.Load()
		}
		if total != DefaultMaxAttempts {
			t.Errorf("engines saw %d attempts, want %d", total, DefaultMaxAttempts)
		}
	})
	t.Run("no healthy agent gives 503", func(t *testing.T) {
		tb := newTestbed(t, []string{"a"}, nil)
		tb.relay.Registry().Updated(tb.peers["a"], transport.JoinInfo{Name: "a", Models: []string{"m1"}, Draining: true})
		resp := tb.do("POST", "/v1/chat/completions", chatBody)
		if resp.StatusCode != 503 {
			t.Fatalf("status = %d, want 503", resp.StatusCode)
		}
		apiError(t, resp)
	})
}

func TestAuth(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	for _, h := range []string{"Bearer " + testKey, "bearer " + testKey, "Bearer sk-other"} {
		resp := tb.do("POST", "/v1/chat/completions", chatBody, "Authorization", h)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%q: status %d", h, resp.StatusCode)
		}
	}
	if _, err := New(Config{NoP2P: true, Transport: tb.ft}); err == nil {
		t.Error("New without keys and without NoAuth succeeded")
	}
	open := newTestbed(t, []string{"a"}, func(c *Config) { c.APIKeys, c.NoAuth = nil, true })
	resp := open.do("POST", "/v1/chat/completions", chatBody, "Authorization", "")
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("NoAuth: status %d", resp.StatusCode)
	}
	if strings.Contains(tb.logs.String(), testKey) {
		t.Error("a client key reached the log")
	}
	if h := tb.engines["a"].lastHeader(); h.Get("Authorization") != "" {
		t.Error("the client's key was forwarded to the agent")
	}
}

func TestForwardsBodyAndHeaders(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	body := `{ "model" : "m1", "messages":[{"role":"user","content":"h\u00e9"}], "extra": {"k": [1,2,3]} }`
	var got []byte
	tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, b []byte) {
		got = b
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Engine", "yes")
		w.Header().Set(HeaderAgent, "spoofed")
		io.WriteString(w, `{"ok":true}`)
	})
	resp := tb.do("POST", "/v1/chat/completions", body, "X-Session-ID", "s1")
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(b) != `{"ok":true}` {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// The original bytes, with the relay's seed first (forward.go).
	if rest, ok := bytes.CutPrefix(got, []byte(`{"seed":`)); !ok || !bytes.HasSuffix(rest, []byte(body[1:])) {
		t.Errorf("engine got %q, want the original bytes %q after a seed", got, body)
	}
	if resp.Header.Get("X-Engine") != "yes" {
		t.Error("engine header not passed through")
	}
	if a := resp.Header.Get(HeaderAgent); a != "a" {
		t.Errorf("%s = %q", HeaderAgent, a)
	}
	if a := resp.Header.Get(HeaderAffinity); a != "miss" {
		t.Errorf("%s = %q, want miss for a new session", HeaderAffinity, a)
	}
	if s := tb.engines["a"].lastHeader().Get(HeaderSession); s != "s1" {
		t.Errorf("engine saw session %q", s)
	}
	for _, p := range []string{"/v1/completions", "/v1/embeddings"} {
		resp := tb.do("POST", p, `{"model":"m1","prompt":"x","input":"x"}`)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get(HeaderAgent) != "a" || resp.Header.Get(HeaderAffinity) != "none" {
			t.Errorf("%s: %d agent %q affinity %q", p, resp.StatusCode, resp.Header.Get(HeaderAgent), resp.Header.Get(HeaderAffinity))
		}
	}
}

func TestSessionStickiness(t *testing.T) {
	tb := newTestbed(t, []string{"a", "b", "c"}, nil)
	var first string
	for i := 0; i < 20; i++ {
		status, agent, body := tb.chat("conversation-1")
		if status != 200 {
			t.Fatalf("request %d: %d %s", i, status, body)
		}
		if i == 0 {
			first = agent
		} else if agent != first {
			t.Fatalf("request %d went to %s, session started on %s", i, agent, first)
		}
	}
	// prompt_cache_key is the session key when there is no header.
	var pck string
	for i := 0; i < 20; i++ {
		resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","prompt_cache_key":"pck-1","user":"u`+string(rune('a'+i))+`"}`)
		resp.Body.Close()
		agent, aff := resp.Header.Get(HeaderAgent), resp.Header.Get(HeaderAffinity)
		if i == 0 {
			pck = agent
			if aff != "miss" {
				t.Errorf("first prompt_cache_key request affinity %q", aff)
			}
		} else if agent != pck || aff != "hit" {
			t.Fatalf("prompt_cache_key request %d: agent %s (first %s) affinity %s", i, agent, pck, aff)
		}
	}
}

func TestSessionsSpread(t *testing.T) {
	tb := newTestbed(t, []string{"a", "b", "c"}, nil)
	seen := map[string]int{}
	for i := 0; i < 30; i++ {
		status, agent, _ := tb.chat("session-" + string(rune('A'+i)))
		if status != 200 {
			t.Fatal(status)
		}
		seen[agent]++
	}
	if len(seen) != 3 {
		t.Errorf("30 sessions landed on %v, want all three agents", seen)
	}
}

func TestRetries(t *testing.T) {
	// avoided: later requests stay away from the failing agent. A dead key
	// (401/403) is excluded only for the rest of its own request, by design
	// of the scheduler: the agent's credentials may be refreshed.
	cases := []struct {
		name    string
		fail    func(tb *testbed)
		avoided bool
	}{
		{"500", func(tb *testbed) {
			tb.engines["bad"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) { http.Error(w, "boom", 500) })
		}, true},
		{"503", func(tb *testbed) {
			tb.engines["bad"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
				http.Error(w, "overloaded", http.StatusServiceUnavailable)
			})
		}, true},
		{"429", func(tb *testbed) {
			tb.engines["bad"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
				http.Error(w, "limited", http.StatusTooManyRequests)
			})
		}, true},
		{"401", func(tb *testbed) {
			tb.engines["bad"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) { http.Error(w, "no", http.StatusUnauthorized) })
		}, false},
		{"transport error", func(tb *testbed) { tb.ft.setDown(tb.peers["bad"], true) }, true},
		{"connection cut before the body", func(tb *testbed) {
			tb.engines["bad"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
				w.Header().Set("Content-Type", "text/event-stream")
				w.WriteHeader(200)
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler)
			})
		}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tb := newTestbed(t, []string{"bad", "good"}, nil)
			c.fail(tb)
			tried := func() int { return tb.ft.attempts(tb.peers["bad"]) }
			// Send new sessions until "bad" has been tried; each request
			// must succeed on "good", trying "bad" at most once.
			for i := 0; i < 20; i++ {
				before := tried()
				status, agent, body := tb.chat(fmt.Sprintf("s-%d", i))
				if status != 200 || agent != "good" {
					t.Fatalf("request %d: %d from %q: %s", i, status, agent, body)
				}
				if d := tried() - before; d > 1 {
					t.Fatalf("failing agent tried %d times in one request", d)
				}
			}
			if tried() == 0 {
				t.Fatal("the failing agent was never tried")
			}
			// After its failures the scheduler avoids it: at most
			// FailureThreshold (5) of the 20 requests were sent its way.
			if n := tried(); c.avoided && n > 5 {
				t.Errorf("failing agent was tried %d times; want it avoided", n)
			}
			if !strings.Contains(metricsText(t, tb), "computeflux_retries_total") {
				t.Error("no retries metric")
			}
		})
	}
}

func TestNoRetryOnClientFault(t *testing.T) {
	tb := newTestbed(t, []string{"a", "b"}, nil)
	const body = `{"error":{"message":"max_tokens too large","type":"invalid_request_error","param":"max_tokens","code":null}}`
	for _, e := range tb.engines {
		e.set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(400)
			io.WriteString(w, body)
		})
	}
	resp := tb.do("POST", "/v1/chat/completions", chatBody)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || string(b) != body {
		t.Errorf("got %d %s, want the agent's 400 unchanged", resp.StatusCode, b)
	}
	if resp.Header.Get(HeaderAgent) == "" {
		t.Error("no agent header on a passed-through error")
	}
	if n := tb.engines["a"].hits.Load() + tb.engines["b"].hits.Load(); n != 1 {
		t.Errorf("engines saw %d requests, want 1 (no retry)", n)
	}
}

func TestStreamFirstEventBeforeEngineFinishes(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	release := make(chan struct{})
	done := make(chan struct{})
	tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
		defer close(done)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"second\"}}]}\n\ndata: [DONE]\n\n")
	})
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","stream":true}`)
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" || resp.Header.Get(HeaderAgent) != "a" {
		t.Fatalf("headers %v", resp.Header)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || !strings.Contains(line, "first") {
		t.Fatalf("first line %q, %v", line, err)
	}
	select {
	case <-done:
		t.Fatal("engine finished before the first event arrived")
	default:
	}
	close(release)
	rest := readEvents(t, br)
	if len(rest) != 2 || !strings.Contains(rest[0], "second") || rest[1] != "[DONE]" {
		t.Errorf("rest of stream %q", rest)
	}
}

func TestMidStreamFailureEndsWithErrorEvent(t *testing.T) {
	for _, partial := range []bool{false, true} {
		tb := newTestbed(t, []string{"a", "b"}, nil)
		for _, e := range tb.engines {
			e.set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n")
				if partial {
					io.WriteString(w, "data: {\"choi")
				}
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler)
			})
		}
		resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","stream":true}`)
		events := readEvents(t, resp.Body)
		resp.Body.Close()
		last := events[len(events)-1]
		var e errorBody
		if err := json.Unmarshal([]byte(last), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
			t.Errorf("partial=%v: last event %q is not an OpenAI error (%v); events %q", partial, last, err, events)
		}
		if n := tb.engines["a"].hits.Load() + tb.engines["b"].hits.Load(); n != 1 {
			t.Errorf("a stream that began was retried (%d attempts)", n)
		}
	}
}

func TestTimeouts(t *testing.T) {
	t.Run("time to first byte, then retry", func(t *testing.T) {
		tb := newTestbed(t, []string{"slow", "fast"}, func(c *Config) { c.TTFBTimeout = 300 * time.Millisecond })
		tb.engines["slow"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) { <-r.Context().Done() })
		for i := 0; i < 4; i++ {
			status, agent, body := tb.chat("ttfb-" + string(rune('a'+i)))
			if status != 200 || agent != "fast" {
				t.Fatalf("%d from %q: %s", status, agent, body)
			}
		}
	})
	t.Run("time to first byte, nothing else", func(t *testing.T) {
		tb := newTestbed(t, []string{"slow"}, func(c *Config) { c.TTFBTimeout = 200 * time.Millisecond })
		tb.engines["slow"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) { <-r.Context().Done() })
		resp := tb.do("POST", "/v1/chat/completions", chatBody)
		if resp.StatusCode != 502 {
			t.Errorf("status %d, want 502", resp.StatusCode)
		}
		apiError(t, resp)
	})
	t.Run("idle gap in a stream", func(t *testing.T) {
		tb := newTestbed(t, []string{"a"}, func(c *Config) { c.IdleTimeout = 200 * time.Millisecond })
		tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, "data: {\"choices\":[]}\n\n")
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		})
		resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","stream":true}`)
		events := readEvents(t, resp.Body)
		resp.Body.Close()
		if len(events) != 2 || !strings.Contains(events[1], "upstream_timeout") {
			t.Errorf("events %q", events)
		}
	})
}

func TestClientDisconnectCancelsAgent(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	cancelled := make(chan struct{})
	tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {}\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		close(cancelled)
	})
	ctx, cancel := context.WithCancel(context.Background())
	resp := tb.doCtx(ctx, "POST", "/v1/chat/completions", `{"model":"m1","stream":true}`)
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	select {
	case <-cancelled:
	case <-time.After(20 * time.Second):
		t.Fatal("the engine's request was not cancelled")
	}
	waitFor(t, "in-flight slot released", func() bool {
		for _, s := range tb.relay.Scheduler().Snapshot() {
			if s.InFlight != 0 {
				return false
			}
		}
		return true
	})
	// Cancelling is not the agent's fault.
	if s := tb.relay.Scheduler().Snapshot()[0]; s.Failures != 0 {
		t.Errorf("client disconnect counted as %d agent failures", s.Failures)
	}
}

func TestModelsAndHealth(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	tb.addAgent("b", []string{"m1", "m2"})
	models := func() []string {
		resp := tb.do("GET", "/v1/models", "")
		defer resp.Body.Close()
		var list struct {
			Object string
			Data   []modelObject
		}
		if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || list.Object != "list" {
			t.Fatalf("models: %v %+v", err, list)
		}
		var ids []string
		for _, m := range list.Data {
			if m.Object != "model" {
				t.Errorf("object %q", m.Object)
			}
			ids = append(ids, m.ID)
		}
		return ids
	}
	if got := strings.Join(models(), ","); got != "m1,m2" {
		t.Errorf("models %s", got)
	}
	resp := tb.do("GET", "/v1/models/m2", "")
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("GET /v1/models/m2: %d", resp.StatusCode)
	}
	tb.relay.Registry().Left(tb.peers["b"])
	if got := strings.Join(models(), ","); got != "m1" {
		t.Errorf("after b left: models %s", got)
	}
	resp = tb.do("GET", "/healthz", "", "Authorization", "")
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"agents_routable":1`) {
		t.Errorf("healthz %d %s", resp.StatusCode, b)
	}
}

func metricsText(t *testing.T, tb *testbed) string {
	t.Helper()
	resp := tb.do("GET", "/metrics", "", "Authorization", "")
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("metrics: %d", resp.StatusCode)
	}
	return string(b)
}

func TestMetricsAndLog(t *testing.T) {
	tb := newTestbed(t, []string{"a", "b", "c"}, nil)
	for i := 0; i < 3; i++ {
		tb.chat("m-session")
	}
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"nope"}`)
	resp.Body.Close()
	text := metricsText(t, tb)
	for _, want := range []string{
		"computeflux_agents_routable 3",
		`computeflux_affinity_total{result="hit"} 2`,
		`computeflux_affinity_total{result="miss"} 1`,
		`computeflux_requests_total{agent="",status="404"} 1`,
		"computeflux_ttfb_seconds_bucket",
		"computeflux_request_duration_seconds_count 4",
		"computeflux_retries_total 0",
		`computeflux_agent_in_flight{agent="a"} 0`,
		`computeflux_agent_breaker_state{agent="a",state="closed"} 1`,
		"computeflux_agent_ewma_latency_seconds",
		"go_goroutines",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if !strings.Contains(text, `computeflux_requests_total{agent="`) {
		t.Error("no per-agent request counts")
	}
	// One log line per request, with the routing facts and no key.
	var lines int
	for _, l := range strings.Split(tb.logs.String(), "\n") {
		if !strings.Contains(l, `"message":"request"`) {
			continue
		}
		lines++
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"agent", "affinity", "attempts", "status", "ttfb", "duration", "session"} {
			if _, ok := m[k]; !ok {
				t.Errorf("log line lacks %s: %s", k, l)
			}
		}
	}
	if lines != 4 {
		t.Errorf("%d request log lines, want 4", lines)
	}
	if strings.Contains(tb.logs.String(), testKey) || strings.Contains(tb.logs.String(), "m-session") {
		t.Error("a key or session ID reached the log")
	}
}

func TestRegistryBindsNames(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	reg := tb.relay.Registry()
	if err := reg.Joined("intruder", transport.JoinInfo{Name: "a", Models: []string{"evil"}}); err == nil {
		t.Fatal("a second peer took a joined name")
	}
	if p, _ := reg.Peer("a"); p != tb.peers["a"] {
		t.Errorf("name a now bound to %s", p)
	}
	if err := reg.Joined("x", transport.JoinInfo{Name: ""}); err == nil {
		t.Error("empty name accepted")
	}
	// Updates from a peer that holds no name, or a rename, are ignored.
	reg.Updated("intruder", transport.JoinInfo{Name: "a", Models: []string{"evil"}})
	reg.Updated(tb.peers["a"], transport.JoinInfo{Name: "z", Models: []string{"evil"}})
	if got := tb.relay.Scheduler().Models(); len(got) != 1 || got[0] != "m1" {
		t.Errorf("models %v after rejected updates", got)
	}
	// The owner's own updates apply, and a rejoin of the owner is fine.
	reg.Updated(tb.peers["a"], transport.JoinInfo{Name: "a", Models: []string{"m1", "m3"}})
	if err := reg.Joined(tb.peers["a"], transport.JoinInfo{Name: "a", Models: []string{"m1", "m3"}}); err != nil {
		t.Errorf("owner rejoin: %v", err)
	}
	if got := tb.relay.Scheduler().Models(); len(got) != 2 {
		t.Errorf("models %v", got)
	}
	// Once the owner leaves, the name is free.
	reg.Left(tb.peers["a"])
	if err := reg.Joined("newcomer", transport.JoinInfo{Name: "a", Models: []string{"m1"}}); err != nil {
		t.Errorf("free name refused: %v", err)
	}
	// Failure detection can take an agent out and put it back.
	reg.SetDead("a", true)
	if got := tb.relay.Scheduler().Models(); len(got) != 0 {
		t.Errorf("dead agent still routable: %v", got)
	}
	reg.SetDead("a", false)
	reg.SetHealth("a", scheduler.Health{Suspect: true})
	if got := reg.Agents(); len(got) != 1 || !got[0].Health.Suspect || got[0].Peer != "newcomer" {
		t.Errorf("agents %+v", got)
	}
}

func TestConfigDefaults(t *testing.T) {
	c := populate(Config{})
	if c.Listen != ":8080" || c.MaxAttempts != 3 || c.TTFBTimeout != 120*time.Second ||
		c.IdleTimeout != 60*time.Second || c.MaxBodyBytes != 32<<20 || len(c.P2PListen) != 2 {
		t.Errorf("defaults %+v", c)
	}
	set := Config{Listen: ":1", MaxAttempts: 5, TTFBTimeout: time.Second, IdleTimeout: 2 * time.Second,
		MaxBodyBytes: 10, ReadHeaderTimeout: 3 * time.Second, MaxHeaderBytes: 11, ShutdownTimeout: 4 * time.Second,
		P2PListen: []string{"/ip4/127.0.0.1/udp/1/quic-v1"}, Policy: scheduler.PolicyRoundRobin}
	c = populate(set)
	if c.Listen != ":1" || c.MaxAttempts != 5 || c.TTFBTimeout != time.Second || c.IdleTimeout != 2*time.Second ||
		c.MaxBodyBytes != 10 || c.ReadHeaderTimeout != 3*time.Second || c.MaxHeaderBytes != 11 ||
		c.ShutdownTimeout != 4*time.Second || len(c.P2PListen) != 1 || c.Scheduler.Policy != scheduler.PolicyRoundRobin {
		t.Errorf("populate changed set fields: %+v", c)
	}
	for name, bad := range map[string]Config{
		"no keys":        {NoP2P: true, Transport: http.DefaultTransport},
		"no token":       {NoAuth: true},
		"no transport":   {NoAuth: true, NoP2P: true},
		"blank key":      {APIKeys: []string{" k"}, NoP2P: true, Transport: http.DefaultTransport},
		"zero attempts?": {NoAuth: true, NoP2P: true, Transport: http.DefaultTransport, MaxAttempts: -1},
	} {
		if err := validate(populate(bad)); err == nil {
			t.Errorf("%s: validate accepted", name)
		}
	}
}

func TestParseAPIKeys(t *testing.T) {
	keys, err := ParseAPIKeys(strings.NewReader("# clients\nsk-1\n\n  sk-2  # laptop\n#sk-3\n"))
	if err != nil || strings.Join(keys, ",") != "sk-1,sk-2" {
		t.Errorf("keys %q, %v", keys, err)
	}
	if _, err := ParseAPIKeys(strings.NewReader("sk 1\n")); err == nil {
		t.Error("key with a space accepted")
	}
}

func TestParseRouting(t *testing.T) {
	cases := []struct {
		body    string
		model   string
		stream  bool
		session string
		ok      bool
	}{
		{`{"model":"m","stream":true,"prompt_cache_key":"k"}`, "m", true, "k", true},
		{` {"model":"m\u00e9","stream":false}`, "mé", false, "", true},
		{`{"model":"m","prompt_cache_key":5,"user":"u"}`, "m", false, "", true},
		{`{"model":"m","stream":null}`, "m", false, "", true},
		{`{"model":""}`, "", false, "", false},
		{`{"model":"m"} x`, "", false, "", false},
		{`{"model":"m","stream":1}`, "", false, "", false},
		{``, "", false, "", false},
		{`null`, "", false, "", false},
	}
	for _, c := range cases {
		rt, err := parseRouting([]byte(c.body))
		if (err == nil) != c.ok || rt.model != c.model || rt.stream != c.stream || rt.session != c.session {
			t.Errorf("%s: %+v %v", c.body, rt, err)
		}
	}
}

func FuzzParseRouting(f *testing.F) {
	for _, s := range []string{chatBody, `{"model":"m","stream":true,"prompt_cache_key":"k"}`, `{"model":7}`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		rt, err := parseRouting(b)
		if err == nil && rt.model == "" {
			t.Fatal("accepted without a model")
		}
		if err != nil && asError(err).Status != 400 {
			t.Fatalf("status %d", asError(err).Status)
		}
	})
}

// TestClientThatStopsReadingCancelsAgent: a client that stops reading a
// stream makes the relay's writes block until its write deadline fires; the
// agent's request is then cancelled, what the engine wrote meanwhile stays
// bounded, the stall is the client's fault, and the relay serves others.
func TestClientThatStopsReadingCancelsAgent(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.IdleTimeout = 300 * time.Millisecond })
	var written atomic.Int64
	cancelled := make(chan struct{})
	tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		if !strings.Contains(string(body), `"stream":true`) {
			defaultEngine(w, r, body, "a")
			return
		}
		defer close(cancelled)
		w.Header().Set("Content-Type", "text/event-stream")
		// Well-formed chunks, so the stream fails only on the client side.
		ev := `data: {"choices":[{"index":0,"delta":{"content":"` + strings.Repeat("x", 960) + `"}}]}` + "\n\n"
		for i := 0; i < 1_000_000 && r.Context().Err() == nil; i++ { // at most ~1 GB
			n, err := io.WriteString(w, ev)
			written.Add(int64(n))
			if err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	})
	conn, err := net.Dial("tcp", tb.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"model":"m1","stream":true}`
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", testKey, len(body), body)
	select {
	case <-cancelled:
	case <-time.After(60 * time.Second):
		t.Fatal("the engine kept streaming to a client that does not read")
	}
	// What the engine got rid of sits in socket buffers (client, relay,
	// engine) and the relay's one copy buffer: bounded, whatever the
	// stream's length.
	w := written.Load()
	t.Logf("engine wrote %.1f MiB before the stalled client's stream was cancelled", float64(w)/(1<<20))
	if w > 64<<20 {
		t.Errorf("engine wrote %d bytes into a stalled client", w)
	}
	waitFor(t, "in-flight slot released", func() bool { return tb.relay.Scheduler().Snapshot()[0].InFlight == 0 })
	// The client stalled, not the agent: no failure is held against it.
	if s := tb.relay.Scheduler().Snapshot()[0]; s.Failures != 0 || s.ClientFaults != 1 {
		t.Errorf("stalled client counted as %d agent failures, %d client faults; want 0, 1", s.Failures, s.ClientFaults)
	}
	servesOthers(t, tb)
}

// TestPopulateKeepsSetFields sets every field of Config to a non-zero value
// by reflection and checks that populate leaves it alone, so a new field
// cannot be silently overwritten by defaulting.
func TestPopulateKeepsSetFields(t *testing.T) {
	var c Config
	v := reflect.ValueOf(&c).Elem()
	for i := 0; i < v.NumField(); i++ {
		f := v.Field(i)
		name := v.Type().Field(i).Name
		if !v.Type().Field(i).IsExported() {
			continue // set by tests only
		}
		switch f.Kind() {
		case reflect.String:
			f.SetString("x-" + name)
		case reflect.Bool:
			f.SetBool(true)
		case reflect.Int, reflect.Int64:
			f.SetInt(int64(1000 + i))
		case reflect.Float64:
			f.SetFloat(float64(1000 + i))
		case reflect.Slice:
			f.Set(reflect.MakeSlice(f.Type(), 1, 1))
		case reflect.Pointer:
			f.Set(reflect.New(f.Type().Elem()))
		case reflect.Interface, reflect.Struct:
			// Host, Transport, Clock, Logger, Scheduler: checked below.
		default:
			t.Fatalf("field %s of kind %s: extend this test", name, f.Kind())
		}
	}
	c.Policy = scheduler.PolicyLeastLoaded
	c.Clock = realClock{}
	c.Transport = http.DefaultTransport
	got := populate(c)
	gv := reflect.ValueOf(got)
	for i := 0; i < v.NumField(); i++ {
		name := v.Type().Field(i).Name
		switch {
		case name == "Scheduler", name == "Logger", name == "Host", !v.Type().Field(i).IsExported():
			continue
		}
		if !reflect.DeepEqual(gv.Field(i).Interface(), v.Field(i).Interface()) {
			t.Errorf("populate changed %s", name)
		}
	}
	if got.Scheduler.Policy != scheduler.PolicyLeastLoaded || got.Scheduler.Clock == nil {
		t.Errorf("scheduler config not derived: %+v", got.Scheduler)
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for in, want := range map[string]time.Duration{
		"":                              0,
		"7":                             7 * time.Second,
		" 12 ":                          12 * time.Second,
		"-3":                            0,
		"soon":                          0,
		"999999":                        time.Hour,
		"Fri, 02 Jan 2026 03:04:35 GMT": 30 * time.Second,
		"Fri, 02 Jan 2026 03:00:00 GMT": 0, // in the past
	} {
		if got := parseRetryAfter(in, now); got != want {
			t.Errorf("%q: %v, want %v", in, got, want)
		}
	}
}

func TestMethodNotAllowedSaysAllow(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	resp := tb.do("GET", "/v1/embeddings", "")
	if resp.StatusCode != 405 || resp.Header.Get("Allow") != "POST" {
		t.Errorf("%d Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
	apiError(t, resp)
}
