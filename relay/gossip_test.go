package relay_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// These tests run a relay and real agents (package agent) over QUIC on
// loopback with membership gossip on, and check that gossip drives the
// relay's routing table.

const gToken = "gossip-join-secret"

// gFastTune makes failure detection quick enough for tests while leaving a
// loaded, race-instrumented machine room to answer probes: probe every
// second, ack within 500 ms, a suspect is dead after 3 to 12 s.
func gFastTune(c *memberlist.Config) {
	c.ProbeInterval = time.Second
	c.ProbeTimeout = 500 * time.Millisecond
	c.IndirectChecks = 3
	c.SuspicionMult = 3
	c.SuspicionMaxTimeoutMult = 4
	c.GossipInterval = 100 * time.Millisecond
	c.RetransmitMult = 4
	c.TCPTimeout = 3 * time.Second
	c.PushPullInterval = 5 * time.Second
	c.GossipToTheDeadTime = 10 * time.Second
}

// gRelay is a relay with gossip serving HTTP on loopback.
// startGRelay starts a relay that takes part in gossip with the given
// preset and tuning.
// Each of edits changes the relay's configuration before it starts.
func startGRelay(t testing.TB, tune func(*memberlist.Config), preset string, edits ...func(*relay.Config)) *relaytest.Relay {
	t.Helper()
	cfg := relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Token:     []byte(gToken),
		NoAuth:    true,
		Policy:    scheduler.PolicyRoundRobin,
		Logger:    gTestLogger(t, "relay"),
		Gossip:    relay.GossipConfig{Preset: preset, Tune: tune, LeaveTimeout: time.Second},
	}
	for _, edit := range edits {
		edit(&cfg)
	}
	return relaytest.ServeRelay(t, cfg)
}

// gAgentConfig is the agent configuration of the gossip tests (fast
// backoff, drain and gossip timings, gossip tuned by tune and preset) for an
// agent of e with the identity file identity, joining relays.
func gAgentConfig(t testing.TB, name string, e *relaytest.FakeEngine, identity string, tune func(*memberlist.Config), preset string, relays ...string) agent.Config {
	cfg := relaytest.AgentConfig(name, gToken, e.URL(), relays...)
	cfg.IdentityFile = identity
	cfg.Logger = gTestLogger(t, name)
	cfg.RefreshInterval = time.Second
	cfg.Gossip = agent.GossipConfig{Preset: preset, Tune: tune, MetricsInterval: 100 * time.Millisecond, LeaveTimeout: time.Second}
	return cfg
}

// gTestLogger discards, unless COMPUTEFLUX_TEST_LOG names a file: then
// every component logs there at debug level (for looking into a failure).
func gTestLogger(t testing.TB, who string) zerolog.Logger {
	path := os.Getenv("COMPUTEFLUX_TEST_LOG")
	if path == "" {
		return zerolog.New(io.Discard)
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return zerolog.New(f).Level(zerolog.DebugLevel).With().Timestamp().Str("who", who).Logger()
}

// relayAgentMembers returns the agent names the relay's gossip lists alive
// (not suspect) with decoded metadata.
func relayAgentMembers(gr *relaytest.Relay) []string {
	var names []string
	for _, m := range gr.Relay.Gossip().Members() {
		if !m.Suspect && m.MetaErr == nil && m.Meta.Role == transport.NodeRoleAgent {
			names = append(names, m.Meta.Name)
		}
	}
	sort.Strings(names)
	return names
}

func routable(gr *relaytest.Relay, name string) bool {
	for _, s := range gr.Relay.Scheduler().Snapshot() {
		if s.ID == name && !s.Health.Draining {
			return true
		}
	}
	return false
}

// servedBy sends n requests (round-robin policy) and returns the agents
// that served them; any failure is fatal.
func servedBy(t testing.TB, gr *relaytest.Relay, n int) map[string]int {
	t.Helper()
	hc := &http.Client{Timeout: 30 * time.Second}
	defer hc.CloseIdleConnections()
	out := map[string]int{}
	for i := range n {
		resp, err := hc.Post(gr.URL+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m1","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
		out[resp.Header.Get(relay.HeaderAgent)]++
	}
	return out
}

func startGCluster(t *testing.T, n int, tune func(*memberlist.Config), preset string) (*relaytest.Relay, []*relaytest.Agent, []*relaytest.FakeEngine, time.Duration) {
	t.Helper()
	gr := startGRelay(t, tune, preset)
	dir := t.TempDir()
	agents, engines := make([]*relaytest.Agent, n), make([]*relaytest.FakeEngine, n)
	for i := range agents {
		name := fmt.Sprintf("agent-%d", i)
		engines[i] = relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: name, VLLMMetrics: true})
		agents[i] = relaytest.RunAgent(t, gAgentConfig(t, name, engines[i], filepath.Join(dir, name+".key"), tune, preset, gr.Addr()))
	}
	took := relaytest.Within(t, 60*time.Second, "the relay to see every agent alive in gossip", func() bool {
		return len(relayAgentMembers(gr)) == n
	})
	var views []string // each agent's view at the last look, for a failure
	defer func() {
		if t.Failed() {
			t.Logf("the agents' views of the others (members, suspect): %v", views)
		}
	}()
	relaytest.Within(t, 60*time.Second, "every agent to see every other member", func() bool {
		views = views[:0]
		ok := true
		for i, ga := range agents {
			g := ga.Agent.Gossip()
			if g == nil {
				views, ok = append(views, fmt.Sprintf("agent-%d: no gossip", i)), false
				continue
			}
			ms, suspect := g.Members(), 0
			for _, m := range ms {
				if m.Suspect {
					suspect++
				}
			}
			views = append(views, fmt.Sprintf("agent-%d: %d, %d", i, len(ms), suspect))
			ok = ok && len(ms) == n
		}
		return ok
	})
	return gr, agents, engines, took
}

// TestGossipDrivesRouting runs a relay and 5 agents and walks through the
// membership life cycle as the relay's routing table sees it.
func TestGossipDrivesRouting(t *testing.T) {
	slow.Gate(t, "waits on gossip rounds over QUIC")
	t.Parallel() // waits on gossip timers, in its own relay and agents
	gr, agents, engines, took := startGCluster(t, 5, gFastTune, transport.GossipPresetLocal)
	t.Logf("5 agents alive with metadata at the relay %v after the first start", took)
	want := []string{"agent-0", "agent-1", "agent-2", "agent-3", "agent-4"}
	relaytest.Within(t, 30*time.Second, "the relay's gossip to list agent-0..4 alive", func() bool { return slices.Equal(relayAgentMembers(gr), want) })
	// Agents probe each other over the relay's circuit (loopback is not a
	// public range here, so no hole punch replaces it).
	relaytest.Within(t, 30*time.Second, "agent-0 to hold a relayed connection to agent-1", func() bool {
		return transport.PathTo(agents[0].Agent.Host(), agents[1].Agent.ID()) == transport.PathRelayed
	})

	t.Run("membership in the relay's metrics", func(t *testing.T) {
		// Polled: with the fast test timings a loaded machine may have one
		// member briefly suspect at any one instant.
		var missing []string
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			resp, err := http.Get(gr.URL + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			missing = missing[:0]
			for _, line := range []string{
				`computeflux_gossip_members{role="agent",state="alive"} 5`,
				`computeflux_gossip_bytes_total{direction="sent"}`,
			} {
				if !strings.Contains(string(body), line) {
					missing = append(missing, line)
				}
			}
			if len(missing) == 0 || time.Now().After(deadline) {
				break
			}
		}
		for _, line := range missing {
			t.Errorf("/metrics lacks %s", line)
		}
	})

	t.Run("metadata reaches the scheduler", func(t *testing.T) {
		e := engines[1]
		e.Running.Store(3)
		e.Waiting.Store(7)
		e.KVMilli.Store(420)
		relaytest.Within(t, 30*time.Second, "agent-1's engine load in the relay's scheduler", func() bool {
			for _, s := range gr.Relay.Scheduler().Snapshot() {
				if s.ID == "agent-1" {
					h := s.Health
					return h.Running >= 3 && h.Waiting == 7 && h.KVCacheUsage > 0.419 && h.KVCacheUsage < 0.421
				}
			}
			return false
		})
	})

	t.Run("a peer that has not joined cannot inject gossip", func(t *testing.T) {
		h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		relayInfo := peer.AddrInfo{ID: gr.Relay.Host().ID(), Addrs: gr.Relay.Host().Addrs()}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := h.Connect(ctx, relayInfo); err != nil {
			t.Fatal(err)
		}
		g, err := transport.NewGossip(transport.GossipConfig{
			Host: h, Preset: transport.GossipPresetLocal, Tune: gFastTune,
			Admit:      func(p peer.ID) bool { return p == relayInfo.ID },
			MetaSource: func() transport.NodeMeta { return transport.NodeMeta{Role: transport.NodeRoleAgent, Name: "intruder"} },
		})
		if err != nil {
			t.Fatal(err)
		}
		defer g.Shutdown()
		before := gr.Relay.Gossip().Stats().Rejected
		if n, err := g.Join(relayInfo.ID); err == nil && n > 0 {
			t.Fatalf("an outsider joined the relay's gossip (%d)", n)
		}
		if gr.Relay.Gossip().Known(h.ID()) {
			t.Error("the relay lists the outsider as a member")
		}
		if gr.Relay.Gossip().Stats().Rejected <= before {
			t.Error("the refused gossip stream was not counted")
		}
	})

	t.Run("gossip dead while the join stream is open", func(t *testing.T) {
		// The agent's process is alive and registered but its gossip went
		// silent (hung, or its probes cannot get through): only gossip can
		// tell.
		victim := agents[2]
		_ = victim.Agent.Gossip().Shutdown()
		took := relaytest.Within(t, 60*time.Second, "the relay to take agent-2 out of routing", func() bool { return !routable(gr, "agent-2") })
		t.Logf("gossip-silent agent out of routing after %v (fast test timings)", took)
		if _, ok := gr.Relay.Registry().Peer("agent-2"); !ok {
			t.Error("the agent lost its name while its registration is open")
		}
		if got := servedBy(t, gr, 12); got["agent-2"] > 0 {
			t.Errorf("requests still went to the dead agent: %v", got)
		}
	})

	t.Run("host closed without leaving, then restarted", func(t *testing.T) {
		victim := agents[3]
		start := time.Now()
		if err := victim.Agent.Host().Close(); err != nil {
			t.Fatal(err)
		}
		took := relaytest.Within(t, 60*time.Second, "the relay to take agent-3 out of routing", func() bool { return !routable(gr, "agent-3") })
		t.Logf("closed agent out of routing after %v", took)
		if got := servedBy(t, gr, 12); got["agent-3"] > 0 {
			t.Errorf("requests still went to the closed agent: %v", got)
		}
		relaytest.Within(t, 60*time.Second, "the other agents' gossip to drop agent-3", func() bool {
			for _, ga := range []*relaytest.Agent{agents[0], agents[1], agents[4]} {
				if ga.Agent.Gossip().Known(victim.Agent.ID()) {
					return false
				}
			}
			return true
		})
		t.Logf("closed agent dropped by every other agent's gossip after %v", time.Since(start))
		stopAt := time.Now()
		victim.Stop()
		t.Logf("stopping the closed agent took %v", time.Since(stopAt))

		// Restart with the same identity: it joins again, gossip sees it
		// alive, and it takes requests.
		agents[3] = relaytest.RunAgent(t, victim.Config)
		if agents[3].Agent.ID() != victim.Agent.ID() {
			t.Fatal("restarted agent has another peer ID")
		}
		back := relaytest.Within(t, 60*time.Second, "the restarted agent a gossip member at the relay and routable", func() bool {
			return gr.Relay.Gossip().Known(victim.Agent.ID()) && routable(gr, "agent-3")
		})
		t.Logf("restarted agent a gossip member and routable after %v", back)
		if got := servedBy(t, gr, 12); got["agent-3"] == 0 {
			t.Errorf("the restarted agent takes no requests: %v", got)
		}
	})

	t.Run("graceful leave is seen at once", func(t *testing.T) {
		leaver := agents[4]
		start := time.Now()
		stopped := make(chan struct{})
		go func() {
			leaver.Stop()
			close(stopped)
		}()
		took := relaytest.Within(t, 30*time.Second, "the relay to stop routing to the leaving agent", func() bool { return !routable(gr, "agent-4") })
		t.Logf("leaving agent out of routing after %v", took)
		<-stopped
		t.Logf("agent stopped (drain, gossip leave, registration closed) after %v", time.Since(start))
		if got := servedBy(t, gr, 12); got["agent-4"] > 0 {
			t.Errorf("requests went to an agent that left: %v", got)
		}
		for _, ga := range []*relaytest.Agent{agents[0], agents[1]} {
			relaytest.Within(t, 30*time.Second, "the others to drop the leaver", func() bool { return !ga.Agent.Gossip().Known(leaver.Agent.ID()) })
		}
	})

	if os.Getenv("COMPUTEFLUX_GOSSIP_LOG_STATS") != "" {
		for _, ga := range agents {
			if g := ga.Agent.Gossip(); g != nil {
				t.Logf("%s gossip stats %+v", ga.Name, g.Stats())
			}
		}
	}
	var wg sync.WaitGroup
	for _, ga := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ga.Stop()
		}()
	}
	wg.Wait()
	gr.Stop()
}

// TestStaleEngineLoadIsUnknownAtTheRelay: an engine whose /metrics breaks
// after saying it is saturated (a queue, a full KV cache) is not taken as
// saturated for ever: the agent (package agent, gossip over QUIC) reports
// its load unknown a few scrape intervals later, and the relay's scheduler
// drops the old figures, going by in-flight counts alone; once /metrics
// answers again, its figures are back.
func TestStaleEngineLoadIsUnknownAtTheRelay(t *testing.T) {
	t.Parallel() // waits on gossip timers, in its own relay and agent
	gr := startGRelay(t, gFastTune, transport.GossipPresetLocal)
	e := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "agent-0", VLLMMetrics: true})
	e.Waiting.Store(7)
	e.KVMilli.Store(990)
	ga := relaytest.RunAgent(t, gAgentConfig(t, "agent-0", e, filepath.Join(t.TempDir(), "a.key"), gFastTune, transport.GossipPresetLocal, gr.Addr()))
	health := func() scheduler.Health {
		for _, s := range gr.Relay.Scheduler().Snapshot() {
			if s.ID == "agent-0" {
				return s.Health
			}
		}
		return scheduler.Health{}
	}
	relaytest.Within(t, 30*time.Second, "the engine's load in the relay's scheduler", func() bool {
		h := health()
		return h.Waiting == 7 && h.KVCacheUsage > 0.98
	})
	e.MetricsBroken.Store(true)
	took := relaytest.Within(t, 30*time.Second, "the stale load to be dropped at the relay", func() bool {
		h := health()
		return h.Waiting == 0 && h.KVCacheUsage == 0
	})
	t.Logf("stale load dropped at the relay %v after /metrics broke (scrape every 100 ms, stale after 3)", took)
	e.MetricsBroken.Store(false)
	relaytest.Within(t, 30*time.Second, "the engine's load back in the relay's scheduler", func() bool {
		h := health()
		return h.Waiting == 7 && h.KVCacheUsage > 0.98
	})
	ga.Stop()
	gr.Stop()
}
