package relay_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// startSimEngine runs a simulated engine on a loopback port until the test
// ends.
func startSimEngine(t testing.TB, cacheBlocks int) *simengine.Server {
	t.Helper()
	srv, _ := relaytest.RunSimEngine(t, simengine.Config{Models: []string{"m1"}, TimeScale: 20, DefaultMaxTokens: 4,
		Engine: simengine.EngineConfig{CacheBlocks: cacheBlocks}})
	return srv
}

// indexAgentConfig is an agent in front of engine url joining relays,
// publishing its prefix index every 20 ms, gossip off; kvTokens overrides
// the capacity read from the engine (0: read it).
func indexAgentConfig(name, url string, kvTokens int, relays ...string) agent.Config {
	cfg := relaytest.AgentConfig(name, itToken, url, relays...)
	cfg.Logger = testLogger()
	cfg.RefreshInterval = 200 * time.Millisecond
	cfg.Gossip = agent.GossipConfig{Disabled: true}
	cfg.Index = agent.IndexConfig{PublishInterval: 20 * time.Millisecond, KVCapacityTokens: kvTokens}
	return cfg
}

func indexRelay(t testing.TB, identity, p2p string) *relaytest.Relay {
	t.Helper()
	if p2p == "" {
		p2p = "/ip4/127.0.0.1/udp/0/quic-v1"
	}
	return relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{p2p}, IdentityFile: identity, Token: []byte(itToken), APIKeys: []string{itKey},
		Logger: testLogger(), IndexCutoff: time.Minute,
		Gossip: relay.GossipConfig{Disabled: true},
	})
}

// words returns n bytes of text made of words that depend on seed.
func words(seed string, n int) string {
	var b strings.Builder
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "%s%d ", seed, i%97*31+i/97)
	}
	return b.String()[:n]
}

// keylessChat sends a keyless streamed chat completion and returns the serving
// agent and the usage the client got (nil if none).
func keylessChat(t testing.TB, rl *relaytest.Relay, system, user string, includeUsage bool) (string, *int) {
	t.Helper()
	body := map[string]any{
		"model": "m1", "stream": true, "max_tokens": 4,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}},
	}
	if includeUsage {
		body["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, rl.URL+"/v1/chat/completions", bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+itKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, msg)
	}
	var cached *int
	done := false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			continue
		}
		var ch struct {
			Usage *struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(line), &ch); err != nil {
			t.Fatalf("bad chunk %q: %v", line, err)
		}
		if ch.Usage != nil {
			c := ch.Usage.Details.Cached
			cached = &c
		}
	}
	if !done {
		t.Fatal("stream ended without [DONE]")
	}
	return resp.Header.Get(relay.HeaderAgent), cached
}

// metric returns the value of the series whose line starts with prefix in
// the relay's /metrics (0 if absent).
func metric(t testing.TB, rl *relaytest.Relay, prefix string) float64 {
	t.Helper()
	rec := &bodyRecorder{h: http.Header{}}
	req, _ := http.NewRequest(http.MethodGet, "/metrics", nil)
	rl.Relay.Handler().ServeHTTP(rec, req)
	for line := range strings.Lines(rec.b.String()) {
		if rest, ok := strings.CutPrefix(line, prefix+" "); ok {
			v, _ := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			return v
		}
	}
	return 0
}

type bodyRecorder struct {
	h http.Header
	b bytes.Buffer
}

func (r *bodyRecorder) Header() http.Header         { return r.h }
func (r *bodyRecorder) Write(p []byte) (int, error) { return r.b.Write(p) }
func (r *bodyRecorder) WriteHeader(int)             {}

// probe asks the relay's scheduler where a keyless request of body would go
// and how many of its blocks that agent is believed to hold, without
// sending it.
func probe(rl *relaytest.Relay, body []byte) (string, int) {
	s := rl.Relay.Scheduler()
	chain := scheduler.PromptBlocks(nil, body, scheduler.PrefixConfig{})
	att := s.Begin(scheduler.Request{Model: "m1", Prefix: chain})
	c, err := att.Pick()
	if err != nil {
		return "", 0
	}
	att.Report(c, scheduler.Outcome{Status: http.StatusOK})
	return c.EndpointID, c.CachedBlocks
}

func chatBody(system, user string) []byte {
	b, _ := json.Marshal(map[string]any{
		"model": "m1", "stream": true, "max_tokens": 4,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}},
	})
	return b
}

// TestPrefixIndexRouting runs a relay and three package agents, each in
// front of a simulated engine, over QUIC on loopback: keyless requests that
// share a long system prompt land on the agent that holds it, and after a
// relay restart (no memory of past routes) the agents' snapshots alone
// send them there again.
func TestPrefixIndexRouting(t *testing.T) {
	dir := t.TempDir()
	rl := indexRelay(t, filepath.Join(dir, "relay.key"), "")
	p2p := rl.Relay.Host().Addrs()[0].String()
	names := []string{"a", "b", "c"}
	agents := map[string]*relaytest.Agent{}
	for _, n := range names {
		agents[n] = relaytest.RunAgent(t, indexAgentConfig(n, startSimEngine(t, 0).URL(), 0, rl.Addr()))
	}
	waitFor(t, "three agents publishing", func() bool {
		return metric(t, rl, `computeflux_prefix_updates_total{agent="c",type="snapshot"}`) >= 1 &&
			metric(t, rl, `computeflux_prefix_updates_total{agent="b",type="snapshot"}`) >= 1 &&
			metric(t, rl, `computeflux_prefix_updates_total{agent="a",type="snapshot"}`) >= 1
	})
	// The index was sized from the simulated engine's vllm:cache_config_info.
	for _, n := range names {
		waitFor(t, "capacity from the engine", func() bool {
			return agents[n].Agent.IndexStats().CapacityTokens == simengine.DefaultCacheBlocks*simengine.DefaultBlockSize
		})
	}

	system := words("sys", 16<<10) // 64 blocks
	first, u := keylessChat(t, rl, system, "question zero", false)
	if u != nil {
		t.Fatal("the client got a usage chunk it did not ask for")
	}
	holder := agents[first]
	if holder == nil {
		t.Fatalf("served by %q", first)
	}
	waitFor(t, "the holder's index published", func() bool { return rl.Relay.Scheduler().IndexStats().Entries >= 64 })
	if got := holder.Agent.IndexStats().Blocks; got < 64 {
		t.Fatalf("holder's index has %d blocks", got)
	}
	for i := range 6 {
		got, cached := keylessChat(t, rl, system, fmt.Sprintf("question %d, another one", i+1), true)
		if got != first {
			t.Fatalf("request %d sharing the prefix went to %s, not %s", i+1, got, first)
		}
		if cached == nil || *cached < 3000 {
			t.Fatalf("request %d: cached tokens %v, want most of the 16 KiB prefix", i+1, cached)
		}
	}

	// A restarted relay knows no past route: only the snapshots tell it.
	rl.Stop()
	rl = indexRelay(t, filepath.Join(dir, "relay.key"), p2p)
	waitFor(t, "the agents' snapshots at the new relay", func() bool { return rl.Relay.Scheduler().IndexStats().Entries >= 64 })
	if id, cached := probe(rl, chatBody(system, "after the restart")); id != first || cached < 60 {
		t.Fatalf("after restart: prefix placed on %s believed to hold %d blocks; want %s with >= 60", id, cached, first)
	}
	if got, _ := keylessChat(t, rl, system, "after the restart", false); got != first {
		t.Fatalf("after restart served by %s, want %s", got, first)
	}

	// A leaving agent takes its entries with it.
	before := rl.Relay.Scheduler().IndexStats().Entries
	holder.Stop()
	waitFor(t, "the holder's registration and entries dropped", func() bool {
		st := rl.Relay.Scheduler().IndexStats()
		return st.Entries < before && st.Entries < 64 && !rl.Relay.Registry().IsJoined(holder.ID())
	})
	if id, cached := probe(rl, chatBody(system, "after the holder left")); id == first || cached > 2 {
		t.Fatalf("after the holder left: %s believed to hold %d blocks", id, cached)
	}
}

// TestPrefixIndexFollowsEngine checks that the relay's picture follows the
// agent's through evictions and corrections: an agent told its engine
// holds four times what it does learns otherwise from cached_tokens, and
// the relay's entries match the agent's at every quiet point.
func TestPrefixIndexFollowsEngine(t *testing.T) {
	rl := indexRelay(t, "", "")
	// 512 blocks of 16 tokens: about four of the 5 KiB prompts below
	// (some 2,200 of the simulator's tokens each); the agent is told twice
	// that (256 of its 64-token blocks, about twelve prompts of 20).
	eng := startSimEngine(t, 512)
	a := relaytest.RunAgent(t, indexAgentConfig("solo", eng.URL(), 2*512*16, rl.Addr()))
	waitFor(t, "publishing", func() bool {
		return metric(t, rl, `computeflux_prefix_updates_total{agent="solo",type="snapshot"}`) >= 1
	})
	initial := a.Agent.IndexStats().Capacity
	if initial != 2*512*16/scheduler.DefaultBlockTokens {
		t.Fatalf("capacity %d blocks", initial)
	}
	synced := func(what string) {
		waitFor(t, what, func() bool {
			return rl.Relay.Scheduler().IndexStats().Entries == a.Agent.IndexStats().Blocks
		})
	}
	prompts := make([]string, 12)
	for i := range prompts {
		prompts[i] = words(fmt.Sprintf("p%d-", i), 5<<10)
		keylessChat(t, rl, prompts[i], "q", false)
	}
	synced("relay equal to agent after the inserts")
	st := a.Agent.IndexStats()
	if st.Blocks > st.Capacity {
		t.Fatalf("agent holds %d blocks over its capacity %d", st.Blocks, st.Capacity)
	}
	evicted := metric(t, rl, `computeflux_prefix_update_hashes_total{agent="solo",kind="evicted"}`)
	// Replaying the early prompts: the engine lost them, the agent
	// believed otherwise; the answers correct it.
	for i := range 4 {
		keylessChat(t, rl, prompts[i], "q", false)
	}
	synced("relay equal to agent after the corrections")
	st = a.Agent.IndexStats()
	if st.Corrections == 0 || st.Capacity >= initial {
		t.Fatalf("after replays: %d corrections, capacity %d (was %d)", st.Corrections, st.Capacity, initial)
	}
	if got := metric(t, rl, `computeflux_prefix_update_hashes_total{agent="solo",kind="evicted"}`); got <= evicted {
		t.Fatalf("no evictions published by the corrections (%v, before %v)", got, evicted)
	}
}

// TestPrefixIndexCutsOffBadPublisher publishes from a raw libp2p host that
// joined like an agent: valid updates are merged; a malformed or
// out-of-order one gets the publisher rejected and its entries dropped,
// without touching another agent's, and it may not publish again; a peer
// that did not join may not publish at all.
func TestPrefixIndexCutsOffBadPublisher(t *testing.T) {
	rl := indexRelay(t, "", "")
	good := relaytest.RunAgent(t, indexAgentConfig("good", startSimEngine(t, 0).URL(), 0, rl.Addr()))
	waitFor(t, "the good agent publishing", func() bool {
		return metric(t, rl, `computeflux_prefix_updates_total{agent="good",type="snapshot"}`) >= 1
	})
	keylessChat(t, rl, words("good", 8<<10), "q", false)
	waitFor(t, "the good agent's entries", func() bool { return good.Agent.IndexStats().Blocks >= 32 })
	waitFor(t, "them at the relay", func() bool {
		return rl.Relay.Scheduler().IndexStats().Entries == good.Agent.IndexStats().Blocks
	})
	goodEntries := rl.Relay.Scheduler().IndexStats().Entries

	cases := []struct {
		name   string
		frames func() []byte
		reason string
	}{
		{"out of order", func() []byte {
			return frames(t,
				transport.PrefixMsg{Type: transport.PrefixDelta, Seq: 3, Added: []uint64{7}}) // seq 2 expected
		}, "order"},
		{"malformed", func() []byte { return []byte{5, 1, 3, 0xff, 0xff, 0xff} }, "malformed"},
		{"oversized", func() []byte { return []byte{0xff, 0xff, 0xff, 0x7f} }, "oversized"},
		{"delta before snapshot", nil, "order"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			h, s := joinedPrefixStream(ctx, t, rl, fmt.Sprintf("bad%d", i))
			hello := transport.PrefixMsg{Type: transport.PrefixHello}
			var out []byte
			if tc.frames == nil {
				out = frames(t, hello, transport.PrefixMsg{Type: transport.PrefixDelta, Seq: 1, Added: []uint64{1, 2}})
			} else {
				out = frames(t, hello,
					transport.PrefixMsg{Type: transport.PrefixSnapshot, Seq: 1, First: true, Last: true, Added: []uint64{11, 12, 13, 14, 15}})
				if _, err := s.Write(out); err != nil {
					t.Fatal(err)
				}
				waitFor(t, "the bad publisher's snapshot merged", func() bool {
					return rl.Relay.Scheduler().IndexStats().Entries == goodEntries+5
				})
				out = tc.frames()
			}
			if _, err := s.Write(out); err != nil {
				t.Fatal(err)
			}
			if got := readReject(t, s); got == "" {
				t.Fatal("no reject reason")
			}
			waitFor(t, "the bad publisher's entries dropped", func() bool {
				return rl.Relay.Scheduler().IndexStats().Entries == goodEntries
			})
			if got := metric(t, rl, `computeflux_prefix_publishers_cut_off_total{reason="`+tc.reason+`"}`); got < 1 {
				t.Fatalf("cut-off metric for %s is %v", tc.reason, got)
			}
			// Cut off: a new stream is refused.
			s2, err := h.NewStream(ctx, rl.Info().ID, transport.PrefixProtocol)
			if err != nil {
				t.Fatal(err)
			}
			defer s2.Reset()
			if _, err := s2.Write(frames(t, hello,
				transport.PrefixMsg{Type: transport.PrefixSnapshot, Seq: 1, First: true, Last: true, Added: []uint64{21}})); err != nil {
				t.Fatal(err)
			}
			if got := readReject(t, s2); !strings.Contains(got, "cut off") {
				t.Fatalf("second stream: %q", got)
			}
			if got := rl.Relay.Scheduler().IndexStats().Entries; got != goodEntries {
				t.Fatalf("entries %d after the refused stream, want %d", got, goodEntries)
			}
		})
	}

	t.Run("other hashing config", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, s := joinedPrefixStream(ctx, t, rl, "other")
		if _, err := s.Write(frames(t, transport.PrefixMsg{Type: transport.PrefixHello, BlockTokens: 16})); err != nil {
			t.Fatal(err)
		}
		if got := readReject(t, s); !strings.Contains(got, "configuration") {
			t.Fatalf("reject %q", got)
		}
	})

	t.Run("not joined", func(t *testing.T) {
		h := newHost(t)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := h.Connect(ctx, rl.Info()); err != nil {
			t.Fatal(err)
		}
		s, err := h.NewStream(ctx, rl.Info().ID, transport.PrefixProtocol)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Reset()
		_, _ = s.Write(frames(t, transport.PrefixMsg{Type: transport.PrefixHello},
			transport.PrefixMsg{Type: transport.PrefixSnapshot, Seq: 1, First: true, Last: true, Added: []uint64{31}}))
		_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := s.Read(make([]byte, 1)); err == nil {
			t.Fatal("a peer that did not join got an answer")
		}
		if got := rl.Relay.Scheduler().IndexStats().Entries; got != goodEntries {
			t.Fatalf("entries %d, want %d", got, goodEntries)
		}
		if got := metric(t, rl, `computeflux_prefix_streams_refused_total{reason="not_joined"}`); got < 1 {
			t.Fatalf("refused metric %v", got)
		}
	})
	if got := good.Agent.IndexStats().Blocks; rl.Relay.Scheduler().IndexStats().Entries != got {
		t.Fatalf("the good agent's %d entries changed at the relay", got)
	}

	// Held dead (as gossip does), the agent's entries go; back alive, the
	// relay asks it for a snapshot and has them again.
	rl.Relay.Registry().SetDead("good", true)
	waitFor(t, "a dead agent's entries dropped", func() bool { return rl.Relay.Scheduler().IndexStats().Entries == 0 })
	rl.Relay.Registry().SetDead("good", false)
	waitFor(t, "the revived agent's snapshot", func() bool {
		return rl.Relay.Scheduler().IndexStats().Entries == good.Agent.IndexStats().Blocks
	})
	if got := good.Agent.IndexStats().Snapshots; got < 2 {
		t.Fatalf("%d snapshots sent, want the first and one after the resync", got)
	}
}

// joinedPrefixStream joins a new host to rl as name serving m1 and opens
// a prefix stream from it; the registration and the stream last until the
// test ends.
func joinedPrefixStream(ctx context.Context, t testing.TB, rl *relaytest.Relay, name string) (host.Host, network.Stream) {
	t.Helper()
	h := newHost(t)
	if err := h.Connect(ctx, rl.Info()); err != nil {
		t.Fatal(err)
	}
	m, err := transport.Join(ctx, h, rl.Info().ID, []byte(itToken), transport.JoinInfo{Name: name, Models: []string{"m1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	s, err := h.NewStream(ctx, rl.Info().ID, transport.PrefixProtocol)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Reset() })
	return h, s
}

func frames(t testing.TB, ms ...transport.PrefixMsg) []byte {
	t.Helper()
	var b []byte
	for i := range ms {
		var err error
		if b, err = transport.AppendPrefixFrame(b, &ms[i]); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

// readReject reads the relay's reject and returns its reason.
func readReject(t testing.TB, s network.Stream) string {
	t.Helper()
	_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
	var m transport.PrefixMsg
	if _, err := transport.NewPrefixReader(s).Next(&m); err != nil {
		t.Fatalf("reading the reject: %v", err)
	}
	if m.Type != transport.PrefixReject {
		t.Fatalf("got %s, want reject", m.Type)
	}
	return m.Reason
}

func testLogger() zerolog.Logger {
	if os.Getenv("PREFIX_TEST_LOG") != "" {
		return zerolog.New(os.Stderr).Level(zerolog.DebugLevel)
	}
	return zerolog.New(io.Discard)
}

// TestPrefixIndexToEveryRelay: an agent joined to two relays publishes its
// index to both, so a request through one relay teaches the other.
func TestPrefixIndexToEveryRelay(t *testing.T) {
	r1, r2 := indexRelay(t, "", ""), indexRelay(t, "", "")
	a := relaytest.RunAgent(t, indexAgentConfig("both", startSimEngine(t, 0).URL(), 0, r1.Addr(), r2.Addr()))
	for _, rl := range []*relaytest.Relay{r1, r2} {
		waitFor(t, "publishing to each relay", func() bool {
			return metric(t, rl, `computeflux_prefix_updates_total{agent="both",type="snapshot"}`) >= 1
		})
	}
	keylessChat(t, r1, words("multi", 8<<10), "q", false)
	waitFor(t, "the agent's index", func() bool { return a.Agent.IndexStats().Blocks >= 32 })
	for _, rl := range []*relaytest.Relay{r1, r2} {
		waitFor(t, "the same entries at both relays", func() bool {
			return rl.Relay.Scheduler().IndexStats().Entries == a.Agent.IndexStats().Blocks
		})
	}
	if got := a.Agent.IndexStats().Relays; got != 2 {
		t.Fatalf("publishing to %d relays", got)
	}
}
