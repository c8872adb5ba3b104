package relay_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
)

// One routing table through the real parts: two package-agent agents over
// QUIC in tier 0 and a TLS provider that checks its key in tier 1. Home
// serves while it can; disabled, the provider takes over without a failed
// request; enabled, new sessions come home. The table shows the agents'
// path and RTT.
func TestTableAgentsAndProvider(t *testing.T) {
	var provHits atomic.Int64
	prov := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer sk-provider-key" {
			http.Error(w, `{"error":{"message":"bad key","type":"auth","code":"invalid_api_key"}}`, http.StatusUnauthorized)
			return
		}
		provHits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"from the cloud"},"finish_reason":"stop"}]}`)
	}))
	defer prov.Close()
	tr := prov.Client().Transport.(*http.Transport).Clone()
	defer tr.CloseIdleConnections()
	ef := filepath.Join(t.TempDir(), "endpoints.yaml")
	if err := os.WriteFile(ef, []byte(fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s/v1, keys: [sk-provider-key], models: [m1]}\n", prov.URL)), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &syncWriter{w: &strings.Builder{}}
	rl := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Token: []byte(itToken), APIKeys: []string{itKey},
		EndpointsFile: ef, ProviderTransport: tr, Logger: zerolog.New(logs),
	})
	for _, n := range []string{"gpu1", "gpu2"} {
		relaytest.RunAgent(t, relaytest.AgentConfig(n, itToken, relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: n}).URL(), rl.Addr()))
	}
	waitAgents(t, rl, "gpu1", "gpu2")
	// Idle agents, no request yet: the liveness probe measures the RTT.
	waitFor(t, "the agents' RTT", func() bool {
		for _, row := range rl.Relay.Table() {
			if row.Kind == "agent" && (row.Path != "direct" || row.RTTMillis <= 0) {
				return false
			}
		}
		return true
	})
	c := newClient(t, rl.URL)
	for i := range 10 {
		if code, agent := c.chat("m1", fmt.Sprintf("s%d", i)); code != http.StatusOK || !strings.HasPrefix(agent, "gpu") {
			t.Fatalf("home up: %d from %s", code, agent)
		}
	}
	if provHits.Load() != 0 {
		t.Fatalf("the provider got %d requests while home had room", provHits.Load())
	}
	for _, n := range []string{"gpu1", "gpu2"} {
		if err := rl.Relay.SetAdmin(n, "disable", 0); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 5 {
		if code, agent := c.chat("m1", fmt.Sprintf("s%d", i)); code != http.StatusOK || agent != "cloud" {
			t.Fatalf("home disabled: %d from %s", code, agent)
		}
	}
	for _, n := range []string{"gpu1", "gpu2"} {
		if err := rl.Relay.SetAdmin(n, "enable", 0); err != nil {
			t.Fatal(err)
		}
	}
	if code, agent := c.chat("m1", "fresh"); code != http.StatusOK || !strings.HasPrefix(agent, "gpu") {
		t.Fatalf("home back: %d from %s", code, agent)
	}
	if strings.Contains(logs.String(), "sk-provider-key") {
		t.Fatal("the provider key reached the logs")
	}
}

// syncWriter serializes writes (and reads of what a strings.Builder holds).
type syncWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

func (s *syncWriter) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.String()
}
