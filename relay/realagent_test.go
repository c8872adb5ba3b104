package relay_test

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent"
)

// realAgent is a package agent Agent running in the test, in front of an
// itEngine, joined to an itRelay over QUIC on loopback.
type realAgent struct {
	a      *agent.Agent
	cancel context.CancelFunc
	done   chan error
}

// Each of edits changes the agent's configuration before it starts.
func startRealAgent(t testing.TB, rl *itRelay, name string, e *itEngine, edits ...func(*agent.Config)) *realAgent {
	t.Helper()
	addrs := rl.r.Addrs()
	if len(addrs) == 0 {
		t.Fatal("relay has no address")
	}
	cfg := agent.Config{
		Relay:        addrs[0].String(),
		Token:        itToken,
		Upstream:     e.srv.URL,
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
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ra := &realAgent{a: a, cancel: cancel, done: make(chan error, 1)}
	go func() { ra.done <- a.Run(ctx) }()
	t.Cleanup(ra.stop)
	return ra
}

func (ra *realAgent) id() peer.ID { return ra.a.ID() }

// stop drains the agent, leaves the relay and closes its host.
func (ra *realAgent) stop() {
	if ra.cancel == nil {
		return
	}
	ra.cancel()
	<-ra.done
	ra.cancel = nil
}
