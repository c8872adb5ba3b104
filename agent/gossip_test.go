package agent

import (
	"bytes"
	"context"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/transport"
)

// TestGossipMetaFromEngine: the gossip metadata carries the engine's
// models and load as read from its /metrics, our capacity, in-flight count,
// draining flag and recovered panics, and fits memberlist's limit.
func TestGossipMetaFromEngine(t *testing.T) {
	e := newEngine(t)
	a, err := New(Config{
		Relay:          "/ip4/127.0.0.1/udp/1/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A",
		Token:          token,
		Upstream:       e.srv.URL,
		Name:           "gpu-1",
		MaxConcurrency: 6,
	})
	if err != nil {
		t.Fatal(err)
	}
	a.refresh(context.Background())
	a.inflight.Add(2)
	m := a.gossipMeta()
	if m.Role != transport.NodeRoleAgent || m.Name != "gpu-1" || !slices.Equal(m.Models, []string{"llama-3"}) ||
		m.Capacity != 6 || m.InFlight != 2 || m.Running != 3 || m.Waiting != 2 || m.KVCacheUsage != 0.25 ||
		m.Draining || m.Unavailable {
		t.Fatalf("meta %+v", m)
	}
	if _, err := transport.EncodeMeta(m, transport.MetaMaxSize); err != nil {
		t.Fatalf("meta does not encode: %v", err)
	}
	a.draining.Store(true)
	if !a.gossipMeta().Draining {
		t.Error("draining not in the metadata")
	}
	if m.Panics != 0 {
		t.Errorf("%d panics before any", m.Panics)
	}
	a.countPanic() // what the stream server's ErrorLog calls (transport.ServerLog)
	if got := a.gossipMeta().Panics; got != 1 || a.Panics() != 1 {
		t.Errorf("a recovered panic: %d in the metadata, %d counted", got, a.Panics())
	}

	// An engine that stops answering makes the agent unavailable.
	e.srv.Close()
	for range a.cfg.EngineFailures {
		a.refresh(context.Background())
	}
	if !a.gossipMeta().Unavailable {
		t.Error("an agent without its engine is not unavailable in gossip")
	}
}

// TestGossipJoinsThroughRelay: an agent joins the gossip of its relay after
// the registration and publishes its metadata there; it leaves when it
// stops.
func TestGossipJoinsThroughRelay(t *testing.T) {
	r := startRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "")
	events := make(chan transport.GossipEvent, 64)
	var everJoined sync.Map
	var agentID peer.ID
	g, err := transport.NewGossip(transport.GossipConfig{
		Host:   r.h,
		Preset: transport.GossipPresetLocal,
		Tune:   tolerantTune,
		// Admitted while joined, and after: the leave may arrive after the
		// registration ended (they travel on different streams).
		Admit: func(p peer.ID) bool {
			if _, ok := r.current(p); ok {
				everJoined.Store(p, true)
				return true
			}
			_, ok := everJoined.Load(p)
			return ok
		},
		OnEvent: func(ev transport.GossipEvent) {
			select {
			case events <- ev:
			default:
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Shutdown()
	e := newEngine(t)
	a, err := New(Config{
		Relay:       r.addr(),
		Token:       token,
		Upstream:    e.srv.URL,
		Name:        "gpu-1",
		ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		MinBackoff:  20 * time.Millisecond,
		Gossip:      GossipConfig{Preset: transport.GossipPresetLocal, Tune: tolerantTune, LeaveTimeout: time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	agentID = a.ID()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()

	wait := func(typ transport.GossipEventType) transport.GossipEvent {
		t.Helper()
		timeout := time.After(30 * time.Second)
		for {
			select {
			case ev := <-events:
				if ev.Type == typ && ev.Peer == agentID {
					return ev
				}
			case <-timeout:
				t.Fatalf("no %v event for the agent", typ)
			}
		}
	}
	ev := wait(transport.GossipAlive)
	if ev.Meta.Name != "gpu-1" || ev.Meta.Role != transport.NodeRoleAgent {
		t.Errorf("alive with meta %+v", ev.Meta)
	}
	// Stop once the agent's side of the join is complete too (it knows
	// the relay): a leave sent before it knows anyone reaches nobody.
	deadline := time.Now().Add(30 * time.Second)
	for g := a.Gossip(); g == nil || !g.Known(r.h.ID()); g = a.Gossip() {
		if time.Now().After(deadline) {
			t.Fatal("the agent's gossip does not list the relay")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	wait(transport.GossipLeft)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	g.Shutdown()
	waitMemberlistStopped(t)
}

// tolerantTune keeps the local preset's pace but gives a loaded,
// race-instrumented machine time to answer probes: a false suspicion
// would turn the leave this test waits for into a death.
func tolerantTune(c *memberlist.Config) {
	c.ProbeInterval = time.Second
	c.ProbeTimeout = 500 * time.Millisecond
	c.SuspicionMult = 4
}

// waitMemberlistStopped polls until no memberlist goroutine is left: its
// Shutdown does not wait for a probe in progress, and goleak would see it.
func waitMemberlistStopped(t *testing.T) {
	t.Helper()
	buf := make([]byte, 4<<20)
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := runtime.Stack(buf, true)
		if !bytes.Contains(buf[:n], []byte("hashicorp/memberlist.(*Memberlist)")) {
			return
		}
		if time.Now().After(deadline) {
			t.Error("memberlist goroutines still running 30 s after shutdown")
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}
