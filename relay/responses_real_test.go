package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// simAgent is a sim engine on a loopback port with a package agent in front
// of it, joined to the relay over QUIC.
type simAgent struct {
	eng   *simengine.Server
	agent *relaytest.Agent
	stop  func()
}

// fastSim is a sim engine that answers fast: a few tokens, 200 times
// real speed.
var fastSim = simengine.Config{TimeScale: 200, DefaultMaxTokens: 8}

func startSimAgent(t testing.TB, rl *relaytest.Relay, name string) *simAgent {
	t.Helper()
	eng, stopEngine := relaytest.RunSimEngine(t, fastSim)
	a := relaytest.RunAgent(t, agent.Config{
		Relay:        rl.Relay.Addrs()[0].String(),
		Token:        itToken,
		Upstream:     eng.URL(),
		Name:         name,
		ListenAddrs:  []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Logger:       zerolog.New(io.Discard),
		MinBackoff:   20 * time.Millisecond,
		MaxBackoff:   500 * time.Millisecond,
		DrainTimeout: 2 * time.Second,
	})
	sa := &simAgent{eng: eng, agent: a}
	stopped := false
	sa.stop = func() {
		if stopped {
			return
		}
		stopped = true
		a.Stop()
		stopEngine()
	}
	t.Cleanup(sa.stop)
	return sa
}

// waitResponsesAgents waits until the named agents are joined listing the
// Responses API.
func waitResponsesAgents(t testing.TB, rl *relaytest.Relay, sas ...*simAgent) {
	t.Helper()
	waitFor(t, "agents recognised their engines", func() bool {
		for _, sa := range sas {
			if !slices.Contains(sa.agent.Engine().APIs, "/v1/responses") {
				return false
			}
		}
		return true
	})
	names := make([]string, len(sas))
	for i, sa := range sas {
		names[i] = sa.agent.Info().Name
	}
	waitAgents(t, rl, names...)
}

func postJSON(t testing.TB, url, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+itKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// TestResponsesThroughRealParts drives the Responses API through a relay,
// package agents and sim engines over QUIC: a conversation chained by
// previous_response_id stays on the engine that stores it and hits its
// cache; when that agent leaves, the follow-up gets OpenAI's 404.
func TestResponsesThroughRealParts(t *testing.T) {
	rl := startRelay(t, "", "")
	sas := map[string]*simAgent{}
	for _, n := range []string{"r1", "r2", "r3"} {
		sas[n] = startSimAgent(t, rl, n)
	}
	waitResponsesAgents(t, rl, sas["r1"], sas["r2"], sas["r3"])
	if e := sas["r1"].agent.Engine(); e.Kind != agent.EngineSim || e.KVCapacityTokens <= 0 {
		t.Fatalf("engine recognised as %+v", e)
	}

	type usage struct {
		InputTokens        int `json:"input_tokens"`
		InputTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
	}
	var r struct {
		ID    string `json:"id"`
		Usage usage  `json:"usage"`
	}
	sys := simengine.Filler(1, 400)
	resp, b := postJSON(t, rl.URL+"/v1/responses", fmt.Sprintf(`{"model":%q,"instructions":%q,"input":"Hello"}`, simengine.DefaultModel, sys))
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &r) != nil || r.ID == "" {
		t.Fatalf("first turn: %d %s", resp.StatusCode, b)
	}
	home := resp.Header.Get("X-ComputeFlux-Agent")
	for turn := 1; turn <= 4; turn++ {
		stream := turn%2 == 0
		resp, b = postJSON(t, rl.URL+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"turn %d","previous_response_id":%q,"stream":%v}`,
			simengine.DefaultModel, turn, r.ID, stream))
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-ComputeFlux-Agent") != home {
			t.Fatalf("turn %d: %d on %s (home %s): %s", turn, resp.StatusCode, resp.Header.Get("X-ComputeFlux-Agent"), home, b)
		}
		if stream {
			var last string
			for _, l := range strings.Split(string(b), "\n") {
				if d, ok := strings.CutPrefix(l, "data: "); ok {
					last = d
				}
			}
			if !strings.Contains(string(b), "event: response.created\n") || !strings.Contains(string(b), "event: response.output_text.delta\n") {
				t.Fatalf("turn %d: event names lost:\n%s", turn, b)
			}
			var ev struct {
				Type     string
				Response json.RawMessage
			}
			if json.Unmarshal([]byte(last), &ev) != nil || ev.Type != "response.completed" {
				t.Fatalf("turn %d: last event %s", turn, last)
			}
			b = ev.Response
		}
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatal(err)
		}
		if r.Usage.InputTokensDetails.CachedTokens < 400 {
			t.Fatalf("turn %d: cached %d of %d input tokens: the follow-up missed the cache", turn, r.Usage.InputTokensDetails.CachedTokens, r.Usage.InputTokens)
		}
	}
	// GET through the relay reaches the holder.
	req, _ := http.NewRequest(http.MethodGet, rl.URL+"/v1/responses/"+r.ID, nil)
	req.Header.Set("Authorization", "Bearer "+itKey)
	gr, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	gb, _ := io.ReadAll(gr.Body)
	gr.Body.Close()
	if gr.StatusCode != http.StatusOK || !strings.Contains(string(gb), r.ID) {
		t.Fatalf("GET: %d %s", gr.StatusCode, gb)
	}

	// The holder goes: the follow-up is OpenAI's 404, not another engine's
	// answer without the context.
	sas[home].stop()
	waitFor(t, "holder gone", func() bool {
		for _, a := range rl.Relay.Registry().Agents() {
			if a.Name == home {
				return false
			}
		}
		return true
	})
	resp, b = postJSON(t, rl.URL+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"again","previous_response_id":%q}`, simengine.DefaultModel, r.ID))
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(b), `"code":"previous_response_not_found"`) {
		t.Fatalf("after the holder left: %d %s", resp.StatusCode, b)
	}
	// A fresh conversation still works on the others.
	if resp, b = postJSON(t, rl.URL+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"new"}`, simengine.DefaultModel)); resp.StatusCode != http.StatusOK {
		t.Fatalf("new conversation: %d %s", resp.StatusCode, b)
	}
	// The sim engine does not serve /v1/messages: the relay translates.
	if resp, b = postJSON(t, rl.URL+"/v1/messages", fmt.Sprintf(`{"model":%q,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, simengine.DefaultModel)); resp.StatusCode != http.StatusOK ||
		!strings.Contains(string(b), `"stop_reason":"max_tokens"`) {
		t.Fatalf("/v1/messages: %d %s", resp.StatusCode, b)
	}
}

// TestOpenAINodeResponses drives the Responses API through the relay with
// the official OpenAI Node client (npm "openai", pinned): responses.create
// streamed and not, and a two-turn previous_response_id conversation. It
// is skipped, with the reason, when node or npm is missing or the registry
// is out of reach.
func TestOpenAINodeResponses(t *testing.T) {
	slow.Gate(t, "installs and runs the OpenAI SDK's Responses calls on Node")
	t.Parallel() // waits on npm and node, with its own relay
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := installOpenAINode(ctx, t, "openai@"+openaiNodeVersion)
	rl := startRelay(t, "", "")
	a, b := startSimAgent(t, rl, "n1"), startSimAgent(t, rl, "n2")
	waitResponsesAgents(t, rl, a, b)
	out := runNodeScript(ctx, t, "openai_responses.mjs", dir, "RELAY_URL="+rl.URL, "API_KEY="+itKey, "MODEL="+simengine.DefaultModel)
	var got struct {
		Text, StreamedText, SecondText string
		ID, StreamedID, SecondPrev     string
		Events                         []string
		Agents                         []string
		SecondCached                   int
		MissingError                   string
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("node output %q: %v", out, err)
	}
	t.Logf("node client saw %+v", got)
	if got.Text == "" || !strings.HasPrefix(got.ID, "resp_") {
		t.Errorf("non-streamed: %q %q", got.Text, got.ID)
	}
	if got.StreamedText == "" || got.Events[0] != "response.created" || got.Events[len(got.Events)-1] != "response.completed" ||
		!slices.Contains(got.Events, "response.output_text.delta") {
		t.Errorf("streamed: %q, events %v", got.StreamedText, got.Events)
	}
	if got.SecondPrev != got.ID || got.SecondText == "" || got.SecondCached == 0 || got.Agents[0] != got.Agents[1] {
		t.Errorf("second turn: previous %q (want %q), cached %d, agents %v", got.SecondPrev, got.ID, got.SecondCached, got.Agents)
	}
	if got.MissingError != "404 previous_response_not_found" {
		t.Errorf("unknown previous_response_id as the SDK sees it: %q", got.MissingError)
	}
}

// openaiNodeVersion pins the OpenAI Node client the Responses test runs.
const openaiNodeVersion = "7.59.0"
