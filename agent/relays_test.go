package agent

import (
	"net/http"
	"path/filepath"
	"slices"
	"testing"

	"github.com/computeflux/computeflux/relay/relaytest/ports"
)

func getModels(t *testing.T, r *fakeRelay, a *Agent) int {
	t.Helper()
	resp, err := r.client().Get("http://" + a.ID().String() + "/v1/models")
	if err != nil {
		t.Fatalf("GET /v1/models through relay %s: %v", r.h.ID(), err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestAgentServesEveryRelay joins two relays, is served by both, keeps
// serving one while the other is down, and rejoins the one that comes back
// on its own.
func TestAgentServesEveryRelay(t *testing.T) {
	eng := newEngine(t)
	listenA, idA := ports.QUIC(t), filepath.Join(t.TempDir(), "a.key")
	ra := startRelay(t, listenA, idA)
	rb := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	a, _ := runAgent(t, Config{Relays: []string{ra.addr(), rb.addr()}, Upstream: eng.srv.URL})

	joinedBoth := func() bool {
		_, okA := ra.current(a.ID())
		_, okB := rb.current(a.ID())
		return okA && okB
	}
	waitFor(t, "joins at both relays", joinedBoth)
	info, _ := rb.current(a.ID())
	if !slices.Equal(info.Relays, []string{ra.addr(), rb.addr()}) {
		t.Errorf("join info names relays %q", info.Relays)
	}
	for _, r := range []*fakeRelay{ra, rb} {
		if code := getModels(t, r, a); code != http.StatusOK {
			t.Fatalf("relay %s: status %d", r.h.ID(), code)
		}
	}

	// Relay A goes away: B keeps being served; A is rejoined when back.
	ra.close()
	waitFor(t, "agent notices relay A gone", func() bool { return len(a.JoinedRelays()) == 1 })
	if code := getModels(t, rb, a); code != http.StatusOK {
		t.Fatalf("relay B while A is down: status %d", code)
	}
	ra2 := startRelay(t, listenA, idA)
	waitFor(t, "rejoin at relay A", func() bool { _, ok := ra2.current(a.ID()); return ok })
	if code := getModels(t, ra2, a); code != http.StatusOK {
		t.Fatalf("restarted relay A: status %d", code)
	}
	if rb.count("joined") != 1 || rb.count("left") != 0 {
		t.Errorf("relay B saw joined %d, left %d: its registration should have lasted", rb.count("joined"), rb.count("left"))
	}

	// A change reaches both relays.
	eng.setModels("llama-3", "qwen")
	waitFor(t, "model change at both relays", func() bool {
		ia, _ := ra2.current(a.ID())
		ib, _ := rb.current(a.ID())
		return len(ia.Models) == 2 && len(ib.Models) == 2
	})
}

func TestAgentRejectsDuplicateRelays(t *testing.T) {
	const addr = "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A"
	if _, err := New(Config{Relay: addr, Relays: []string{"/ip4/127.0.0.2/udp/4001/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A"},
		Token: "t", Upstream: "http://127.0.0.1:1"}); err == nil {
		t.Error("the same relay peer twice was accepted")
	}
}
