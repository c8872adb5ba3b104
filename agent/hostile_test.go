package agent

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/transport"
)

// Hostile requests reaching an agent from its own relay (a relay may be
// compromised, or relay a hostile client's bytes): the agent is not a
// proxy into the home network and passes nothing but the inference call,
// with its own engine key, to its one engine.

// rawRequest writes raw HTTP bytes on a fresh inference stream to the agent
// and returns the status line of the answer after any informational ones
// ("" if the stream was reset or closed without one).
func rawRequest(t *testing.T, r *fakeRelay, a *Agent, raw string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, err := r.h.NewStream(ctx, a.ID(), transport.InferProtocol)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Reset()
	_ = s.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.WriteString(s, raw); err != nil {
		return ""
	}
	br := bufio.NewReader(s)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return ""
		}
		if !strings.HasPrefix(line, "HTTP/1.1 1") {
			return strings.TrimSpace(line)
		}
		// The acknowledgement (transport.AckStatus) and its empty header
		// block come first: skip to the answer.
		for {
			h, err := br.ReadString('\n')
			if err != nil {
				return ""
			}
			if strings.TrimSpace(h) == "" {
				break
			}
		}
	}
}

func TestAgentRefusesProxyForms(t *testing.T) {
	eng := newEngine(t)
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL, UpstreamAPIKey: "engine-key"})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })

	for _, c := range []struct {
		name, raw string
		want      string // prefix of the status line; "" means anything but a success
	}{
		{"absolute URI to the cloud metadata address",
			"GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n", "HTTP/1.1 404"},
		{"absolute URI on an inference path of another host",
			"POST http://192.168.1.1/v1/chat/completions HTTP/1.1\r\nHost: 192.168.1.1\r\nContent-Length: 2\r\n\r\n{}", "HTTP/1.1 200"},
		{"CONNECT tunnel", "CONNECT 192.168.1.1:22 HTTP/1.1\r\nHost: 192.168.1.1:22\r\n\r\n", "HTTP/1.1 404"},
		{"encoded traversal", "GET /v1/models/..%2f..%2fadmin HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 404"},
		{"dot segments", "GET /v1/../admin HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 404"},
		{"garbage request line", "\x00\x01\x02 / HTTP/9.9\r\n\r\n", "HTTP/1.1 400"},
		{"huge header", "GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("a", 2<<20) + "\r\n\r\n", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := rawRequest(t, relay, a, c.raw)
			if c.want == "" {
				// A 431, or the stream reset while the bytes still flow.
				if strings.HasPrefix(got, "HTTP/1.1 2") {
					t.Errorf("served: %q", got)
				}
				return
			}
			if !strings.HasPrefix(got, c.want) {
				t.Errorf("status line %q, want %q", got, c.want)
			}
		})
	}
	// The absolute-URI inference call went to our engine (path only); no
	// other path ever reached it.
	eng.mu.Lock()
	defer eng.mu.Unlock()
	for _, p := range eng.paths {
		switch p {
		case "/v1/models", "/metrics", "/v1/chat/completions":
		case "/api/version", "/props", "/slots", "/info", "/get_server_info", "/server_info", "/version",
			"/openapi.json", "/api-doc/openapi.json", "/v1/responses", "/v1/messages", noSuchAPI:
			// The agent's own identification of its engine (engine.go).
		default:
			t.Errorf("engine received %q", p)
		}
	}
}

func TestAgentForwardsOnlyItsOwnCredentials(t *testing.T) {
	var got http.Header
	var query string
	eng := newEngine(t)
	inner := eng.srv.Config.Handler
	eng.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/chat/completions" {
			eng.mu.Lock()
			got, query = r.Header.Clone(), r.URL.RawQuery
			eng.mu.Unlock()
		}
		inner.ServeHTTP(w, r)
	})
	relay := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relay: relay.addr(), Upstream: eng.srv.URL, UpstreamAPIKey: "engine-key"})
	waitFor(t, "join", func() bool { _, ok := relay.current(a.ID()); return ok })

	req, _ := http.NewRequest("POST", "http://"+a.ID().String()+"/v1/chat/completions?target=http://10.0.0.1/&key=x", strings.NewReader(`{}`))
	req.Header.Set("Authorization", "Bearer client-key-must-not-pass")
	req.Header.Set("Proxy-Authorization", "Basic c2VjcmV0")
	req.Header.Set("Connection", "X-Hop")
	req.Header.Set("X-Hop", "hop-by-hop")
	resp, err := relay.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	eng.mu.Lock()
	defer eng.mu.Unlock()
	if a := got.Get("Authorization"); a != "Bearer engine-key" {
		t.Errorf("engine saw Authorization %q", a)
	}
	for _, h := range []string{"Proxy-Authorization", "X-Hop"} {
		if v := got.Get(h); v != "" {
			t.Errorf("engine saw %s: %q", h, v)
		}
	}
	if query != "" {
		t.Errorf("engine saw query %q", query)
	}
}
