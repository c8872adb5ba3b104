package transport

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// idleStreams returns how many idle streams t pools for key, and how many
// keys it pools streams for.
func idleStreams(t *streamTransport, key string) (int, int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.idle[key]), len(t.idle)
}

func post(t *testing.T, rt http.RoundTripper, url string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
	resp, err := rt.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

// A peer's pooled idle streams go when its connection closes, not when
// the peer is asked again (it may never be: an agent that left).
func TestIdleStreamsDropWithTheirConnection(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }), cli.ID())
	rt := newStreamTransport(cli)
	post(t, rt, "http://"+srv.ID().String()+"/v1/x")
	if n, _ := idleStreams(rt, string(srv.ID())); n != 1 {
		t.Fatalf("%d idle streams after a request, want 1", n)
	}
	if _, ok := rt.valid.Load(srv.ID().String()); !ok {
		t.Fatal("the peer's URL host was not cached")
	}
	if err := cli.Network().ClosePeer(srv.ID()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the idle stream dropped", func() bool { n, keys := idleStreams(rt, string(srv.ID())); return n == 0 && keys == 0 })
	if _, ok := rt.valid.Load(srv.ID().String()); ok {
		t.Fatal("the departed peer's URL host is still cached")
	}
}

// Expired idle streams of a peer that is never asked again are swept when
// another peer's stream goes back to the pool.
func TestExpiredIdleStreamsAreSwept(t *testing.T) {
	a, b, cli := newTestHost(t), newTestHost(t), newTestHost(t)
	connect(t, cli, a)
	connect(t, cli, b)
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	serve(t, a, ok, cli.ID())
	serve(t, b, ok, cli.ID())
	rt := newStreamTransport(cli)
	rt.idleTime = 200 * time.Millisecond
	post(t, rt, "http://"+a.ID().String()+"/v1/x")
	if n, _ := idleStreams(rt, string(a.ID())); n != 1 {
		t.Fatalf("%d idle streams to a, want 1", n)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		post(t, rt, "http://"+b.ID().String()+"/v1/x")
		if n, _ := idleStreams(rt, string(a.ID())); n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a's expired idle stream was never swept")
		}
		time.Sleep(50 * time.Millisecond) // a pace between requests; the loop checks the condition
	}
}
