package relay_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/llamaengine/llamatest"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/scheduler"
)

// llamaRouting is one policy's run of keyless multi-turn chat on real
// llama.cpp engines.
type llamaRouting struct {
	prompt, cached int // tokens over every request
	// held is what an ideal cache would serve: every turn's prompt
	// holds the whole last one, so a turn could reuse it all.
	held    int
	latency []time.Duration // per request, sorted
	agents  map[int]map[string]bool
}

func (r llamaRouting) hit() float64 { return float64(r.cached) / float64(max(r.prompt, 1)) }

func (r llamaRouting) quantile(q float64) time.Duration {
	return r.latency[min(int(q*float64(len(r.latency))), len(r.latency)-1)]
}

// runLlamaRouting serves one tiny GGUF on engines llama.cpp engines (two
// sequences each: its prompt cache holds two conversations), each behind
// an agent that publishes its prefixes, joined to one relay routing by
// policy. sessions conversations of turns turns each run at once, every
// conversation with its own system prompt of about 600 tokens, and no
// session key.
func runLlamaRouting(t testing.TB, policy scheduler.Policy, engines, sessions, turns int) llamaRouting {
	t.Helper()
	rl := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Token: []byte(itToken), APIKeys: []string{itKey},
		Logger: testLogger(), Policy: policy, Gossip: relay.GossipConfig{Disabled: true},
	})
	file := llamatest.Models(t, 1)[0]
	files := make([]string, engines)
	for i := range files {
		files[i] = file
	}
	var names []string
	for i, e := range llamatest.Engines(t, "tiny", files...) {
		name := fmt.Sprintf("a%d", i)
		names = append(names, name)
		relaytest.RunAgent(t, indexAgentConfig(name, e.URL, 0, rl.Addr()))
	}
	waitAgents(t, rl, names...)

	res := llamaRouting{agents: map[int]map[string]bool{}}
	client := &http.Client{Timeout: time.Minute} // a turn takes milliseconds; bound a stuck one
	var mu sync.Mutex
	var wg sync.WaitGroup
	for s := range sessions {
		res.agents[s] = map[string]bool{}
		wg.Go(func() {
			msgs := []map[string]string{{"role": "system", "content": words(fmt.Sprintf("s%d-", s), 600)}}
			last := 0
			for turn := range turns {
				msgs = append(msgs, map[string]string{"role": "user", "content": words(fmt.Sprintf("q%d.%d-", s, turn), 40)})
				b, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs, "max_tokens": 8})
				req, _ := http.NewRequest(http.MethodPost, rl.URL+"/v1/chat/completions", bytes.NewReader(b))
				req.Header.Set("Authorization", "Bearer "+itKey)
				sent := time.Now()
				resp, err := client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				took := time.Since(sent)
				var out struct {
					Choices []struct {
						Message struct {
							Content string `json:"content"`
						} `json:"message"`
					} `json:"choices"`
					Usage struct {
						Prompt  int `json:"prompt_tokens"`
						Details struct {
							Cached int `json:"cached_tokens"`
						} `json:"prompt_tokens_details"`
					} `json:"usage"`
				}
				if err := json.Unmarshal(body, &out); err != nil || resp.StatusCode != http.StatusOK || len(out.Choices) == 0 {
					t.Errorf("session %d turn %d: %d %s", s, turn, resp.StatusCode, body)
					return
				}
				msgs = append(msgs, map[string]string{"role": "assistant", "content": out.Choices[0].Message.Content})
				mu.Lock()
				res.prompt += out.Usage.Prompt
				res.cached += out.Usage.Details.Cached
				res.held += last
				last = out.Usage.Prompt
				res.latency = append(res.latency, took)
				res.agents[s][resp.Header.Get(relay.HeaderAgent)] = true
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	slices.Sort(res.latency)
	return res
}

// TestRealEnginesRouteByCache: keyless conversations on three real
// llama.cpp engines, whose prompt caches hold two conversations each. The
// product's routing (sticky, with the prefix index the agents publish)
// sends each conversation's turns to the engine that holds its prompt, so
// most prompt tokens come from the engines' caches; round-robin spreads the
// turns and finds a conversation's prompt only where it last was. Each
// conversation stays on one engine under sticky.
func TestRealEnginesRouteByCache(t *testing.T) {
	llamatest.Need(t)
	const engines, sessions, turns = 3, 5, 6
	var runs [2]llamaRouting
	for i, p := range []scheduler.Policy{scheduler.PolicySticky, scheduler.PolicyRoundRobin} {
		runs[i] = runLlamaRouting(t, p, engines, sessions, turns)
		if n := len(runs[i].latency); n != sessions*turns {
			t.Fatalf("%v: %d answers, want %d", p, n, sessions*turns)
		}
		moved := 0
		for _, a := range runs[i].agents {
			moved += len(a) - 1
		}
		t.Logf("%v: %d of %d prompt tokens cached (%.1f%%; %.1f%% of the %d a turn could reuse), latency p50 %v p90 %v, %d moves between agents",
			p, runs[i].cached, runs[i].prompt, 100*runs[i].hit(), 100*float64(runs[i].cached)/float64(runs[i].held), runs[i].held,
			runs[i].quantile(0.5).Round(time.Millisecond),
			runs[i].quantile(0.9).Round(time.Millisecond), moved)
	}
	sticky, rr := runs[0], runs[1]
	// Sticky: every turn after the first on its conversation's engine,
	// which still holds its last prompt. Round-robin, the test's check on
	// itself: routing that ignores the cache falls well short of that.
	if float64(sticky.cached) < 0.95*float64(sticky.held) {
		t.Errorf("sticky: %d prompt tokens cached, want at least 95%% of the %d the turns could reuse", sticky.cached, sticky.held)
	}
	if float64(rr.cached) >= 0.85*float64(rr.held) {
		t.Errorf("round-robin: %d prompt tokens cached of the %d the turns could reuse: the workload does not tell routing apart", rr.cached, rr.held)
	}
	for s, a := range sticky.agents {
		if len(a) != 1 {
			t.Errorf("sticky: conversation %d served by %d agents", s, len(a))
		}
	}
}
