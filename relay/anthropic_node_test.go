package relay_test

import (
	"context"
	"encoding/json"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent/llamaengine/llamatest"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// anthropicSDKVersion pins Anthropic's TypeScript SDK the test runs.
const anthropicSDKVersion = "1.10.0"

// anthropicSeen is what anthropic_client.mjs prints.
type anthropicSeen struct {
	Usage []struct {
		InputTokens          int64 `json:"input_tokens"`
		OutputTokens         int64 `json:"output_tokens"`
		CacheReadInputTokens int64 `json:"cache_read_input_tokens"`
	}
	Created  struct{ ID, Type, Role, Text, Stop string }
	Streamed struct {
		Text, Deltas, Stop string
		Events             []string
	}
	Tool struct {
		Stop, Name, ID string
		Input          map[string]string
	}
	StreamedTool struct {
		Stop, Name string
		Input      map[string]string
	}
	AfterTool struct {
		Stop, Text string
		Types      []string
	}
	AuthError, ModelError string
}

// TestAnthropicSDK drives the Messages API with Anthropic's own SDK (npm
// @anthropic-ai/sdk, its x-api-key header) through a real relay and agent
// over QUIC, behind engines that lack /v1/messages: the sim engine and a
// real llama.cpp engine. Created and streamed, with a system prompt, a
// forced tool call created and streamed and its result sent back; usage in
// Anthropic's terms, the cached prompt prefix as cache_read_input_tokens
// (the sim engine's cache); errors as the SDK's typed errors; and the usage
// ledger counts every request with the tokens the SDK saw. It is skipped,
// with the reason, when node or npm is missing or the registry is out of
// reach (and for llama.cpp, as the real-engine tests are).
func TestAnthropicSDK(t *testing.T) {
	slow.Gate(t, "installs and runs the Anthropic SDK on Node")
	t.Parallel() // waits on npm and node, with its own relays
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir := installOpenAINode(ctx, t, "@anthropic-ai/sdk@"+anthropicSDKVersion)
	for _, engine := range []string{"sim", "llama.cpp"} {
		t.Run(engine, func(t *testing.T) {
			l, err := ledger.Open(ledger.Config{Path: filepath.Join(t.TempDir(), "usage.db")})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			rl := relaytest.ServeRelay(t, relay.Config{P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Token: []byte(itToken),
				APIKeys: []string{itKey}, Logger: zerolog.New(io.Discard), Ledger: l})
			model := simengine.DefaultModel
			if engine == "sim" {
				eng, stop := relaytest.RunSimEngine(t, fastSim)
				defer stop()
				relaytest.RunAgent(t, indexAgentConfig("a1", eng.URL(), 0, rl.Addr()))
			} else {
				llamatest.Need(t)
				model = "tiny"
				e := llamatest.Engines(t, model, llamatest.Models(t, 1)[0])[0]
				relaytest.RunAgent(t, indexAgentConfig("a1", e.URL, 0, rl.Addr()))
			}
			waitAgents(t, rl, "a1")
			start := time.Now()
			out := runNodeScript(ctx, t, "anthropic_client.mjs", dir, "RELAY_URL="+rl.URL, "API_KEY="+itKey, "MODEL="+model)
			t.Logf("the SDK's calls took %v", time.Since(start).Round(time.Millisecond))
			var got anthropicSeen
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("node output %q: %v", out, err)
			}
			t.Logf("Anthropic SDK saw %s", out)
			if c := got.Created; c.Type != "message" || c.Role != "assistant" || !strings.HasPrefix(c.ID, "msg_") || c.Text == "" || c.Stop != "max_tokens" {
				t.Errorf("messages.create: %+v", c)
			}
			s := got.Streamed
			if s.Text == "" || s.Deltas != s.Text || s.Stop != "max_tokens" || s.Events[0] != "message_start" || s.Events[len(s.Events)-1] != "message_stop" ||
				!slices.Contains(s.Events, "content_block_delta") || !slices.Contains(s.Events, "message_delta") {
				t.Errorf("messages.stream: %+v", s)
			}
			for _, c := range []struct {
				name, stop, tool string
				input            map[string]string
			}{{"created", got.Tool.Stop, got.Tool.Name, got.Tool.Input}, {"streamed", got.StreamedTool.Stop, got.StreamedTool.Name, got.StreamedTool.Input}} {
				if c.stop != "tool_use" || c.tool != "get_weather" || (c.input["city"] != "Paris" && c.input["city"] != "Oslo") ||
					(c.input["unit"] != "c" && c.input["unit"] != "f") {
					t.Errorf("%s tool call: stop %q, tool %q, input %v", c.name, c.stop, c.tool, c.input)
				}
			}
			if a := got.AfterTool; a.Text == "" || !slices.Equal(a.Types, []string{"text"}) {
				t.Errorf("after the tool's result: %+v", a)
			}
			if got.AuthError != "AuthenticationError 401 authentication_error" || got.ModelError != "NotFoundError 404 not_found_error" {
				t.Errorf("errors as the SDK types them: auth %q, model %q", got.AuthError, got.ModelError)
			}
			var prompt, cached, completion int64
			for _, u := range got.Usage {
				if u.InputTokens+u.CacheReadInputTokens == 0 || u.OutputTokens == 0 {
					t.Errorf("usage %+v", u)
				}
				prompt += u.InputTokens + u.CacheReadInputTokens
				cached += u.CacheReadInputTokens
				completion += u.OutputTokens
			}
			if got.Usage[1].CacheReadInputTokens == 0 {
				t.Errorf("the second identical prompt found nothing cached: %+v", got.Usage[1])
			}
			// The ledger: every request the SDK sent, with its tokens.
			if err := l.Flush(); err != nil {
				t.Fatal(err)
			}
			rep, err := l.Usage(time.Now().Add(-time.Hour), ledger.ByClient)
			if err != nil {
				t.Fatal(err)
			}
			want := ledger.Counts{Requests: int64(len(got.Usage)) + 1, PromptTokens: prompt, CachedTokens: cached, CompletionTokens: completion, Errors: 1}
			tot := rep.Total
			if tot.Requests != want.Requests || tot.PromptTokens != want.PromptTokens || tot.CachedTokens != want.CachedTokens ||
				tot.CompletionTokens != want.CompletionTokens || tot.Errors != want.Errors || tot.Estimated != 0 {
				t.Errorf("ledger %+v, want %d requests (one of them the unknown model's, an error), %d prompt, %d cached, %d completion tokens, none estimated",
					tot, want.Requests, prompt, cached, completion)
			}
		})
	}
}
