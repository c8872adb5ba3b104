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

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// fastSim is a sim engine that answers fast: a few tokens, 200 times
// real speed.
var fastSim = simengine.Config{TimeScale: 200, DefaultMaxTokens: 8}

// responsesFleet runs a fast sim engine with a package agent in front of it
// for each name, joined to rl over QUIC, and waits until every agent is
// joined listing the Responses API.
func responsesFleet(t testing.TB, rl *relaytest.Relay, names ...string) []*relaytest.Agent {
	t.Helper()
	agents := make([]*relaytest.Agent, len(names))
	for i, name := range names {
		eng, _ := relaytest.RunSimEngine(t, fastSim)
		agents[i] = relaytest.RunAgent(t, relaytest.AgentConfig(name, itToken, eng.URL(), rl.Addr()))
	}
	waitFor(t, "agents recognised their engines", func() bool {
		for _, a := range agents {
			if !slices.Contains(a.Engine().APIs, "/v1/responses") {
				return false
			}
		}
		return true
	})
	waitAgents(t, rl, names...)
	return agents
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
	sas := map[string]*relaytest.Agent{}
	for _, a := range responsesFleet(t, rl, "r1", "r2", "r3") {
		sas[a.Name] = a
	}
	if e := sas["r1"].Engine(); e.Kind != agent.EngineSim || e.KVCapacityTokens <= 0 {
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
	sas[home].Stop()
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
	responsesFleet(t, rl, "n1", "n2")
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
