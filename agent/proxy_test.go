package agent

import (
	"bufio"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/textproto"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/transport"
)

// newForwardingAgent returns an agent for engine (its path prefix base
// included) and an HTTP server running its handler.
func newForwardingAgent(t *testing.T, engine, key string) (*Agent, *httptest.Server) {
	t.Helper()
	a, err := New(Config{
		Relay: "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWDkftGHFMSNsFYC5NV8WDxAcwH1EWPBBSUhuk5FzmHpdu",
		Token: "t", Upstream: engine, Name: "a", UpstreamAPIKey: key,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(a)
	t.Cleanup(func() {
		srv.Close()
		if c, ok := a.cfg.UpstreamTransport.(interface{ CloseIdleConnections() }); ok {
			c.CloseIdleConnections()
		}
	})
	return a, srv
}

// TestForwardHeadersAndStatus: hop-by-hop and forwarding headers do not
// cross in either direction, the engine's path prefix is kept, its status
// and Retry-After reach the client.
func TestForwardHeadersAndStatus(t *testing.T) {
	type seen struct {
		path string
		h    http.Header
	}
	got := make(chan seen, 1)
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- seen{r.URL.Path, r.Header.Clone()}
		w.Header().Set("Connection", "X-Engine-Hop")
		w.Header().Set("X-Engine-Hop", "1")
		w.Header().Set("Keep-Alive", "timeout=5")
		w.Header().Set("Retry-After", "7")
		w.Header().Set("X-Engine", "kept")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		io.WriteString(w, `{"error":{"message":"busy"}}`)
	}))
	defer eng.Close()
	_, srv := newForwardingAgent(t, eng.URL+"/base/", "engine-key")

	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/embeddings?x=1", strings.NewReader(`{"model":"m","input":"x"}`))
	for k, v := range map[string]string{
		"Authorization": "Bearer client", "Proxy-Authorization": "Basic x", "Connection": "X-Hop",
		"X-Hop": "1", "Upgrade": "websocket", "X-Forwarded-For": "10.1.2.3", "Forwarded": "for=10.1.2.3",
		"Te": "trailers", "X-Client": "kept",
	} {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	s := <-got
	if s.path != "/base/v1/embeddings" {
		t.Errorf("engine path %q", s.path)
	}
	if v := s.h.Get("Authorization"); v != "Bearer engine-key" {
		t.Errorf("engine saw Authorization %q", v)
	}
	for _, k := range []string{"Proxy-Authorization", "X-Hop", "Upgrade", "X-Forwarded-For", "Forwarded"} {
		if v := s.h.Get(k); v != "" {
			t.Errorf("engine saw %s: %q", k, v)
		}
	}
	if s.h.Get("X-Client") != "kept" || s.h.Get("Te") != "trailers" {
		t.Errorf("engine lost end-to-end headers: %v", s.h)
	}
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "7" || string(body) != `{"error":{"message":"busy"}}` {
		t.Errorf("client got %d Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if resp.Header.Get("X-Engine") != "kept" || resp.Header.Get("X-Engine-Hop") != "" || resp.Header.Get("Keep-Alive") != "" {
		t.Errorf("client headers %v", resp.Header)
	}
}

// TestForwardEngineDown: an engine that cannot be reached is a 502 in
// OpenAI's error shape.
func TestForwardEngineDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	_, srv := newForwardingAgent(t, "http://"+addr, "")
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var e struct {
		Error struct{ Code string } `json:"error"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil || resp.StatusCode != http.StatusBadGateway || e.Error.Code != "engine_unreachable" {
		t.Fatalf("status %d, code %q, %v", resp.StatusCode, e.Error.Code, err)
	}
}

// TestForwardFlushesEvents: each server-sent event reaches the client
// before the engine writes the next (the engine waits for it).
func TestForwardFlushesEvents(t *testing.T) {
	next := make(chan struct{})
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n")
			w.(http.Flusher).Flush()
			if i < 2 {
				select {
				case <-next:
				case <-time.After(10 * time.Second):
					return
				}
			}
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer eng.Close()
	_, srv := newForwardingAgent(t, eng.URL, "")
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := br.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "data: {") {
			t.Fatalf("event %d: %q, %v", i, line, err)
		}
		br.ReadString('\n') // the blank line
		if i < 2 {
			next <- struct{}{}
		}
	}
	if rest, _ := io.ReadAll(br); string(rest) != "data: [DONE]\n\n" {
		t.Fatalf("stream ended with %q", rest)
	}
}

// TestForwardAbortsCutAnswer: an answer the engine cuts short is cut short
// for the client too, not ended as if complete.
func TestForwardAbortsCutAnswer(t *testing.T) {
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {}\n\n")
		w.(http.Flusher).Flush()
		c, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			c.Close() // no last chunk
		}
	}))
	defer eng.Close()
	_, srv := newForwardingAgent(t, eng.URL, "")
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil {
		t.Fatalf("the cut answer ended cleanly: %q", b)
	}
}

// outHeaderCopy is outHeader as it was when it built a new map: the
// reference the in-place version keeps to.
func outHeaderCopy(authValue []string, in http.Header) http.Header {
	h := make(http.Header, len(in)+1)
	for k, vv := range in {
		switch {
		case transport.HopHeader(k), k == "Authorization", k == "Forwarded",
			k == "X-Forwarded-For", k == "X-Forwarded-Host", k == "X-Forwarded-Proto",
			k == "Content-Length":
			continue
		}
		h[k] = vv
	}
	for _, f := range in["Connection"] {
		for sf := range strings.SplitSeq(f, ",") {
			if sf = textproto.TrimString(sf); sf != "" {
				h.Del(sf)
			}
		}
	}
	for _, v := range in["Te"] {
		if strings.EqualFold(textproto.TrimString(v), "trailers") {
			h["Te"] = teTrailers
			break
		}
	}
	if authValue != nil {
		h["Authorization"] = authValue
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = emptyUserAgent
	}
	return h
}

// TestOutHeaderInPlace: the header outHeader makes in place of the relay's
// is the one a fresh map got, for random mixes of hop-by-hop, forwarding,
// credential and end-to-end fields, Connection naming some of them.
func TestOutHeaderInPlace(t *testing.T) {
	names := []string{"Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
		"Proxy-Authorization", "Authorization", "Forwarded", "X-Forwarded-For", "X-Forwarded-Proto",
		"Content-Length", "Content-Type", "User-Agent", "X-Client", "X-Hop", "Accept"}
	values := []string{"trailers", "x-hop, X-Client", "Te", "1", " Trailers ", "keep-alive, user-agent", "Authorization"}
	rnd := rand.New(rand.NewPCG(1, 2))
	for _, key := range [][]string{nil, {"Bearer engine"}} {
		a := &Agent{authValue: key}
		for i := 0; i < 2000; i++ {
			in := http.Header{}
			for n := rnd.IntN(8); n > 0; n-- {
				k := names[rnd.IntN(len(names))]
				in[k] = append(in[k], values[rnd.IntN(len(values))])
			}
			want := outHeaderCopy(key, in.Clone())
			if got := a.outHeader(in.Clone()); !reflect.DeepEqual(got, want) {
				t.Fatalf("header %v:\nin place %v\nfresh    %v", in, got, want)
			}
		}
	}
}

// TestUpstreamURLs: every path the agent forwards, from its table or not,
// goes to the engine's path prefix without the configured URL's query.
func TestUpstreamURLs(t *testing.T) {
	a, _ := newForwardingAgent(t, "http://127.0.0.1:1/base/?k=v", "")
	paths := []string{"/v1/responses/resp_1/input_items"} // not in the table
	for p := range servedPaths {
		paths = append(paths, p)
	}
	paths = append(paths, optionalAPIs...)
	for _, p := range paths {
		if got, want := a.upstreamURL(p).String(), "http://127.0.0.1:1/base"+p; got != want {
			t.Errorf("%s goes to %s, want %s", p, got, want)
		}
	}
}
