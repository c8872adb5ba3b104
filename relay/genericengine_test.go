package relay_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
)

// genericEngine is an OpenAI-compatible server the agent recognises as
// nothing (LM Studio, LocalAI, a vLLM fork without its metrics): models,
// chat completions and the Responses API, 404 for everything else, no
// /metrics, no OpenAPI document. generated counts the requests it answered
// as real ones.
type genericEngine struct {
	*relaytest.FakeEngine
	generated atomic.Int64
}

func newGenericEngine(t testing.TB) *genericEngine {
	g := &genericEngine{FakeEngine: relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "generic"})}
	g.SetAnswer(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || (r.URL.Path != "/v1/responses" && r.URL.Path != "/v1/chat/completions") {
			http.NotFound(w, r)
			return
		}
		var req struct {
			Model string `json:"model"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Model == "" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":{"message":"invalid request","type":"invalid_request_error"}}`)
			return
		}
		g.generated.Add(1)
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Path == "/v1/responses" {
			io.WriteString(w, `{"id":"resp_generic_1","object":"response","status":"completed","model":"m1","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hello"}]}],"usage":{"input_tokens":3,"output_tokens":1,"total_tokens":4}}`)
			return
		}
		io.WriteString(w, `{"id":"x","object":"chat.completion","model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}`)
	})
	return g
}

// TestGenericEngineServesResponses: a generic OpenAI-compatible engine
// that serves /v1/responses and is recognised as nothing gets the
// Responses API through the real agent and relay (before, the relay
// answered 404 "No agent's engine serves /v1/responses right now"), and
// finding that out made the engine generate nothing.
func TestGenericEngineServesResponses(t *testing.T) {
	rl := startRelay(t, "", "")
	g := newGenericEngine(t)
	ra := relaytest.RunAgent(t, indexAgentConfig("generic", g.URL(), 0, rl.Addr()))
	waitAgents(t, rl, "generic") // joined with what the first refresh found
	if n := g.generated.Load(); n != 0 {
		t.Fatalf("the engine generated %d times before any client asked", n)
	}
	// As the OpenAI SDKs send it.
	resp, b := postJSON(t, rl.URL+"/v1/responses", `{"model":"m1","input":"Say hello"}`)
	if resp.StatusCode != http.StatusOK || resp.Header.Get(relay.HeaderAgent) != "generic" {
		t.Fatalf("status %d from %q: %s", resp.StatusCode, resp.Header.Get(relay.HeaderAgent), b)
	}
	if e := ra.Agent.Engine(); e.Kind != agent.EngineUnknown || strings.Join(e.APIs, ",") != "/v1/responses" {
		t.Fatalf("engine %+v, want not recognised, serving /v1/responses", e)
	}
	var out struct {
		ID     string `json:"id"`
		Object string `json:"object"`
	}
	if err := json.Unmarshal(b, &out); err != nil || out.Object != "response" {
		t.Fatalf("answer %s: %v", b, err)
	}
	if n := g.generated.Load(); n != 1 {
		t.Fatalf("the engine generated %d times for one request", n)
	}
	// The Messages API, which the engine lacks, is translated to chat.
	if resp, b := postJSON(t, rl.URL+"/v1/messages", `{"model":"m1","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`); resp.StatusCode != http.StatusOK ||
		!strings.Contains(string(b), `"type":"message"`) || !strings.Contains(string(b), `"text":"hello"`) {
		t.Fatalf("/v1/messages: status %d: %s", resp.StatusCode, b)
	}
}
