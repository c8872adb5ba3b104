package relay

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/transport"
)

// scrape returns the relay's /metrics text.
func scrape(t *testing.T, r *Relay) string {
	t.Helper()
	rec := httptest.NewRecorder()
	r.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	b, _ := io.ReadAll(rec.Body)
	return string(b)
}

// TestPanicsCounted: a panic the relay's API server recovers shows in
// computeflux_panics_total{component="http"} (a real net/http server with
// the relay's ErrorLog), the admin server's series stays 0, and agents'
// panics published in gossip show by agent.
func TestPanicsCounted(t *testing.T) {
	r := gossipTestRelay(t)
	if m := scrape(t, r); !strings.Contains(m, `computeflux_panics_total{component="http"} 0`) ||
		!strings.Contains(m, `computeflux_panics_total{component="admin-http"} 0`) {
		t.Fatalf("the panic series are not there from the start:\n%s", grep(m, "panics"))
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }))
	srv.Config.ErrorLog = r.serverLog("http")
	srv.Start()
	defer srv.Close()
	for range 2 {
		if resp, err := srv.Client().Get(srv.URL); err == nil {
			resp.Body.Close()
			t.Fatal("a panicking handler answered")
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		m := scrape(t, r)
		if strings.Contains(m, `computeflux_panics_total{component="http"} 2`) {
			if !strings.Contains(m, `computeflux_panics_total{component="admin-http"} 0`) {
				t.Fatalf("counted on the wrong server:\n%s", grep(m, "panics"))
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("two panics, counted:\n%s", grep(m, "panics"))
		}
		time.Sleep(10 * time.Millisecond)
	}

	m := agentMeta("a", "m1")
	m.Panics = 3
	r.reg.gossipEvent(transport.GossipEvent{Type: transport.GossipAlive, Peer: peer.ID("peer-a"), Meta: m, At: time.Now()})
	r.reg.gossipEvent(transport.GossipEvent{Type: transport.GossipAlive, Peer: peer.ID("peer-b"), Meta: agentMeta("b", "m1"), At: time.Now()})
	if got := r.reg.agentPanics(); len(got) != 2 || got["a"] != 3 || got["b"] != 0 {
		t.Fatalf("agents' panics %v, want a: 3, b: 0", got)
	}
}

// grep returns the lines of s that contain sub.
func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
