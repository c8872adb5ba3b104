package relaytest_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// chat sends one streamed chat completion with a session key and returns
// the serving agent, the affinity header and the cached tokens from usage.
func chat(t *testing.T, c *relaytest.Cluster, session, text string) (agent, affinity string, cached int) {
	t.Helper()
	return chatVia(t, c.URL(), c.APIKey(), session, text)
}

// chatVia is chat through the relay at url.
func chatVia(t *testing.T, url, key, session, text string) (agent, affinity string, cached int) {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"stream":true,"stream_options":{"include_usage":true},"max_tokens":20,"messages":[{"role":"user","content":%q}]}`, simengine.DefaultModel, text)
	req, _ := http.NewRequest("POST", url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("X-Session-ID", session)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	cached = -1
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || line == "[DONE]" {
			continue
		}
		var ev struct {
			Usage *struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatal(err)
		}
		if ev.Usage != nil {
			cached = ev.Usage.Details.Cached
		}
	}
	if cached < 0 {
		t.Fatal("no usage in the stream")
	}
	return resp.Header.Get("X-ComputeFlux-Agent"), resp.Header.Get("X-ComputeFlux-Affinity"), cached
}

func TestCluster(t *testing.T) {
	ctx := context.Background()
	c, err := relaytest.Start(ctx, relaytest.Config{Engines: 2, Engine: simengine.Config{TimeScale: 100}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	text := simengine.Filler(7, 400)

	first, _, _ := chat(t, c, "s1", text)
	again, aff, cached := chat(t, c, "s1", text)
	if again != first || aff != "hit" || cached == 0 {
		t.Fatalf("second turn went to %s (%s, %d cached), first to %s", again, aff, cached, first)
	}

	// Kill the session's agent without a goodbye: the session's very next
	// request, sent at once, is served by the other agent (the killed one
	// leaves it unacknowledged).
	idx := map[string]int{"agent-0": 0, "agent-1": 1}[first]
	if err := c.KillAgent(idx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	other, _, _ := chat(t, c, "s1", text)
	if other == first || other == "" {
		t.Fatalf("request after the kill served by %q, want the other agent", other)
	}
	t.Logf("the session's next request after its agent was killed took %v", time.Since(start))
	if err := c.RestartAgent(ctx, idx); err != nil {
		t.Fatal(err)
	}
	waitAgents(t, c, 2)

	// A relay restart on the same identity and ports: agents rejoin.
	url := c.URL()
	if err := c.RestartRelay(ctx); err != nil {
		t.Fatal(err)
	}
	if c.URL() != url {
		t.Fatalf("relay moved from %s to %s", url, c.URL())
	}
	chat(t, c, "s2", text)

	// Slow an engine, add an engine.
	if err := c.SlowEngine(0, 5); err != nil {
		t.Fatal(err)
	}
	if got := c.Engine(0).Server.Stats().Slowdown; got != 5 {
		t.Fatalf("slowdown %v", got)
	}
	i, err := c.AddEngine(ctx)
	if err != nil || i != 2 {
		t.Fatalf("AddEngine = %d, %v", i, err)
	}
	waitAgents(t, c, 3)
}

// Several relays: every agent joins each and the relays peer, so a
// conversation's turns through different relays stay on one agent and hit
// its cache (by the shared session or the agents' prefix indexes).
func TestClusterOfRelays(t *testing.T) {
	ctx := context.Background()
	c, err := relaytest.Start(ctx, relaytest.Config{Relays: 3, Engines: 3, Engine: simengine.Config{TimeScale: 100}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	urls := c.URLs()
	if len(urls) != 3 || len(c.Relays()) != 3 || urls[0] != c.URL() {
		t.Fatalf("URLs %v, %d relays", urls, len(c.Relays()))
	}
	for i, r := range c.Relays() {
		if n := len(r.Registry().Agents()); n != 3 {
			t.Fatalf("relay %d holds %d agents, want 3", i, n)
		}
		if n := len(r.PeerRelays()); n != 2 {
			t.Fatalf("relay %d shares with %d relays, want 2", i, n)
		}
	}
	text := simengine.Filler(11, 400)
	for s := range 6 {
		session := fmt.Sprintf("s%d", s)
		first, _, _ := chatVia(t, urls[0], c.APIKey(), session, text)
		for i, u := range urls[1:] {
			// What relay 0 learnt reaches the others within moments;
			// until it has, a relay may place the turn anew.
			var got string
			var cached int
			relaytest.Eventually(t, fmt.Sprintf("relay %d to send %s to %s", i+1, session, first), func() bool {
				got, _, cached = chatVia(t, u, c.APIKey(), session, text)
				return got == first
			})
			if cached == 0 {
				t.Fatalf("%s through relay %d on %s: nothing cached", session, i+1, got)
			}
		}
	}
}

func waitAgents(t *testing.T, c *relaytest.Cluster, n int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for len(c.Relay().Registry().Agents()) != n {
		if time.Now().After(deadline) {
			t.Fatalf("relay has %d agents, want %d", len(c.Relay().Registry().Agents()), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
