package liveness

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/transport"
)

// TestFlightEndDisarmsAckBound ends flights with and without their
// acknowledgement: once a flight is over its ack bound must not be armed,
// or it goes off for an attempt that no longer waits, pings the agent and,
// the agent answering, re-arms itself for as long as the relay runs.
func TestFlightEndDisarmsAckBound(t *testing.T) {
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	bg, stop := context.WithCancel(context.Background())
	stop() // a closed relay starts no prober: the flights alone are tested
	var wg sync.WaitGroup
	l := New(Config{Host: h, Log: zerolog.Nop(), Ctx: bg, WG: &wg})
	for _, acked := range []bool{true, false, true, false} {
		ctx, cancel := context.WithCancelCause(context.Background())
		f, _ := l.Begin(ctx, cancel, h.ID(), "agent")
		f.sent()
		if acked {
			f.Acked()
		}
		f.End()
		if f.timer.Load().t.Stop() {
			t.Fatalf("acked %v: the ack bound of an ended flight was still armed", acked)
		}
		if cause := context.Cause(ctx); cause != nil {
			t.Fatalf("acked %v: flight cancelled with %v", acked, cause)
		}
		cancel(nil)
	}
	wg.Wait()
}

// TestAckBoundStartsWhenSent: a request not written yet (waiting for a
// stream to the agent) is not bounded by the ack; written, it is, and an
// agent that does not answer the ping that follows is left.
func TestAckBoundStartsWhenSent(t *testing.T) {
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	bg, stop := context.WithCancel(context.Background())
	stop()
	var wg sync.WaitGroup
	l := New(Config{Host: h, Registry: noAgents{}, Log: zerolog.Nop(), Ctx: bg, WG: &wg})
	// A peer with no connection: pings fail, as to a dead agent.
	dead := peer.ID("12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A")
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	f, _ := l.Begin(ctx, cancel, dead, "agent")
	defer f.End()
	select {
	case <-ctx.Done():
		t.Fatalf("a request not sent yet was given up: %v", context.Cause(ctx))
	case <-time.After(3 * MinAckTimeout):
	}
	f.sent()
	select {
	case <-ctx.Done():
		if !errors.Is(context.Cause(ctx), ErrNoAck) {
			t.Fatalf("given up with %v", context.Cause(ctx))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a request sent to a dead agent was never given up")
	}
	wg.Wait()
}

// noAgents is a registry without agents.
type noAgents struct{}

func (noAgents) Registered() []Agent                   { return nil }
func (noAgents) Holds(string, peer.ID) bool            { return false }
func (noAgents) SetUnresponsive(string, peer.ID, bool) {}
func (noAgents) SetDead(string, bool)                  {}
