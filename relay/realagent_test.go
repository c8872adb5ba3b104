package relay_test

import (
	"io"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/relay/relaytest"
)

// Each of edits changes the agent's configuration before it starts.
func startRealAgent(t testing.TB, rl *relaytest.Relay, name, upstream string, edits ...func(*agent.Config)) *relaytest.Agent {
	t.Helper()
	addrs := rl.Relay.Addrs()
	if len(addrs) == 0 {
		t.Fatal("relay has no address")
	}
	cfg := agent.Config{
		Relay:        addrs[0].String(),
		Token:        itToken,
		Upstream:     upstream,
		Name:         name,
		ListenAddrs:  []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Logger:       zerolog.New(io.Discard),
		MinBackoff:   20 * time.Millisecond,
		MaxBackoff:   500 * time.Millisecond,
		DrainTimeout: 2 * time.Second,
	}
	for _, edit := range edits {
		edit(&cfg)
	}
	return relaytest.RunAgent(t, cfg)
}
