package relay_test

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/p2p/protocol/ping"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/liveness"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// joinHost joins h to the relay as name serving model m1, and keeps the
// registration until the test ends.
func joinHost(t *testing.T, rl *relaytest.Relay, h host.Host, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.Connect(ctx, rl.Info()); err != nil {
		t.Fatal(err)
	}
	m, err := transport.Join(ctx, h, rl.Info().ID, []byte(itToken), joinInfo(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
}

func agentHealth(rl *relaytest.Relay, name string) (scheduler.Health, bool) {
	for _, st := range rl.Relay.Scheduler().Snapshot() {
		if st.ID == name {
			return st.Health, true
		}
	}
	return scheduler.Health{}, false
}

// A peer that takes requests and never acknowledges them (a process frozen
// or gone, its connection not yet timed out) costs a request a few hundred
// milliseconds, not the engine's time-to-first-byte bound: the attempt is
// retried on another agent and the mute one turns suspect at once.
func TestUnacknowledgedRequestRetriedElsewhere(t *testing.T) {
	rl := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Token:     []byte(itToken),
		APIKeys:   []string{itKey},
		// Round robin: the mute agent is certainly picked.
		Policy: scheduler.PolicyRoundRobin,
		Logger: zerolog.New(io.Discard),
	})
	relaytest.RunAgent(t, relaytest.AgentConfig("good", itToken, relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "good"}).URL(), rl.Addr()))
	// No ping service either: probes go unanswered, as a frozen process's.
	mute := newHostOpts(t, libp2p.Ping(false))
	var swallowed atomic.Int64
	mute.SetStreamHandler(transport.InferProtocol, func(s network.Stream) {
		swallowed.Add(1)
		_, _ = io.Copy(io.Discard, s) // reads the request, answers nothing
	})
	joinHost(t, rl, mute, "mute")
	waitAgents(t, rl, "good", "mute")

	c := newClient(t, rl.URL)
	var longest time.Duration
	for i := range 6 {
		start := time.Now()
		status, agent := c.chat("m1", "")
		d := time.Since(start)
		longest = max(longest, d)
		if status != http.StatusOK || agent != "good" {
			t.Fatalf("request %d: status %d from %q, want 200 from good", i, status, agent)
		}
		if d > 5*time.Second {
			t.Fatalf("request %d took %v: the missing acknowledgement was not noticed", i, d)
		}
	}
	if swallowed.Load() == 0 {
		t.Fatal("the mute agent got no request: the test proved nothing")
	}
	if h, ok := agentHealth(rl, "mute"); !ok || !h.Suspect {
		t.Fatalf("mute agent health %+v (known %v), want suspect", h, ok)
	}
	if h, _ := agentHealth(rl, "good"); h.Suspect {
		t.Fatal("the good agent is suspect")
	}
	t.Logf("longest request with a mute agent: %v (%d requests reached it)", longest, swallowed.Load())

	// It answers probes again (a frozen process woken up): routable again.
	ping.NewPingService(mute)
	waitFor(t, "the mute agent to be no longer suspect", func() bool {
		h, ok := agentHealth(rl, "mute")
		return ok && !h.Suspect
	})
}

func newHostOpts(t *testing.T, opts ...libp2p.Option) host.Host {
	t.Helper()
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Options: opts})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h
}

// An agent that acknowledged a stream, sent its first event and then stops
// answering (no event, no probe echo) has the stream ended with an OpenAI
// error event within about the silence bound, not the idle timeout.
func TestSilentAgentEndsStreamWithErrorEvent(t *testing.T) {
	rl := startRelayLogger(t, zerolog.New(io.Discard))
	// No ping service: its probes go unanswered, as a frozen process's.
	h := newHostOpts(t, libp2p.Ping(false))
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	relayID := rl.Info().ID
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select { // then silence
		case <-release:
		case <-r.Context().Done():
		}
	})
	srv, err := transport.ServeHTTP(h, handler, func(p peer.ID) bool { return p == relayID })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	joinHost(t, rl, h, "frozen")
	waitAgents(t, rl, "frozen")

	c := newClient(t, rl.URL)
	resp, err := c.post("/v1/chat/completions", `{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	var events []string
	var firstAt, lastAt time.Time
	for {
		line, err := br.ReadString('\n')
		if strings.HasPrefix(line, "data: ") {
			events = append(events, strings.TrimSpace(line))
			if firstAt.IsZero() {
				firstAt = time.Now()
			}
			lastAt = time.Now()
		}
		if err != nil {
			break
		}
	}
	if len(events) != 2 || !strings.Contains(events[1], `"error"`) || !strings.Contains(events[1], "upstream_unreachable") {
		t.Fatalf("events %q: want the first event, then an upstream_unreachable error event", events)
	}
	gap := lastAt.Sub(firstAt)
	if gap > 10*time.Second {
		t.Fatalf("error event %v after the last event: the silence went unnoticed", gap)
	}
	if h, _ := agentHealth(rl, "frozen"); !h.Suspect {
		t.Fatal("silent agent is not suspect")
	}
	t.Logf("silent agent's stream ended with an error event %v after its last event", gap)
}

// An agent whose pings go unanswered but whose answers keep coming is not
// silent: bytes of an answer are a sign of life as good as an echo (a
// busy connection may hold a new ping stream back). Its stream, longer
// than the silence bound, ends with [DONE].
func TestStreamingAgentWithoutEchoIsNotSilent(t *testing.T) {
	t.Parallel() // waits on agents over QUIC, in its own relay
	rl := startRelayLogger(t, zerolog.New(io.Discard))
	h := newHostOpts(t, libp2p.Ping(false)) // no echo, ever
	relayID := rl.Info().ID
	const events = 15 // 3 s at one event per 200 ms, twice silentAfter
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for range events {
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n")
			w.(http.Flusher).Flush()
			select {
			case <-tick.C:
			case <-r.Context().Done():
				return
			}
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})
	srv, err := transport.ServeHTTP(h, handler, func(p peer.ID) bool { return p == relayID })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	joinHost(t, rl, h, "streaming")
	waitAgents(t, rl, "streaming")

	c := newClient(t, rl.URL)
	resp, err := c.post("/v1/chat/completions", `{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), `"content":"hi"`); n != events || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") {
		t.Fatalf("%d of %d events, then %q", n, events, b[max(0, len(b)-120):])
	}
}

// Detection of a silent agent with no request in flight, through package
// agent: each run kills one agent by dropping its packets, half of them
// right after it joined, and measures until the relay routes around it.
// The relay's idle probe finds it: at most the idle silence bound after its
// last echo, and a probe interval more for a probe in flight; one more
// probe interval is room for a loaded machine. Gossip (the home preset)
// would take about 11 s. Two runs by default;
// COMPUTEFLUX_LIVENESS_MEASURE=1 makes ten.
func TestSilentIdleAgentDetection(t *testing.T) {
	slow.Gate(t, "kills idle agents and waits on liveness")
	t.Parallel() // waits on the liveness timers, in its own cluster
	ctx := context.Background()
	cl, err := relaytest.Start(ctx, relaytest.Config{Engines: 2, Engine: simengine.Config{TimeScale: 100}})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	runs := 2
	if os.Getenv("COMPUTEFLUX_LIVENESS_MEASURE") != "" {
		runs = 10
	}
	bound := liveness.IdleSilentAfter + 2*liveness.IdleProbeInterval
	var took []time.Duration
	for run := range runs {
		i := 1
		if run%2 == 1 {
			// Killed right after joining (AddEngine returns once joined).
			var err error
			if i, err = cl.AddEngine(ctx); err != nil {
				t.Fatal(err)
			}
		} else {
			time.Sleep(1500 * time.Millisecond) // well after its join
		}
		name := cl.Engine(i).Name
		killed := time.Now()
		if err := cl.KillAgent(i); err != nil {
			t.Fatal(err)
		}
		// Polled past the bound, so that a failure says how long it took.
		for !suspectOrGone(cl.Relay().Scheduler(), name) {
			if time.Since(killed) > 30*time.Second {
				t.Fatalf("run %d: the relay still routes to %s 30 s after it died", run, name)
			}
			time.Sleep(5 * time.Millisecond)
		}
		took = append(took, time.Since(killed))
		if d := took[len(took)-1]; d > bound {
			t.Errorf("run %d: the relay routed around silent %s after %v, want within %v (silence bound %v + 2 probe intervals of %v)",
				run, name, d.Round(time.Millisecond), bound, liveness.IdleSilentAfter, liveness.IdleProbeInterval)
		}
		if run%2 == 0 {
			if err := cl.RestartAgent(ctx, i); err != nil {
				t.Fatal(err)
			}
		}
	}
	sorted := slices.Clone(took)
	slices.Sort(sorted)
	t.Logf("silent idle agent out of routing after: median %v, worst %v (runs %v; odd runs killed right after joining; bound %v)",
		sorted[len(sorted)/2].Round(time.Millisecond), sorted[len(sorted)-1].Round(time.Millisecond), took, bound)
}

func suspectOrGone(s *scheduler.Scheduler, id string) bool {
	for _, st := range s.Snapshot() {
		if st.ID == id {
			return st.Health.Suspect || st.Health.Draining
		}
	}
	return true
}
