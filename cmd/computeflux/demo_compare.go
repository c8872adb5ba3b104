package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/scheduler"
)

// demoWorkload is the demo's comparison: long conversations, as a coding
// assistant or a chat over a document sees them. Every session starts with
// the same long system prompt and its own long context (a document, a
// code base), then grows by a question and an answer per turn. A miss
// costs a prefill of the whole history (3 to 8 s on the simulated engine's
// 25,000 tokens/s, queueing included); a hit only the new message.
type demoWorkload struct {
	Engines       int
	Sessions      int
	Turns         int
	SystemTokens  int           // system prompt shared by every session
	ContextTokens int           // each session's own context at its first turn
	TurnTokens    int           // each turn's new user message
	AnswerTokens  int           // max_tokens of every answer
	Think         time.Duration // mean pause between an answer and the next turn (uniform over ±50%), model time
	Stagger       time.Duration // between the starts of two conversations, model time
	TimeScale     float64       // engines this many times faster than real time
}

// demoCacheTokens is one simulated engine's KV cache (its default).
const demoCacheTokens = simengine.DefaultCacheBlocks * simengine.DefaultBlockSize

// sized fits each session's context to the engines' caches: the sessions
// sticky routing puts on one engine must fit its cache together, or even
// perfect routing would miss.
func (w demoWorkload) sized() (demoWorkload, error) {
	perEngine := (w.Sessions + w.Engines - 1) / w.Engines
	room := demoCacheTokens*85/100/perEngine - w.SystemTokens - w.Turns*(w.TurnTokens+w.AnswerTokens+16)
	w.ContextTokens = min(w.ContextTokens, room)
	if w.ContextTokens < 1000 {
		return w, fmt.Errorf("demo: %d sessions on %d engines do not fit the engines' caches with %d turns; use fewer sessions or more engines",
			w.Sessions, w.Engines, w.Turns)
	}
	return w, nil
}

// demoTurn is one answered turn.
type demoTurn struct {
	policy           scheduler.Policy
	session, turn    int
	ttft             time.Duration // model time
	prompt, cached   int
	agent, affinity  string
	err              error
	completionTokens int
}

// runComparison runs the workload through two fresh clusters at once, one
// routing sticky and one round-robin, prints every turn as it is answered
// and then a summary.
func runComparison(ctx context.Context, stdout io.Writer, w demoWorkload) error {
	w, err := w.sized()
	if err != nil {
		return err
	}
	policies := []scheduler.Policy{scheduler.PolicySticky, scheduler.PolicyRoundRobin}
	speed := "at real-time engine speed"
	if w.TimeScale != 1 {
		speed = fmt.Sprintf("engines %gx faster than real time, times below in model time", w.TimeScale)
	}
	fmt.Fprintf(stdout, "Comparing sticky routing with round-robin, side by side on two fresh clusters of %d engines (%s).\n", w.Engines, speed)
	fmt.Fprintf(stdout, "%d conversations of %d turns: a %s-token system prompt, %s tokens of context each, %s more per turn.\n",
		w.Sessions, w.Turns, thousands(w.SystemTokens), thousands(w.ContextTokens), thousands(w.TurnTokens+w.AnswerTokens))
	fmt.Fprintf(stdout, "Each engine's KV cache holds %s tokens; a cold prefill runs at %s tokens/s.\n\n",
		thousands(demoCacheTokens), thousands(int(simengine.DefaultPrefillTokensPerSec)))

	clusters := make([]*relaytest.Cluster, len(policies))
	var startErr error
	var wg sync.WaitGroup
	var mu sync.Mutex // guards startErr, results and stdout
	for i, p := range policies {
		wg.Go(func() {
			c, err := relaytest.Start(ctx, relaytest.Config{
				Engines: w.Engines,
				Engine:  simengine.Config{TimeScale: w.TimeScale, DefaultMaxTokens: w.AnswerTokens},
				Policy:  p,
			})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				startErr = errors.Join(startErr, fmt.Errorf("%s cluster: %w", p, err))
				return
			}
			clusters[i] = c
		})
	}
	wg.Wait()
	defer func() {
		for _, c := range clusters {
			if c != nil {
				c.Close()
			}
		}
	}()
	if startErr != nil {
		return startErr
	}

	system := "You are a careful assistant for a software team. " + simengine.Filler(7, w.SystemTokens)
	var results []demoTurn
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 5 * time.Minute}
	for i, p := range policies {
		for s := range w.Sessions {
			wg.Go(func() {
				// Conversations start apart, as people do; both policies
				// see the same starts and pauses.
				if !demoSleep(ctx, time.Duration(s)*w.Stagger, w.TimeScale) {
					return
				}
				history := []chatMsg{{"system", system}, {"user", "Here is the material for this conversation:\n" + simengine.Filler(uint64(1000+s), w.ContextTokens)}}
				for turn := 1; turn <= w.Turns; turn++ {
					history = append(history, chatMsg{"user", fmt.Sprintf("Question %d: ", turn) + simengine.Filler(uint64(s*100+turn), w.TurnTokens)})
					r, answer := demoRequest(ctx, client, clusters[i], w, fmt.Sprintf("demo-%d", s), history)
					r.policy, r.session, r.turn = p, s+1, turn
					mu.Lock()
					results = append(results, r)
					printTurn(stdout, r)
					mu.Unlock()
					if r.err != nil || ctx.Err() != nil {
						return
					}
					history = append(history, chatMsg{"assistant", answer})
					think := w.Think/2 + time.Duration(uint64(s*7919+turn*104729)%1000)*w.Think/1000
					if !demoSleep(ctx, think, w.TimeScale) {
						return
					}
				}
			})
		}
	}
	wg.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return printSummary(stdout, results, policies)
}

// demoSleep waits d of model time; false if ctx ended first.
func demoSleep(ctx context.Context, d time.Duration, scale float64) bool {
	t := time.NewTimer(time.Duration(float64(d) / scale))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

type chatMsg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// demoRequest sends one streamed turn and measures the time to its first
// token.
func demoRequest(ctx context.Context, client *http.Client, c *relaytest.Cluster, w demoWorkload, session string, history []chatMsg) (demoTurn, string) {
	body, _ := json.Marshal(map[string]any{"model": simengine.DefaultModel, "stream": true, "max_tokens": w.AnswerTokens,
		"stream_options": map[string]bool{"include_usage": true}, "messages": history})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.URL()+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return demoTurn{err: err}, ""
	}
	req.Header.Set("Authorization", "Bearer "+c.APIKey())
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return demoTurn{err: err}, ""
	}
	defer resp.Body.Close()
	r := demoTurn{agent: resp.Header.Get("X-ComputeFlux-Agent"), affinity: resp.Header.Get("X-ComputeFlux-Affinity")}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		r.err = fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		return r, ""
	}
	reply, err := bench.ReadStream(resp.Body, func() { r.ttft = time.Duration(float64(time.Since(start)) * w.TimeScale) })
	if err != nil {
		r.err = err
		return r, ""
	}
	r.prompt, r.cached, r.completionTokens = reply.PromptTokens, reply.CachedTokens, reply.CompletionTokens
	return r, reply.Answer
}

func printTurn(w io.Writer, r demoTurn) {
	if r.err != nil {
		fmt.Fprintf(w, "  %-11s  conversation %d, turn %d: failed: %v\n", r.policy, r.session, r.turn, r.err)
		return
	}
	fmt.Fprintf(w, "  %-11s  conversation %d, turn %d: first token after %6.2f s   %7s of %7s prompt tokens cached  (%s, affinity %s)\n",
		r.policy, r.session, r.turn, r.ttft.Seconds(), thousands(r.cached), thousands(r.prompt), r.agent, r.affinity)
}

// printSummary prints the medians per policy and the verdict.
func printSummary(w io.Writer, results []demoTurn, policies []scheduler.Policy) error {
	fmt.Fprintf(w, "\n%-12s  %11s  %11s  %11s  %10s  %6s\n", "policy", "TTFT median", "first turns", "later turns", "cache hits", "failed")
	medians := map[scheduler.Policy]time.Duration{}
	for _, p := range policies {
		var all, first, later []time.Duration
		var prompt, cached, failed int
		for _, r := range results {
			if r.policy != p {
				continue
			}
			if r.err != nil {
				failed++
				continue
			}
			all = append(all, r.ttft)
			if r.turn == 1 {
				first = append(first, r.ttft)
			} else {
				later = append(later, r.ttft)
			}
			prompt += r.prompt
			cached += r.cached
		}
		hit := 0.0
		if prompt > 0 {
			hit = 100 * float64(cached) / float64(prompt)
		}
		medians[p] = median(all)
		fmt.Fprintf(w, "%-12s  %9.2f s  %9.2f s  %9.2f s  %9.1f%%  %6d\n", p, median(all).Seconds(), median(first).Seconds(), median(later).Seconds(), hit, failed)
	}
	s, rr := medians[scheduler.PolicySticky], medians[scheduler.PolicyRoundRobin]
	if s <= 0 || rr <= 0 {
		return errors.New("demo: the comparison answered no turn")
	}
	fmt.Fprintf(w, "\nSticky routing: median time to first token %.1fx lower than round-robin (%.2f s against %.2f s).\n", float64(rr)/float64(s), s.Seconds(), rr.Seconds())
	fmt.Fprintln(w, "Round-robin sends each turn to another engine, which must prefill the whole conversation again;")
	fmt.Fprintln(w, "sticky sends it back to the engine that still holds it, which computes only the new message.")
	return nil
}

// median of ds (nearest rank, upper); 0 for none.
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// thousands formats n with comma separators.
func thousands(n int) string {
	s := fmt.Sprint(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}
