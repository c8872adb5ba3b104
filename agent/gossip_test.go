package agent

import (
	"bytes"
	"context"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

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

// TestStaleLoadReportedUnknown: when the engine's /metrics stops answering,
// the last figures are published for metricsStaleScrapes scrape intervals
// and then reported unknown (zero, LoadUnknown set), neither idle nor
// saturated; the agent logs once when they go stale and once when a read
// brings them back. Time is injected: each scrape is made at a chosen
// instant.
func TestStaleLoadReportedUnknown(t *testing.T) {
	e := newEngine(t)
	var logs syncLog
	a, err := New(Config{
		Relay:    "/ip4/127.0.0.1/udp/1/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A",
		Token:    token,
		Upstream: e.srv.URL,
		Name:     "gpu-1",
		Logger:   zerolog.New(&logs),
		Gossip:   GossipConfig{MetricsInterval: time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a.refresh(ctx)
	a.mu.Lock()
	readAt := a.metricsAt
	a.mu.Unlock()
	every := a.scrapeInterval()
	if every != time.Second || readAt.IsZero() {
		t.Fatalf("scrape interval %v, figures read at %v", every, readAt)
	}
	fresh := func(m transport.NodeMeta) bool {
		return !m.LoadUnknown && m.Running == 3 && m.Waiting == 2 && m.KVCacheUsage == 0.25
	}
	unknown := func(m transport.NodeMeta) bool {
		return m.LoadUnknown && m.Running == 0 && m.Waiting == 0 && m.KVCacheUsage == 0
	}
	if m := a.gossipMetaAt(readAt); !fresh(m) {
		t.Fatalf("after a good read: %+v", m)
	}

	e.metricsBroken.Store(true)
	staleAt := readAt.Add(metricsStaleScrapes * every)
	for i := 1; i <= metricsStaleScrapes+3; i++ {
		now := readAt.Add(time.Duration(i) * every)
		a.scrapeOnce(ctx, now)
		m := a.gossipMetaAt(now)
		if now.After(staleAt) {
			if !unknown(m) {
				t.Fatalf("scrape %d, %v after the last good read: %+v, want the load unknown", i, now.Sub(readAt), m)
			}
		} else if !fresh(m) {
			t.Fatalf("scrape %d, %v after the last good read: %+v, want the last figures", i, now.Sub(readAt), m)
		}
	}
	if m := a.gossipMetaAt(staleAt); !fresh(m) {
		t.Errorf("at exactly %d scrape intervals: %+v, want the last figures", metricsStaleScrapes, m)
	}
	if m := a.gossipMetaAt(staleAt.Add(time.Nanosecond)); !unknown(m) {
		t.Errorf("just past %d scrape intervals: %+v, want unknown", metricsStaleScrapes, m)
	}
	if n := logs.count("engine load figures stale"); n != 1 {
		t.Errorf("%d stale lines, want 1:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "status 500") {
		t.Errorf("the stale line does not say why:\n%s", logs.String())
	}

	e.metricsBroken.Store(false)
	back := readAt.Add(20 * every)
	a.scrapeOnce(ctx, back)
	a.scrapeOnce(ctx, back.Add(every))
	if m := a.gossipMetaAt(back.Add(every)); !fresh(m) {
		t.Errorf("after the engine answered again: %+v", m)
	}
	if n := logs.count("engine load figures read again"); n != 1 {
		t.Errorf("%d recovery lines, want 1:\n%s", n, logs.String())
	}
	if n := logs.count("engine load figures stale"); n != 1 {
		t.Errorf("%d stale lines after the recovery, want 1", n)
	}
}

// syncLog collects log lines from several goroutines.
type syncLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *syncLog) count(s string) int { return strings.Count(l.String(), s) }
