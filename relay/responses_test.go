package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/computeflux/computeflux/transport"
)

// responsesEngine answers the Responses API like an engine that stores its
// responses: ids name the engine; GET and DELETE know only its own.
func responsesEngine(e *engine, n *atomic.Int64) {
	e.set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/v1/responses":
			id := fmt.Sprintf("resp_%s_%d", e.name, n.Add(1))
			if strings.Contains(string(body), `"stream":true`) {
				w.Header().Set("Content-Type", "text/event-stream")
				fmt.Fprintf(w, "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":%q,\"object\":\"response\",\"status\":\"in_progress\"}}\n\n", id)
				fmt.Fprintf(w, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"delta\":\"hi\"}\n\n")
				if strings.Contains(string(body), "cut") {
					w.(http.Flusher).Flush()
					panic(http.ErrAbortHandler) // the engine dies mid-stream
				}
				fmt.Fprintf(w, "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":2,\"response\":{\"id\":%q,\"object\":\"response\",\"status\":\"completed\"}}\n\n", id)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":%q,"object":"response","status":"completed","output":[],"agent":%q}`, id, e.name)
		case strings.HasPrefix(r.URL.Path, "/v1/responses/resp_"+e.name+"_"):
			w.Header().Set("Content-Type", "application/json")
			id := strings.TrimPrefix(r.URL.Path, "/v1/responses/")
			if r.Method == http.MethodDelete {
				fmt.Fprintf(w, `{"id":%q,"object":"response","deleted":true}`, id)
				return
			}
			fmt.Fprintf(w, `{"id":%q,"object":"response","status":"completed","agent":%q}`, id, e.name)
		case r.URL.Path == "/v1/messages":
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"from %s"}]}`, e.name)
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	})
}

func responseID(t *testing.T, resp *http.Response) (string, string) {
	t.Helper()
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	var v struct{ ID string }
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return v.ID, resp.Header.Get(HeaderAgent)
}

// wantNotFound checks OpenAI's 404 for an unknown response.
func wantNotFound(t *testing.T, resp *http.Response, param string) {
	t.Helper()
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var v struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    *string `json:"code"`
		} `json:"error"`
	}
	if resp.StatusCode != http.StatusNotFound || json.Unmarshal(b, &v) != nil || v.Error.Type != "invalid_request_error" || !strings.Contains(v.Error.Message, "not found") {
		t.Fatalf("want OpenAI's 404, got %d %s", resp.StatusCode, b)
	}
	if param == "" {
		if v.Error.Param != nil || v.Error.Code != nil {
			t.Fatalf("param and code should be null: %s", b)
		}
		return
	}
	if v.Error.Param == nil || *v.Error.Param != param || v.Error.Code == nil || *v.Error.Code != "previous_response_not_found" {
		t.Fatalf("want param %s and code previous_response_not_found: %s", param, b)
	}
}

func TestResponsesHardAffinity(t *testing.T) {
	apis := []string{pathResponses}
	tb := newTestbed(t, nil, nil)
	var n atomic.Int64
	for _, name := range []string{"a", "b", "c"} {
		responsesEngine(tb.addAgent(name, []string{"m1"}), &n)
		if err := tb.relay.Registry().Joined(tb.peers[name], transport.JoinInfo{Name: name, Models: []string{"m1"}, APIs: apis}); err != nil {
			t.Fatal(err)
		}
	}
	// d serves m1 but not the Responses API: never picked for it.
	responsesEngine(tb.addAgent("d", []string{"m1"}), &n)

	wantNotFound(t, tb.do("POST", "/v1/responses", `{"model":"m1","input":"hi","previous_response_id":"resp_nobody"}`), "previous_response_id")
	wantNotFound(t, tb.do("GET", "/v1/responses/resp_nobody", ""), "")

	first := map[string]string{}
	for i := 0; i < 12; i++ {
		id, agent := responseID(t, tb.do("POST", "/v1/responses", fmt.Sprintf(`{"model":"m1","input":"hi %d"}`, i)))
		if agent == "d" {
			t.Fatalf("agent d does not list /v1/responses but served it")
		}
		first[id] = agent
	}
	if tb.engines["d"].hits.Load() != 0 {
		t.Fatalf("d got %d requests", tb.engines["d"].hits.Load())
	}
	for id, agent := range first {
		// Follow-ups, whatever session key they carry, go where the
		// response lives, turn after turn.
		prev := id
		for turn := 0; turn < 3; turn++ {
			next, got := responseID(t, tb.do("POST", "/v1/responses",
				fmt.Sprintf(`{"model":"m1","input":"more","previous_response_id":%q,"prompt_cache_key":"k%d"}`, prev, turn)))
			if got != agent {
				t.Fatalf("follow-up of %s (on %s) went to %s", prev, agent, got)
			}
			prev = next
		}
		// Streamed follow-up: the id in response.created is remembered
		// and the event names pass through.
		resp := tb.do("POST", "/v1/responses", fmt.Sprintf(`{"model":"m1","input":"x","stream":true,"previous_response_id":%q}`, prev))
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.Header.Get(HeaderAgent) != agent || !strings.Contains(string(b), "event: response.created\n") || !strings.Contains(string(b), "event: response.completed\n") {
			t.Fatalf("stream: agent %s, body %s", resp.Header.Get(HeaderAgent), b)
		}
		var streamedID string
		for _, l := range strings.Split(string(b), "\n") {
			if d, ok := strings.CutPrefix(l, "data: "); ok && strings.Contains(d, "response.created") {
				var ev struct{ Response struct{ ID string } }
				_ = json.Unmarshal([]byte(d), &ev)
				streamedID = ev.Response.ID
			}
		}
		if _, got := responseID(t, tb.do("POST", "/v1/responses", fmt.Sprintf(`{"model":"m1","input":"x","previous_response_id":%q}`, streamedID))); got != agent {
			t.Fatalf("follow-up of streamed %s went to %s, want %s", streamedID, got, agent)
		}
		// GET and DELETE reach the holder; after DELETE the id is gone.
		resp = tb.do("GET", "/v1/responses/"+id, "")
		b, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"agent":"`+agent+`"`) {
			t.Fatalf("GET %s: %d %s", id, resp.StatusCode, b)
		}
		resp = tb.do("DELETE", "/v1/responses/"+id, "")
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("DELETE: %d", resp.StatusCode)
		}
		wantNotFound(t, tb.do("GET", "/v1/responses/"+id, ""), "")
		wantNotFound(t, tb.do("POST", "/v1/responses", fmt.Sprintf(`{"model":"m1","input":"x","previous_response_id":%q}`, id)), "previous_response_id")
		resp = tb.do("PUT", "/v1/responses/"+id, "")
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Fatalf("PUT: %d", resp.StatusCode)
		}
		break
	}

	// The holder leaves: its responses are unknown, not served elsewhere.
	var id, holder string
	for id, holder = range first {
		break
	}
	before := map[string]int64{}
	for name, e := range tb.engines {
		before[name] = e.hits.Load()
	}
	tb.relay.Registry().Left(tb.peers[holder])
	wantNotFound(t, tb.do("POST", "/v1/responses", fmt.Sprintf(`{"model":"m1","input":"x","previous_response_id":%q}`, id)), "previous_response_id")
	for name, e := range tb.engines {
		if e.hits.Load() != before[name] {
			t.Fatalf("engine %s was asked about a response it does not hold", name)
		}
	}
	// A store:false response is not remembered.
	rid, _ := responseID(t, tb.do("POST", "/v1/responses", `{"model":"m1","input":"x","store":false}`))
	wantNotFound(t, tb.do("GET", "/v1/responses/"+rid, ""), "")
}

func TestResponsesStreamCutEndsWithErrorEvent(t *testing.T) {
	tb := newTestbed(t, nil, nil)
	var n atomic.Int64
	responsesEngine(tb.addAgent("a", []string{"m1"}), &n)
	if err := tb.relay.Registry().Joined(tb.peers["a"], transport.JoinInfo{Name: "a", Models: []string{"m1"}, APIs: []string{pathResponses}}); err != nil {
		t.Fatal(err)
	}
	resp := tb.do("POST", "/v1/responses", `{"model":"m1","input":"cut","stream":true}`)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	events := strings.Split(strings.TrimSpace(string(b)), "\n\n")
	last := events[len(events)-1]
	data, ok := strings.CutPrefix(last, "event: error\ndata: ")
	if !ok {
		t.Fatalf("stream did not end with the Responses API's error event:\n%s", b)
	}
	var ev struct {
		Type, Code, Message string
	}
	if err := json.Unmarshal([]byte(data), &ev); err != nil || ev.Type != "error" || ev.Code != "upstream_failed" || ev.Message == "" {
		t.Fatalf("error event %q: %v", data, err)
	}
	if !strings.HasPrefix(events[0], "event: response.created\n") {
		t.Fatalf("first event %q", events[0])
	}
}

// TestMessagesRoutedToEnginesThatServeThem: a Messages request goes as it
// is to an agent whose engine lists /v1/messages, and as the chat request
// it means to any other, its answer translated; errors on the route are in
// Anthropic's shape.
func TestMessagesRoutedToEnginesThatServeThem(t *testing.T) {
	tb := newTestbed(t, []string{"a", "b"}, nil)
	body := `{"model":"m1","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`
	var n atomic.Int64
	responsesEngine(tb.engines["b"], &n)
	if err := tb.relay.Registry().Joined(tb.peers["b"], transport.JoinInfo{Name: "b", Models: []string{"m1"}, APIs: []string{pathMessages}}); err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for i := 0; i < 16; i++ {
		resp := tb.do("POST", "/v1/messages", body, "X-Session-ID", fmt.Sprint("s", i))
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		agent := resp.Header.Get(HeaderAgent)
		var m struct {
			Type    string
			Content []struct{ Type, Text string }
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &m) != nil || m.Type != "message" || len(m.Content) != 1 {
			t.Fatalf("%d from %s: %s", resp.StatusCode, agent, b)
		}
		switch agent {
		case "b": // its engine's own answer
			if m.Content[0].Text != "from b" {
				t.Fatalf("b's engine serves /v1/messages, the answer is not its own: %s", b)
			}
		case "a": // the chat answer, translated
			if !strings.Contains(m.Content[0].Text, "hello from a") {
				t.Fatalf("a translated: %s", b)
			}
		}
		seen[agent]++
	}
	if seen["a"] == 0 || seen["b"] == 0 {
		t.Fatalf("answers by agent %v: both should serve", seen)
	}
	resp := tb.do("GET", "/v1/messages", "")
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || !strings.Contains(string(b), `"type":"error"`) || !strings.Contains(string(b), `"invalid_request_error"`) {
		t.Fatalf("GET /v1/messages: %d %s", resp.StatusCode, b)
	}
}

// FuzzScanResponseID: the id scanner never panics and returns only ids it
// bounds, on any prefix of any body.
func FuzzScanResponseID(f *testing.F) {
	f.Add([]byte(`{"id":"resp_1","object":"response"}`), false)
	f.Add([]byte("event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_2\"}}\n\n"), true)
	f.Add([]byte(`{"object":"response","output":[{"id":"x"}],"id":"resp_3"}`), false)
	f.Fuzz(func(t *testing.T, b []byte, sse bool) {
		for _, n := range []int{len(b), len(b) / 2} {
			if id, ok := scanResponseID(b[:n], sse); ok && !validResponseID(id) {
				t.Fatalf("id %q", id)
			}
		}
	})
}

func TestStoredResponseClientNotReadingIsCut(t *testing.T) {
	tb := newTestbed(t, nil, func(c *Config) { c.IdleTimeout = 200 * time.Millisecond })
	var n atomic.Int64
	e := tb.addAgent("a", []string{"m1"})
	if err := tb.relay.Registry().Joined(tb.peers["a"], transport.JoinInfo{Name: "a", Models: []string{"m1"}, APIs: []string{pathResponses}}); err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	e.set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.Method == http.MethodPost {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"resp_a_%d","object":"response","status":"completed"}`, n.Add(1))
			return
		}
		// A stored response far larger than every buffer between the
		// engine and a client that does not read (at most 256 MiB).
		w.Header().Set("Content-Type", "application/json")
		chunk := bytes.Repeat([]byte("x"), 64<<10)
		for i := 0; i < 4096; i++ {
			if _, err := w.Write(chunk); err != nil {
				ended <- err
				return
			}
		}
		ended <- nil
	})
	id, _ := responseID(t, tb.do("POST", "/v1/responses", `{"model":"m1","input":"hi"}`))

	c, err := net.Dial("tcp", tb.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /v1/responses/%s HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer %s\r\n\r\n", id, testKey)
	// The client reads nothing: the relay's write times out after the
	// idle timeout and the upstream answer is dropped, which the engine
	// sees as a failed write.
	select {
	case err := <-ended:
		if err == nil {
			t.Fatal("the engine wrote 256 MiB to a client that reads nothing")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the relay still holds the stored response for a client that stopped reading")
	}
}

// Requests about a stored response take the request path every request
// takes: the per-key limits count them, the request metrics and log line
// record them, and the first-byte watchdog bounds their wait.
func TestStoredResponsesTakeTheRequestPath(t *testing.T) {
	tb := newTestbed(t, nil, func(c *Config) {
		c.KeyRPM = 3
		c.TTFBTimeout = 300 * time.Millisecond
	})
	var n atomic.Int64
	var stall atomic.Bool
	e := tb.addAgent("a", []string{"m1"})
	if err := tb.relay.Registry().Joined(tb.peers["a"], transport.JoinInfo{Name: "a", Models: []string{"m1"}, APIs: []string{pathResponses}}); err != nil {
		t.Fatal(err)
	}
	e.set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		if r.Method == http.MethodPost {
			fmt.Fprintf(w, `{"id":"resp_a_%d","object":"response","status":"completed"}`, n.Add(1))
			return
		}
		if stall.Load() {
			select { // no byte before the relay's first-byte bound
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
			return
		}
		fmt.Fprintf(w, `{"id":%q,"object":"response","status":"completed"}`, strings.TrimPrefix(r.URL.Path, "/v1/responses/"))
	})
	id, _ := responseID(t, tb.do("POST", "/v1/responses", `{"model":"m1","input":"hi"}`)) // 1 of the key's 3 a minute
	before := metricValue(t, tb, `computeflux_requests_total{agent="a",status="200"}`)
	resp := tb.do("GET", "/v1/responses/"+id, "") // 2 of 3
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET: %d", resp.StatusCode)
	}
	if got := metricValue(t, tb, `computeflux_requests_total{agent="a",status="200"}`); got != before+1 {
		t.Fatalf("requests_total{a,200} went from %v to %v over a stored GET, want +1", before, got)
	}

	stall.Store(true)
	start := time.Now()
	resp = tb.do("GET", "/v1/responses/"+id, "") // 3 of 3
	resp.Body.Close()
	if took := time.Since(start); resp.StatusCode != http.StatusBadGateway || took > 5*time.Second {
		t.Fatalf("GET of a stalled agent: %d after %v, want 502 at the first-byte bound", resp.StatusCode, took)
	}
	stall.Store(false)
	if e := apiError(t, tb.do("GET", "/v1/responses/"+id, "")); e.Code != "rate_limit_exceeded" {
		t.Fatalf("a fourth request in the minute: %+v, want the key's rate limit", e)
	}
	if !strings.Contains(tb.logs.String(), `"method":"GET","path":"/v1/responses/{id}"`) {
		t.Fatalf("no request line for the stored GET in the log:\n%s", tb.logs.String())
	}
}

// metricValue reads one series of the relay's /metrics (0 when absent).
func metricValue(t *testing.T, tb *testbed, series string) float64 {
	t.Helper()
	resp := tb.do("GET", "/metrics", "")
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, series+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
	}
	return 0
}
