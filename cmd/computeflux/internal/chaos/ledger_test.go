package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest/ports"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// The usage ledger through real processes: a relay with no ledger flag (the
// ledger is on by default, beside the relay's identity file), two sim
// engines and their agents. Clients send streamed and non-streamed
// requests; the ledger's totals (the admin API's usage report) must equal
// what the clients saw in their answers' usage, to the token. A client with
// a small daily budget is refused with insufficient_quota once it is used
// up. The relay is SIGKILLed under load and started again: the totals
// continue, the requests lost are at most those that finished in the last
// flush intervals before the kill, and none is counted twice; the binary's
// own `computeflux usage` shows the totals.

// usageSeen is the usage of answers as their clients saw it.
type usageSeen struct {
	Requests         int64 `json:"requests"`
	PromptTokens     int64 `json:"prompt_tokens"`
	CachedTokens     int64 `json:"cached_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	Estimated        int64 `json:"estimated"`
	Errors           int64 `json:"errors"`
}

func (u *usageSeen) add(o usageSeen) {
	u.Requests += o.Requests
	u.PromptTokens += o.PromptTokens
	u.CachedTokens += o.CachedTokens
	u.CompletionTokens += o.CompletionTokens
}

// preamble starts alice's and bob's questions, so that their engines'
// prefix caches serve part of each prompt.
var preamble = strings.Repeat("The ledger keeps aggregates per client, model and hour. ", 8)

// ledgerFlush is the ledger's flush interval (ledger.DefaultFlushInterval).
const ledgerFlush = 2 * time.Second

// lossWindow bounds what a SIGKILL may lose: the requests that finished in
// the last flush interval, plus a second for the commit in flight on a
// busy machine.
const lossWindow = ledgerFlush + time.Second

func TestLedgerRealProcesses(t *testing.T) {
	slow.Gate(t, "runs the computeflux binary as processes")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()
	keys := map[string]string{"alice": "sk-alice-" + randomHex(8), "bob": "sk-bob-" + randomHex(8),
		"carol": "sk-carol-" + randomHex(8), "dave": "sk-dave-" + randomHex(8)}
	const daveBudget = 400
	clients := fmt.Sprintf("clients:\n  - name: alice\n    keys: [%s]\n  - name: bob\n    keys: [%s]\n"+
		"  - name: carol\n    keys: [%s]\n  - name: dave\n    keys: [%s]\n    budget: {tokens_per_day: %d}\n",
		keys["alice"], keys["bob"], keys["carol"], keys["dave"], daveBudget)
	if err := os.WriteFile(filepath.Join(dir, "clients.yaml"), []byte(clients), 0o600); err != nil {
		t.Fatal(err)
	}
	// Fixed addresses, so that the restarted relay is where the agents and
	// clients look for it.
	httpAddr, p2pPort := ports.Free(t, "tcp"), ports.Free(t, "udp")
	_, port, _ := net.SplitHostPort(p2pPort)
	c := newCluster(clusterSpec{
		Name: "ledger", Binary: binary, Dir: dir, Agents: 2,
		RelayArgs: []string{"--clients-file", filepath.Join(dir, "clients.yaml"),
			"--listen", httpAddr, "--p2p-listen", "/ip4/127.0.0.1/udp/" + port + "/quic-v1"},
		EngineArgs: []string{"--time-scale", "50"},
		AgentArgs:  []string{"--drain-timeout", "2s"},
		Progress:   testWriter{t},
	})
	defer c.stop()
	if err := c.start(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "relay-usage.db")); err != nil {
		t.Fatalf("no ledger file beside the identity %s: %v", filepath.Join(dir, "relay.key"), err)
	}
	hc := &http.Client{Timeout: 30 * time.Second}
	defer hc.CloseIdleConnections()

	// Totals: alice and bob see their usage (non-streamed answers, and
	// streams that ask for it); carol's streams do not ask for it, so she
	// must get no usage chunk, and her counts are those of the same
	// request sent without streaming (the sim engine is deterministic in
	// prompt and completion tokens).
	seen := map[string]*usageSeen{"alice": {}, "bob": {}, "carol": {}}
	const n = 12
	for i := range n {
		for _, who := range []string{"alice", "bob"} {
			msg := fmt.Sprintf("%s%s asks question %d about the ledger", preamble, who, i)
			for _, mode := range []string{"json", "stream-usage"} {
				u, chunk, err := ask(ctx, hc, c.relayURL, keys[who], msg, mode, 8+i)
				if err != nil {
					t.Fatalf("%s %s %d: %v", who, mode, i, err)
				}
				if !chunk {
					t.Fatalf("%s %s %d: no usage in the answer", who, mode, i)
				}
				seen[who].add(u)
			}
		}
		msg := fmt.Sprintf("carol asks question %d without usage", i)
		u, _, err := ask(ctx, hc, c.relayURL, keys["carol"], msg, "json", 8+i)
		if err != nil {
			t.Fatal(err)
		}
		seen["carol"].add(u)
		u.CachedTokens = 0
		_, chunk, err := ask(ctx, hc, c.relayURL, keys["carol"], msg, "stream", 8+i)
		if err != nil {
			t.Fatal(err)
		}
		if chunk {
			t.Fatalf("carol's stream %d carries a usage chunk she did not ask for", i)
		}
		seen["carol"].add(u)
	}
	if seen["alice"].CachedTokens == 0 || seen["bob"].CachedTokens == 0 {
		t.Fatalf("no cached tokens in the answers (%+v): the shared preamble should hit the engines' caches", seen)
	}
	got := waitUsage(ctx, t, c, hc, func(r map[string]usageSeen) bool {
		return r["alice"].Requests == 2*n && r["bob"].Requests == 2*n && r["carol"].Requests == 2*n
	})
	for _, who := range []string{"alice", "bob"} {
		g, w := got[who], *seen[who]
		if g != w {
			t.Errorf("%s: ledger %+v, answers said %+v", who, g, w)
		}
	}
	if g, w := got["carol"], *seen["carol"]; g.PromptTokens != w.PromptTokens || g.CompletionTokens != w.CompletionTokens ||
		g.CachedTokens < w.CachedTokens || g.CachedTokens > g.PromptTokens || g.Estimated != 0 {
		t.Errorf("carol: ledger %+v, want prompt %d, completion %d, cached at least %d, none estimated",
			g, w.PromptTokens, w.CompletionTokens, w.CachedTokens)
	}
	t.Logf("totals: ledger %+v", got)

	// Budget: dave is served until his day's tokens reach the budget, then
	// refused with insufficient_quota and when it resets.
	var daveUsed int64
	served := 0
	for i := 0; ; i++ {
		if i > 100 {
			t.Fatalf("dave never refused after %d tokens (budget %d)", daveUsed, daveBudget)
		}
		u, _, err := ask(ctx, hc, c.relayURL, keys["dave"], fmt.Sprintf("dave asks %d", i), "json", 30)
		var qe *quotaError
		if errors.As(err, &qe) {
			if daveUsed < daveBudget {
				t.Fatalf("dave refused after %d tokens, under his budget of %d: %v", daveUsed, daveBudget, err)
			}
			if qe.retryAfter <= 0 || !strings.Contains(qe.message, "resets at") {
				t.Fatalf("refusal without when it resets: %+v", qe)
			}
			t.Logf("budget: dave served %d requests, %d tokens (budget %d), then %d %s: %s (Retry-After %ds)",
				served, daveUsed, daveBudget, http.StatusTooManyRequests, qe.code, qe.message, qe.retryAfter)
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if daveUsed >= daveBudget {
			t.Fatalf("dave served at %d tokens, over his budget of %d", daveUsed, daveBudget)
		}
		daveUsed += u.PromptTokens + u.CompletionTokens
		served++
	}

	// SIGKILL under load, then restart.
	before := got["alice"]
	var mu sync.Mutex
	var done []time.Time // when each answered request of the load finished
	var doneTokens usageSeen
	inflight := 0
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for j := 0; ; j++ {
				select {
				case <-stop:
					return
				default:
				}
				mu.Lock()
				inflight++
				mu.Unlock()
				u, _, err := ask(ctx, hc, c.relayURL, keys["alice"], "alice under load", "json", 4)
				mu.Lock()
				inflight--
				if err == nil {
					done = append(done, time.Now())
					doneTokens.add(u)
				}
				mu.Unlock()
				if err != nil {
					return // the relay is gone
				}
			}
		})
	}
	time.Sleep(3*time.Second + time.Duration(rand.Int64N(int64(2*time.Second)))) // load for a random while before the kill
	mu.Lock()
	killedAt := time.Now()
	c.relay.kill()
	answered, pending := len(done), inflight
	var recent int
	for _, d := range done {
		if killedAt.Sub(d) <= lossWindow {
			recent++
		}
	}
	mu.Unlock()
	close(stop)
	wg.Wait()
	if err := c.startRelay(); err != nil {
		t.Fatal(err)
	}
	after, err := usageByClient(ctx, c, hc)
	if err != nil {
		t.Fatal(err)
	}
	kept := after["alice"].Requests - before.Requests
	lost := int64(answered) - kept
	t.Logf("SIGKILL: %d load requests answered before the kill (%d in flight), %d in the last %s; the ledger kept %d, lost %d",
		answered, pending, recent, lossWindow, kept, lost)
	if kept > int64(answered+pending) {
		t.Errorf("ledger counts %d load requests, more than the %d answered and %d in flight: counted twice", kept, answered, pending)
	}
	if lost > int64(recent) {
		t.Errorf("lost %d requests, more than the %d that finished in the last %s before the kill", lost, recent, lossWindow)
	}
	perPrompt := doneTokens.PromptTokens / int64(answered)
	if g := after["alice"].PromptTokens - before.PromptTokens; g != kept*perPrompt {
		t.Errorf("ledger has %d prompt tokens for %d load requests of %d each", g, kept, perPrompt)
	}

	// Totals continue after the restart.
	waitRouting(ctx, t, c, hc, keys["bob"])
	bobBefore := after["bob"]
	var more usageSeen
	for i := range 5 {
		u, _, err := ask(ctx, hc, c.relayURL, keys["bob"], fmt.Sprintf("bob after the restart %d", i), "stream-usage", 6)
		if err != nil {
			t.Fatal(err)
		}
		more.add(u)
	}
	final := waitUsage(ctx, t, c, hc, func(r map[string]usageSeen) bool { return r["bob"].Requests == bobBefore.Requests+5 })
	want := bobBefore
	want.add(more)
	if final["bob"] != want {
		t.Errorf("bob after the restart: ledger %+v, want %+v", final["bob"], want)
	}

	// What an operator reads: `computeflux usage` against the admin API.
	out, err := exec.CommandContext(ctx, binary, "usage", "--admin-url", c.adminURL,
		"--admin-key-file", filepath.Join(dir, "admin-key"), "--since", "24h", "--format", "csv").Output()
	if err != nil {
		t.Fatalf("computeflux usage: %v\n%s", err, out)
	}
	rows := map[string][]string{}
	recs, err := csv.NewReader(bytes.NewReader(out)).ReadAll()
	if err != nil || len(recs) < 2 {
		t.Fatalf("computeflux usage printed %q: %v", out, err)
	}
	for _, r := range recs[1:] {
		rows[r[0]] = r
	}
	for _, who := range []string{"alice", "bob"} {
		u := final[who]
		r := rows[who]
		if len(r) < 6 || r[1] != fmt.Sprint(u.Requests) || r[2] != fmt.Sprint(u.PromptTokens) {
			t.Errorf("computeflux usage row %v for %s, want %d requests and %d prompt tokens\n%s", r, who, u.Requests, u.PromptTokens, out)
		}
	}
	t.Logf("computeflux usage after the SIGKILL and restart:\n%s", out)
}

// quotaError is a 429 insufficient_quota answer.
type quotaError struct {
	code, message string
	retryAfter    int
}

func (e *quotaError) Error() string { return "429 " + e.code + ": " + e.message }

// ask sends one chat request as key: mode is "json", "stream-usage" (a
// stream that asks for usage) or "stream" (one that does not). It returns
// the usage the answer carried and whether it carried one.
func ask(ctx context.Context, hc *http.Client, url, key, msg, mode string, maxTokens int) (usageSeen, bool, error) {
	body := map[string]any{"model": simengine.DefaultModel, "max_tokens": maxTokens,
		"messages": []map[string]string{{"role": "user", "content": msg}}}
	if mode != "json" {
		body["stream"] = true
	}
	if mode == "stream-usage" {
		body["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(b))
	if err != nil {
		return usageSeen{}, false, err
	}
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return usageSeen{}, false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		rb, _ := io.ReadAll(resp.Body)
		var e struct {
			Error struct {
				Type, Code, Message string
			}
		}
		if resp.StatusCode == http.StatusTooManyRequests && json.Unmarshal(rb, &e) == nil && e.Error.Type == "insufficient_quota" {
			ra := 0
			fmt.Sscan(resp.Header.Get("Retry-After"), &ra)
			return usageSeen{}, false, &quotaError{code: e.Error.Code, message: e.Error.Message, retryAfter: ra}
		}
		return usageSeen{}, false, fmt.Errorf("status %d: %s", resp.StatusCode, rb)
	}
	type usageJSON struct {
		PromptTokens     int64 `json:"prompt_tokens"`
		CompletionTokens int64 `json:"completion_tokens"`
		Details          struct {
			CachedTokens int64 `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	}
	var u *usageJSON
	if mode == "json" {
		var a struct{ Usage *usageJSON }
		if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
			return usageSeen{}, false, err
		}
		u = a.Usage
	} else {
		sc := bufio.NewScanner(resp.Body)
		finished := false
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			if data == "[DONE]" {
				finished = true
				break
			}
			var ch struct {
				Usage *usageJSON
				Error any
			}
			if err := json.Unmarshal([]byte(data), &ch); err != nil {
				return usageSeen{}, false, err
			}
			if ch.Error != nil {
				return usageSeen{}, false, fmt.Errorf("stream error: %s", data)
			}
			if ch.Usage != nil {
				u = ch.Usage
			}
		}
		if !finished {
			return usageSeen{}, false, fmt.Errorf("stream ended without [DONE]: %v", sc.Err())
		}
	}
	if u == nil {
		return usageSeen{Requests: 1}, false, nil
	}
	return usageSeen{Requests: 1, PromptTokens: u.PromptTokens, CachedTokens: u.Details.CachedTokens, CompletionTokens: u.CompletionTokens}, true, nil
}

// usageByClient reads the ledger's report by client from the admin API.
func usageByClient(ctx context.Context, c *cluster, hc *http.Client) (map[string]usageSeen, error) {
	var rep struct {
		Rows []struct {
			Key string `json:"key"`
			usageSeen
		} `json:"rows"`
	}
	if err := c.adminDo(ctx, hc, http.MethodGet, "/admin/v1/usage?since=24h&by=client", &rep); err != nil {
		return nil, err
	}
	out := map[string]usageSeen{}
	for _, r := range rep.Rows {
		out[r.Key] = r.usageSeen
	}
	return out, nil
}

// waitUsage polls the usage report until done says it is complete (the
// ledger flushes every 2 s).
func waitUsage(ctx context.Context, t *testing.T, c *cluster, hc *http.Client, done func(map[string]usageSeen) bool) map[string]usageSeen {
	t.Helper()
	deadline := time.Now().Add(6 * ledgerFlush)
	for {
		r, err := usageByClient(ctx, c, hc)
		if err != nil {
			t.Fatal(err)
		}
		if done(r) {
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ledger did not reach the expected counts: %+v", r)
		}
		time.Sleep(100 * time.Millisecond) // polling, with a deadline
	}
}

// waitRouting waits until the restarted relay serves a request.
func waitRouting(ctx context.Context, t *testing.T, c *cluster, hc *http.Client, key string) {
	t.Helper()
	deadline := time.Now().Add(startTimeout)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.relayURL+"/v1/models", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := hc.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(b), simengine.DefaultModel) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the restarted relay routes no model: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // polling, with a deadline
	}
}
