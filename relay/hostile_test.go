package relay

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/computeflux/computeflux/scheduler"
)

// Hostile and broken input: each case gets the right status and OpenAI's
// error JSON, and the relay goes on serving other clients afterwards.

// servesOthers fails t unless an ordinary request still succeeds.
func servesOthers(t *testing.T, tb *testbed) {
	t.Helper()
	if st, agent, body := tb.chat(""); st != 200 || agent == "" {
		t.Fatalf("the relay stopped serving others: %d from %q: %s", st, agent, body)
	}
}

func TestHostileRequests(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.MaxBodyBytes = 64 << 10 })
	deep := strings.Repeat("[", 20_000) + strings.Repeat("]", 20_000)
	cases := []struct {
		name, body string
		status     int
		code       string
	}{
		{"malformed json", `{"model":"m1",}`, 400, "invalid_json"},
		{"truncated json", `{"model":"m1","messages":[{"role":"user","content":"hi"`, 400, "invalid_json"},
		{"empty body", ``, 400, "invalid_json"},
		{"binary garbage", "\x00\xff\xfe{\x01", 400, "invalid_json"},
		{"json then garbage", `{"model":"m1"}{"model":"m1"}`, 400, "invalid_json"},
		{"invalid utf-8 in model", "{\"model\":\"m\xff1\"}", 404, "model_not_found"},
		{"nested too deep", `{"model":"m1","x":` + deep + `}`, 400, "invalid_json"},
		{"model as number", `{"model":42,"messages":[]}`, 400, "invalid_model"},
		{"model as object", `{"model":{"id":"m1"}}`, 400, "invalid_model"},
		{"messages not an array", `{"model":"m1","messages":"hi"}`, 400, "invalid_messages"},
		{"messages as object", `{"model":"m1","messages":{"role":"user"}}`, 400, "invalid_messages"},
		{"stream as string", `{"model":"m1","stream":"true"}`, 400, "invalid_stream"},
		{"stream as number", `{"model":"m1","stream":1}`, 400, "invalid_stream"},
		{"missing model", `{"messages":[{"role":"user","content":"hi"}]}`, 400, "missing_model"},
		{"empty model", `{"model":""}`, 400, "missing_model"},
		{"unknown model", `{"model":"gpt-17","messages":[]}`, 404, "model_not_found"},
		{"body over the limit", `{"model":"m1","x":"` + strings.Repeat("x", 70<<10) + `"}`, 413, "request_too_large"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp := tb.do("POST", "/v1/chat/completions", c.body)
			if resp.StatusCode != c.status {
				t.Errorf("status %d, want %d", resp.StatusCode, c.status)
			}
			if e := apiError(t, resp); e.Code != c.code {
				t.Errorf("code %q, want %q", e.Code, c.code)
			}
			servesOthers(t, tb)
		})
	}
	// Only the ordinary requests reached the engine.
	if n := tb.engines["a"].hits.Load(); n != int64(len(cases)) {
		t.Errorf("engine saw %d requests, want %d", n, len(cases))
	}
}

// startServed serves tb's relay through Relay.Serve (the real http.Server
// with its header limits and timeouts) and returns its address.
func startServed(t *testing.T, tb *testbed) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serveRelay(t, tb, ln)
	return ln.Addr().String()
}

func chatVia(t *testing.T, addr string) int {
	t.Helper()
	req, _ := http.NewRequest("POST", "http://"+addr+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set("Authorization", "Bearer "+testKey)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 20 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("ordinary request: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func TestHugeHeaders(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.MaxHeaderBytes = 8 << 10 })
	addr := startServed(t, tb)
	req, _ := http.NewRequest("POST", "http://"+addr+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set("Authorization", "Bearer "+testKey)
	for i := 0; i < 64; i++ {
		req.Header.Set(fmt.Sprintf("X-Junk-%d", i), strings.Repeat("j", 1024))
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 20 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	// net/http answers 431 itself, before any handler runs, with a
	// text/plain body: the status is what clients act on.
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("status %d, want 431", resp.StatusCode)
	}
	if n := tb.engines["a"].hits.Load(); n != 0 {
		t.Errorf("engine saw %d requests", n)
	}
	if st := chatVia(t, addr); st != 200 {
		t.Errorf("ordinary request after huge headers: %d", st)
	}
}

// A client that trickles its request's headers is cut off by the server
// once ReadHeaderTimeout (300 ms here) has passed: net/http may answer 400
// first (the timeout came in the middle of a header line), never more. The
// bound, cutOffWithin, is many times the timeout, for a loaded machine;
// what the test checks is who ends the connection: the server (EOF or a
// reset), not the test's own read deadline, which stands at that bound.
func TestSlowHeadersAreCutOff(t *testing.T) {
	const headerTimeout, cutOffWithin = 300 * time.Millisecond, 5 * time.Second
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.ReadHeaderTimeout = headerTimeout })
	addr := startServed(t, tb)
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Trickle a request's headers a byte at a time, as a slowloris client
	// does, until the server hangs up. Written whole they would take
	// minutes.
	head := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + testKey + "\r\n" +
		strings.Repeat("X-Slow: 1\r\n", 1000)
	type ending struct {
		after time.Duration
		got   string // what the server sent before it hung up
		err   error  // nil: EOF
	}
	closed := make(chan ending, 1)
	start := time.Now()
	go func() {
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; i < len(head); i++ {
			if _, err := conn.Write([]byte{head[i]}); err != nil {
				break
			}
			<-tick.C
		}
	}()
	go func() {
		_ = conn.SetReadDeadline(start.Add(cutOffWithin))
		var got strings.Builder
		_, err := io.Copy(&got, conn) // returns when the server closes, or at the deadline
		closed <- ending{time.Since(start), got.String(), err}
	}()
	// Others are served while the slow client trickles.
	if st := chatVia(t, addr); st != 200 {
		t.Errorf("ordinary request during a slow client: %d", st)
	}
	select {
	case e := <-closed:
		status, _, _ := strings.Cut(e.got, "\r\n")
		t.Logf("slow-header connection ended after %v (ReadHeaderTimeout %v): %q, %v",
			e.after.Round(time.Millisecond), headerTimeout, status, e.err)
		if errors.Is(e.err, os.ErrDeadlineExceeded) {
			t.Errorf("the server did not cut off the slow client within %v", cutOffWithin)
		}
		if strings.HasPrefix(status, "HTTP/1.1 2") {
			t.Errorf("the slow client's request was served: %q", status)
		}
	case <-time.After(cutOffWithin + 10*time.Second):
		t.Fatal("the slow-header connection's read outlived its deadline")
	}
	if n := tb.engines["a"].hits.Load(); n != 1 {
		t.Errorf("engine saw %d requests, want 1", n)
	}
	if st := chatVia(t, addr); st != 200 {
		t.Errorf("ordinary request after the slow client: %d", st)
	}
}

// A client that leaves a stream mid-way has the engine's request
// cancelled at once: the engine, writing an event every 10 ms until its
// request ends, writes at most a few more after the client left (counted,
// not timed; typically one), where a relay that kept reading would let it
// run on for ever.
func TestClientDisconnectMidStreamCancelsUpstream(t *testing.T) {
	const every, maxAfter = 10 * time.Millisecond, 5
	tb := newTestbed(t, []string{"a"}, nil)
	var written atomic.Int64
	sawCancel := make(chan int64, 1)
	tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		if !strings.Contains(string(body), `"stream":true`) {
			defaultEngine(w, r, body, "a")
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; ; i++ {
			if _, err := fmt.Fprintf(w, "data: {\"n\":%d}\n\n", i); err != nil {
				break
			}
			w.(http.Flusher).Flush()
			written.Add(1)
			select {
			case <-r.Context().Done():
			case <-time.After(every):
				continue
			}
			break
		}
		sawCancel <- written.Load()
	})
	ctx, cancel := context.WithCancel(context.Background())
	resp := tb.doCtx(ctx, "POST", "/v1/chat/completions", `{"model":"m1","stream":true}`)
	br := bufio.NewReader(resp.Body)
	for i := 0; i < 3; i++ {
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	atLeave := written.Load()
	cancel()
	resp.Body.Close()
	select {
	case atCancel := <-sawCancel:
		if n := atCancel - atLeave; n > maxAfter {
			t.Errorf("the engine wrote %d events (one every %v) after the client left, want at most %d", n, every, maxAfter)
		} else {
			t.Logf("the engine wrote %d events after the client left (one every %v)", n, every)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the engine's request was not cancelled: %d events written after the client left", written.Load()-atLeave)
	}
	servesOthers(t, tb)
}

func TestGarbageFromEngines(t *testing.T) {
	html := func(w http.ResponseWriter, r *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/html")
		io.WriteString(w, "<html><body>Welcome to nginx!</body></html>")
	}
	t.Run("non-JSON 200 is retried elsewhere", func(t *testing.T) {
		tb := newTestbed(t, []string{"bad", "good"}, nil)
		tb.engines["bad"].set(html)
		for i := 0; i < 6; i++ {
			st, agent, body := tb.chat(fmt.Sprintf("s%d", i))
			if st != 200 || agent != "good" || !json.Valid([]byte(body)) {
				t.Fatalf("request %d: %d from %q: %q", i, st, agent, body)
			}
		}
		if failuresOf(tb, "bad") == 0 {
			t.Error("the scheduler did not count the garbage as the agent's failure")
		}
	})
	t.Run("non-JSON 200 everywhere is a 502", func(t *testing.T) {
		tb := newTestbed(t, []string{"a", "b"}, nil)
		for _, e := range tb.engines {
			e.set(html)
		}
		resp := tb.do("POST", "/v1/chat/completions", chatBody)
		if resp.StatusCode != 502 {
			t.Errorf("status %d, want 502", resp.StatusCode)
		}
		if e := apiError(t, resp); e.Code != "upstream_failed" {
			t.Errorf("code %q", e.Code)
		}
	})
	t.Run("truncated JSON body is retried elsewhere", func(t *testing.T) {
		tb := newTestbed(t, []string{"bad", "good"}, nil)
		tb.engines["bad"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"id":"chatcmpl-1","choices":[{"mess`)
		})
		for i := 0; i < 4; i++ {
			if st, agent, _ := tb.chat(fmt.Sprintf("t%d", i)); st != 200 || agent != "good" {
				t.Fatalf("request %d: %d from %q", i, st, agent)
			}
		}
	})
	t.Run("invalid SSE ends with an error event", func(t *testing.T) {
		for name, stream := range map[string]string{
			"data not json":  "data: {\"choices\":[]}\n\ndata: hello world\n\ndata: [DONE]\n\n",
			"unknown field":  "data: {\"choices\":[]}\n\nerror: {\"code\":500}\n\n",
			"binary":         "data: {\"choices\":[]}\n\n\x00\xff\xfe\n\n",
			"event too long": "data: {\"choices\":[]}\n\ndata: \"" + strings.Repeat("y", maxEventBytes+10),
		} {
			t.Run(name, func(t *testing.T) {
				tb := newTestbed(t, []string{"a"}, nil)
				tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
					w.Header().Set("Content-Type", "text/event-stream")
					io.WriteString(w, stream)
				})
				resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","stream":true}`)
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				datas := checkEvents(t, b, true)
				if len(datas) != 2 || !strings.Contains(datas[1], `"upstream_invalid"`) {
					t.Fatalf("events %q raw %q", datas, b)
				}
				var e errorBody
				if err := json.Unmarshal([]byte(datas[1]), &e); err != nil || e.Error.Type != "server_error" {
					t.Errorf("error event %q: %v", datas[1], err)
				}
				waitFor(t, "failure counted", func() bool { return failuresOf(tb, "a") > 0 })
				servesOthers(t, tb)
			})
		}
	})
}

func TestEngineThatHangsBeforeFirstByte(t *testing.T) {
	tb := newTestbed(t, []string{"hang", "ok"}, func(c *Config) {
		c.TTFBTimeout = 250 * time.Millisecond
		// Round robin in name order: the first request goes to the
		// hanging agent first, whatever the scores.
		c.Policy = scheduler.PolicyRoundRobin
	})
	var hung atomic.Int64
	tb.engines["hang"].set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
		hung.Add(1)
		<-r.Context().Done() // the relay's timeout cancels it
	})
	// Sessions spread over both; the hanging agent's share is retried.
	for i := 0; i < 8; i++ {
		st, agent, body := tb.chat(fmt.Sprintf("h%d", i))
		if st != 200 || agent != "ok" {
			t.Fatalf("request %d: %d from %q: %s", i, st, agent, body)
		}
	}
	if hung.Load() == 0 {
		t.Fatal("no request was routed to the hanging agent first: the test proved nothing")
	}
	if f := failuresOf(tb, "hang"); f == 0 {
		t.Error("time-to-first-byte timeouts were not counted as failures")
	}
	if !strings.Contains(tb.logs.String(), ErrTTFBTimeout.Error()) {
		t.Error("the log does not name the time-to-first-byte timeout")
	}
	// A stream hanging before its first byte is retried the same way.
	resp := tb.do("POST", "/v1/chat/completions", `{"model":"m1","stream":true}`, "X-Session-ID", "h-stream")
	events := readEvents(t, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Errorf("stream: %d %q", resp.StatusCode, events)
	}
}

// failuresOf returns the scheduler's failure count for agent name.
func failuresOf(tb *testbed, name string) int {
	for _, s := range tb.relay.Scheduler().Snapshot() {
		if s.ID == name {
			return int(s.Failures)
		}
	}
	return -1
}

func TestNoAgentsIsUnavailableNotUnknown(t *testing.T) {
	tb := newTestbed(t, nil, nil)
	resp := tb.do("POST", "/v1/chat/completions", chatBody)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("no agents: %d Retry-After %q, want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if e := apiError(t, resp); e.Code != "no_healthy_agent" {
		t.Errorf("code %q", e.Code)
	}
	// Once some agent serves something, a model nobody serves is unknown.
	tb.addAgent("a", []string{"m2"})
	resp = tb.do("POST", "/v1/chat/completions", chatBody)
	if resp.StatusCode != 404 {
		t.Errorf("with an agent for another model: %d, want 404", resp.StatusCode)
	}
	apiError(t, resp)
}
