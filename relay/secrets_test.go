package relay_test

import (
	"bytes"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/relaytest"
)

// lockedBuffer collects logs written from many goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestSecretsNeverLogged runs a relay and real agents with every log level
// on through joins (one with a wrong token), requests (streamed, failing,
// with wrong keys) and shutdown, and checks that no join token, client key,
// wrong key or engine key appears in any log line.
func TestSecretsNeverLogged(t *testing.T) {
	t.Parallel() // waits on agents over QUIC, in its own relay and loggers
	const (
		upstreamKey = "engine-secret-4f1d9"
		wrongKey    = "sk-wrong-guess-77ab"
		wrongToken  = "not-the-join-token-3c2e"
	)
	logs := &lockedBuffer{}
	log := zerolog.New(logs).Level(zerolog.TraceLevel)
	rl := startRelayLogger(t, log.With().Str("side", "relay").Logger())
	eng := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "e1"})

	runAgent := func(name, token string) *relaytest.Agent {
		cfg := relaytest.AgentConfig(name, token, eng.URL(), rl.Addr())
		cfg.UpstreamAPIKey = upstreamKey
		cfg.Logger = log.With().Str("side", "agent").Logger()
		return relaytest.RunAgent(t, cfg)
	}
	good, bad := runAgent("good", itToken), runAgent("intruder", wrongToken)

	c := newClient(t, rl.URL)
	waitFor(t, "good agent routable", func() bool { return len(c.models()) == 1 })
	waitFor(t, "a refused join logged", func() bool { return strings.Contains(logs.String(), "join failed") })

	send := func(body string, hdr ...string) int {
		resp, err := c.post("/v1/chat/completions", body, hdr...)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		body string
		hdr  []string
		want int
	}{
		{`{"model":"m1","messages":[]}`, []string{"X-Session-ID", "s1"}, 200},
		{`{"model":"m1","stream":true,"messages":[]}`, nil, 200},
		{`{"model":"m1"}`, []string{"Authorization", "Bearer " + wrongKey}, 401},
		{`{"model":"m1"}`, []string{"Authorization", wrongKey}, 401},
		{`{"model":"nope"}`, nil, 404},
		{`{"model":`, nil, 400},
	} {
		if got := send(tc.body, tc.hdr...); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.body, got, tc.want)
		}
	}
	good.Stop()
	bad.Stop()
	rl.Stop()

	out := logs.String()
	for _, must := range []string{`"side":"relay"`, `"side":"agent"`, "agent joined", "request", "join failed"} {
		if !strings.Contains(out, must) {
			t.Errorf("logs lack %q: the test would not see a leak", must)
		}
	}
	for name, secret := range map[string]string{
		"join token": itToken, "wrong join token": wrongToken, "client key": itKey,
		"wrong client key": wrongKey, "engine key": upstreamKey,
	} {
		if strings.Contains(out, secret) {
			i := strings.Index(out, secret)
			t.Errorf("the %s appears in the logs: ...%s...", name, out[max(0, i-200):min(len(out), i+100)])
		}
	}
	if good.ID() == "" {
		t.Error("no agent ID")
	}
}
