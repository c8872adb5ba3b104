package relay_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest"
)

// vllmFront makes a sim engine look like the engine of a report: an
// OpenAI-compatible server the agent recognises by its vllm:* metrics,
// that publishes no OpenAPI document (vLLM with --disable-fastapi-docs),
// serves /v1/responses, and answers a request that names no model it
// serves, such as the agent's empty probe, with vLLM's 404 for an unknown
// model; any path it lacks (/v1/messages among them) gets FastAPI's
// not-found page. generated counts the requests it passed to the engine.
type vllmFront struct {
	url       string
	generated atomic.Int64
}

func newVLLMFront(t testing.TB, upstream string) *vllmFront {
	t.Helper()
	f := &vllmFront{}
	notFound := func(w http.ResponseWriter, status int, body string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		io.WriteString(w, body)
	}
	f.url = relaytest.Front(t, upstream, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		p := r.URL.Path
		switch {
		case r.Method == http.MethodGet && p == "/v1/models":
			rec := httptest.NewRecorder()
			next.ServeHTTP(rec, r)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(rec.Code)
			w.Write(bytes.ReplaceAll(rec.Body.Bytes(), []byte(`"owned_by":"computeflux"`), []byte(`"owned_by":"vllm"`)))
		case r.Method == http.MethodGet && (p == "/metrics" || p == "/version" || strings.HasPrefix(p, "/v1/responses/")):
			next.ServeHTTP(w, r)
		case r.Method == http.MethodDelete && strings.HasPrefix(p, "/v1/responses/"):
			next.ServeHTTP(w, r)
		case r.Method == http.MethodPost && (p == "/v1/chat/completions" || p == "/v1/completions" || p == "/v1/responses"):
			body, _ := io.ReadAll(r.Body)
			var req struct {
				Model string `json:"model"`
			}
			if json.Unmarshal(body, &req) != nil {
				notFound(w, http.StatusBadRequest, `{"error":{"message":"JSON decode error","type":"BadRequestError","param":null,"code":400}}`)
				return
			}
			if req.Model != simengine.DefaultModel {
				notFound(w, http.StatusNotFound, fmt.Sprintf(`{"error":{"message":"The model `+"`%s`"+` does not exist.","type":"NotFoundError","param":null,"code":404}}`, req.Model))
				return
			}
			f.generated.Add(1)
			r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
			next.ServeHTTP(w, r)
		default:
			notFound(w, http.StatusNotFound, `{"detail":"Not Found"}`)
		}
	})
	return f
}

// TestIssueEngineServesResponses: behind the engine of the report (vLLM's
// metrics, no OpenAPI document, a 404 for the empty probe's missing
// model), the agent finds /v1/responses from the probe, generating
// nothing, and the relay serves the Responses API through it: created,
// streamed, and a follow-up by previous_response_id. (Before, the agent
// listed no API and the relay answered 404 "No agent's engine serves
// /v1/responses right now".) /v1/messages, which the engine lacks, is not
// listed as served.
func TestIssueEngineServesResponses(t *testing.T) {
	rl := startRelay(t, "", "")
	eng, stop := relaytest.RunSimEngine(t, fastSim)
	defer stop()
	f := newVLLMFront(t, eng.URL())
	ra := relaytest.RunAgent(t, indexAgentConfig("vllm-nodocs", f.url, 0, rl.Addr()))
	waitAgents(t, rl, "vllm-nodocs")
	waitFor(t, "the engine identified", func() bool { return ra.Agent.Engine().Kind == agent.EngineVLLM })
	if e := ra.Agent.Engine(); strings.Join(e.APIs, ",") != "/v1/responses" || len(e.UnknownAPIs) != 0 {
		t.Fatalf("engine %+v, want vllm serving /v1/responses", e)
	}
	if n := f.generated.Load(); n != 0 {
		t.Fatalf("the engine generated %d times before any client asked", n)
	}
	resp, b := postJSON(t, rl.URL+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"Say hello"}`, simengine.DefaultModel))
	var first struct{ ID, Object string }
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &first) != nil || first.Object != "response" {
		t.Fatalf("responses.create: %d %s", resp.StatusCode, b)
	}
	resp, b = postJSON(t, rl.URL+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"Say hello","stream":true}`, simengine.DefaultModel))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "response.completed") {
		t.Fatalf("streamed: %d %s", resp.StatusCode, b)
	}
	resp, b = postJSON(t, rl.URL+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"And then?","previous_response_id":%q}`, simengine.DefaultModel, first.ID))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"previous_response_id":"`+first.ID) {
		t.Fatalf("follow-up: %d %s", resp.StatusCode, b)
	}
	if n := f.generated.Load(); n != 3 {
		t.Fatalf("the engine generated %d times for three requests", n)
	}
}

// TestUnknownAPILearnedFromTheFirstAnswer: an engine whose answers to the
// probes show nothing (it checks bodies before routes) gets both optional
// APIs as unknown, and while no agent is known to serve /v1/responses the
// relay tries one whose support is unknown. An engine that lacks the route
// answers with its 404: the agent learns it, the relay tries the next
// agent or, with none left, answers OpenAI's 404 "No agent's engine serves
// /v1/responses right now". One that serves it answers, and the agent
// learns that.
func TestUnknownAPILearnedFromTheFirstAnswer(t *testing.T) {
	rl := startRelay(t, "", "")
	lacking := newParseFirstEngine(t, false)
	rb := relaytest.RunAgent(t, indexAgentConfig("lacking", lacking.URL(), 0, rl.Addr()))
	waitAgents(t, rl, "lacking")
	if e := rb.Agent.Engine(); len(e.APIs) != 0 || len(e.UnknownAPIs) != 2 {
		t.Fatalf("engine %+v, want both optional APIs unknown", e)
	}
	resp, b := postJSON(t, rl.URL+"/v1/responses", `{"model":"m1","input":"Say hello"}`)
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(b), "No agent's engine serves /v1/responses") || lacking.routed.Load() != 1 {
		t.Fatalf("only a lacking engine: %d %s (tried there %d times)", resp.StatusCode, b, lacking.routed.Load())
	}
	if e := rb.Agent.Engine(); strings.Join(e.UnknownAPIs, ",") != "/v1/messages" || len(e.APIs) != 0 {
		t.Fatalf("the lacking engine's agent learned %+v", e)
	}

	g := newParseFirstEngine(t, true)
	ra := relaytest.RunAgent(t, indexAgentConfig("maybe", g.URL(), 0, rl.Addr()))
	waitAgents(t, rl, "maybe")
	for i := range 3 {
		resp, b := postJSON(t, rl.URL+"/v1/responses", `{"model":"m1","input":"Say hello"}`)
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-ComputeFlux-Agent") != "maybe" {
			t.Fatalf("request %d: %d from %q: %s", i, resp.StatusCode, resp.Header.Get("X-ComputeFlux-Agent"), b)
		}
	}
	if e := ra.Agent.Engine(); strings.Join(e.APIs, ",") != "/v1/responses" {
		t.Fatalf("the serving agent did not learn: %+v", e)
	}
	if n := lacking.generated.Load() + lacking.routed.Load(); n != 1 {
		t.Fatalf("the lacking engine was asked %d times, want once (its first answer settles it)", n)
	}
}

// parseFirstEngine is an OpenAI-compatible server that reads every POST
// body before routing (a 400 for a body that is not JSON, whatever the
// path): its answers to the agent's probes show nothing. With responses
// it serves /v1/responses; every route it lacks is a 404 page.
type parseFirstEngine struct {
	*relaytest.FakeEngine
	generated, routed atomic.Int64
}

func newParseFirstEngine(t testing.TB, responses bool) *parseFirstEngine {
	g := &parseFirstEngine{FakeEngine: relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "parse-first"})}
	g.SetAnswer(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.NotFound(w, r)
			return
		}
		var req struct{ Model string }
		if json.NewDecoder(r.Body).Decode(&req) != nil {
			http.Error(w, `{"error":"invalid JSON"}`, http.StatusBadRequest)
			return
		}
		if r.URL.Path == "/v1/responses" {
			g.routed.Add(1)
		}
		if r.URL.Path != "/v1/chat/completions" && (r.URL.Path != "/v1/responses" || !responses) {
			http.NotFound(w, r)
			return
		}
		g.generated.Add(1)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"resp_pf_1","object":"response","status":"completed","model":"m1","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hello"}]}],"usage":{"input_tokens":3,"output_tokens":1,"total_tokens":4}}`)
	})
	return g
}
