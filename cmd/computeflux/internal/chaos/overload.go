package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// The overload scenario: more than the fleet can take, from clients that
// share it. Two simulated engines of a few batch slots each at real time,
// their agents and one or two relays run as processes. A light client
// sends a short streamed request every LightEvery, alone first and then
// while a heavy client keeps HeavyStreams long streams going; then two
// heavy clients of weights 2 and 1 flood together. It reports the light
// client's time to first token alone and under the flood, what the heavy
// client got alone and under the flood, and the two heavy clients' shares.
// With two relays the light client uses the first and the heavy ones the
// second, and at the end the first relay is killed and started again while
// both keep sending: its answers in the second before its agents rejoin
// are counted.

// Defaults for the zero values of OverloadConfig.
const (
	DefaultOverloadEngines = 2
	DefaultOverloadSlots   = 4
	DefaultHeavyStreams    = 32
	DefaultHeavyTokens     = 128
	DefaultLightTokens     = 8
	DefaultLightEvery      = 400 * time.Millisecond
	DefaultOverloadPhase   = 20 * time.Second
)

// OverloadConfig configures RunOverload. The zero value of every field but
// Binary means the default in its comment.
type OverloadConfig struct {
	// Binary is the computeflux executable (required).
	Binary string
	// Engines is the number of sim engines, each with its agent. Default 2.
	Engines int
	// Slots is each engine's batch (--max-running). Default 4.
	Slots int
	// Relays is 1 or 2. Default 1.
	Relays int
	// HeavyStreams is how many streams each heavy client keeps going.
	// Default 32.
	HeavyStreams int
	// HeavyTokens and LightTokens are the answers' lengths. Default 128
	// and 8.
	HeavyTokens, LightTokens int
	// HeavySpread spreads the heavy answers' lengths uniformly over
	// HeavyTokens × (1 ± HeavySpread), as real answers vary; 0 (the
	// default) makes them all alike, so that the heavy requests end
	// together and slots free in bursts: the light client's worst case.
	HeavySpread float64
	// LightEvery is the light client's pace. Default 400 ms.
	LightEvery time.Duration
	// Phase is the length of each measured phase. Default 20 s.
	Phase time.Duration
	// Weighted adds the phase of two heavy clients of weights 2 and 1.
	Weighted bool
	// RestartRelay, with two relays, kills the first relay under load and
	// starts it again.
	RestartRelay bool
	// RelayArgs and AgentArgs are added to every relay's and agent's
	// command line (e.g. --queue-wait -1 and --dispatch-limit -1 for the
	// fleet without a queue).
	RelayArgs, AgentArgs []string
	// Progress, if set, receives one line per phase; Echo the children's
	// log lines.
	Progress, Echo io.Writer
}

func (c *OverloadConfig) populate() {
	def := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	def(&c.Engines, DefaultOverloadEngines)
	def(&c.Slots, DefaultOverloadSlots)
	def(&c.Relays, 1)
	def(&c.HeavyStreams, DefaultHeavyStreams)
	def(&c.HeavyTokens, DefaultHeavyTokens)
	def(&c.LightTokens, DefaultLightTokens)
	if c.LightEvery == 0 {
		c.LightEvery = DefaultLightEvery
	}
	if c.Phase == 0 {
		c.Phase = DefaultOverloadPhase
	}
}

// Latencies sums up a set of durations.
type Latencies struct {
	N                   int
	P50, P95, Max, Mean time.Duration
}

func summarize(ds []time.Duration) Latencies {
	if len(ds) == 0 {
		return Latencies{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	at := func(q float64) time.Duration { return s[min(int(q*float64(len(s))), len(s)-1)] }
	return Latencies{N: len(s), P50: at(0.5), P95: at(0.95), Max: s[len(s)-1], Mean: sum / time.Duration(len(s))}
}

// ClientFigures are what one client got in one phase.
type ClientFigures struct {
	// TTFT is the time to the first content token of its answers.
	TTFT Latencies
	// Done is how many answers ended whole; Tokens their completion
	// tokens (from the answers' usage).
	Done, Tokens int
	// Streamed is the content tokens received while the phase was
	// measured, whichever answer they belong to: the client's share of
	// the fleet's throughput.
	Streamed int
	// Failed counts answers that did not end whole, by status ("429",
	// "503", "cut", "error event", ...).
	Failed map[string]int
}

func (f ClientFigures) failed() int {
	n := 0
	for _, v := range f.Failed {
		n += v
	}
	return n
}

// OverloadResult is what RunOverload measured.
type OverloadResult struct {
	Config OverloadConfig
	// LightAlone is the light client on an idle fleet; HeavyAlone the
	// heavy one alone.
	LightAlone, HeavyAlone ClientFigures
	// LightFlood and HeavyFlood are both at once.
	LightFlood, HeavyFlood ClientFigures
	// HeavyOne and HeavyTwo are the heavy clients of weight 2 and 1 at
	// once (Weighted).
	HeavyTwo, HeavyOne ClientFigures
	// HeavyServiceTime is one heavy request's time on the idle fleet.
	HeavyServiceTime time.Duration
	// Killed, with RestartRelay, is the requests in flight when the first
	// relay was killed; Restart those sent once it listened again (its
	// agents still rejoining), to either relay.
	Killed, Restart ClientFigures
}

// Write prints the result as a table.
func (r *OverloadResult) Write(w io.Writer) {
	row := func(name string, f ClientFigures) {
		fmt.Fprintf(w, "%-26s %6d %9s %9s %9s %7d %9d  %v\n", name, f.Done, ms(f.TTFT.P50), ms(f.TTFT.P95), ms(f.TTFT.Max), f.failed(), f.Tokens, f.Failed)
	}
	fmt.Fprintf(w, "overload: %d engines of %d slots, %d relay(s); heavy answers %d tokens (spread %.0f%%); one heavy request alone: %s\n",
		r.Config.Engines, r.Config.Slots, r.Config.Relays, r.Config.HeavyTokens, 100*r.Config.HeavySpread, ms(r.HeavyServiceTime))
	fmt.Fprintf(w, "%-26s %6s %9s %9s %9s %7s %9s\n", "client / phase", "done", "TTFT p50", "p95", "max", "failed", "tokens")
	row("light, alone", r.LightAlone)
	row("heavy, alone", r.HeavyAlone)
	row("light, under the flood", r.LightFlood)
	row("heavy, with light", r.HeavyFlood)
	if r.Config.Weighted {
		row("heavy weight 2", r.HeavyTwo)
		row("heavy weight 1", r.HeavyOne)
		if r.HeavyOne.Streamed > 0 {
			fmt.Fprintf(w, "weighted share: %.2f : 1 in tokens streamed (%d and %d)\n",
				float64(r.HeavyTwo.Streamed)/float64(r.HeavyOne.Streamed), r.HeavyTwo.Streamed, r.HeavyOne.Streamed)
		}
	}
	if r.Config.RestartRelay {
		row("in flight at a relay kill", r.Killed)
		row("sent after its restart", r.Restart)
	}
}

func ms(d time.Duration) string { return fmt.Sprintf("%.0fms", float64(d)/float64(time.Millisecond)) }

// overloadCluster is the processes of one run.
type overloadCluster struct {
	cfg      OverloadConfig
	dir      string
	mu       sync.Mutex // guards relays, relayURL and relayMA: a restart changes them under load
	relays   []*proc
	relayURL []string
	relayMA  []string
	engines  []*proc
	agents   []*proc
	keys     map[string]string // client name -> key
	client   *http.Client
}

// RunOverload runs the overload scenario.
func RunOverload(ctx context.Context, cfg OverloadConfig) (*OverloadResult, error) {
	cfg.populate()
	if cfg.Binary == "" {
		return nil, errors.New("overload: no binary")
	}
	if cfg.Relays < 1 || cfg.Relays > 2 {
		return nil, fmt.Errorf("overload: %d relays: want 1 or 2", cfg.Relays)
	}
	dir, err := os.MkdirTemp("", "computeflux-overload-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	c := &overloadCluster{cfg: cfg, dir: dir, keys: map[string]string{}}
	c.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxConnsPerHost: 0}}
	defer c.stop()
	if err := c.start(); err != nil {
		return nil, err
	}
	return c.run(ctx)
}

func (c *overloadCluster) progress(format string, a ...any) {
	if c.cfg.Progress != nil {
		fmt.Fprintf(c.cfg.Progress, "overload: "+format+"\n", a...)
	}
}

func (c *overloadCluster) start() error {
	token := filepath.Join(c.dir, "token")
	if err := os.WriteFile(token, []byte(randomHex(32)), 0o600); err != nil {
		return err
	}
	var clients strings.Builder
	clients.WriteString("clients:\n")
	for _, n := range []struct {
		name   string
		weight int
	}{{"light", 1}, {"heavy", 2}, {"heavy-one", 1}} {
		c.keys[n.name] = "sk-" + n.name + "-" + randomHex(8)
		fmt.Fprintf(&clients, "  - name: %s\n    keys: [%s]\n    weight: %d\n", n.name, c.keys[n.name], n.weight)
	}
	clientsFile := filepath.Join(c.dir, "clients.yaml")
	if err := os.WriteFile(clientsFile, []byte(clients.String()), 0o600); err != nil {
		return err
	}
	for i := range c.cfg.Relays {
		if err := c.startRelay(i, "127.0.0.1:0"); err != nil {
			return err
		}
	}
	for i := range c.cfg.Engines {
		e, err := startWith(fmt.Sprintf("engine-%d", i), c.cfg.Binary, procOptions{Echo: c.cfg.Echo}, "sim-engine",
			"--listen", "127.0.0.1:0", "--max-running", fmt.Sprint(c.cfg.Slots), "--log-format", "json")
		if err != nil {
			return err
		}
		c.engines = append(c.engines, e)
		l, err := e.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "sim engine serving" })
		if err != nil {
			return err
		}
		args := []string{"agent", "--token-file", token, "--upstream", l.str("url"),
			"--name", agentName(i), "--identity", filepath.Join(c.dir, agentName(i)+".key"),
			"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--drain-timeout", "2s", "--log-format", "json"}
		for _, ma := range c.relayMA {
			args = append(args, "--relay", ma)
		}
		a, err := startWith(agentName(i), c.cfg.Binary, procOptions{Echo: c.cfg.Echo}, append(args, c.cfg.AgentArgs...)...)
		if err != nil {
			return err
		}
		c.agents = append(c.agents, a)
	}
	for i := range c.relays {
		if err := c.waitAgents(i, time.Time{}); err != nil {
			return err
		}
	}
	c.progress("%d relay(s), %d engines of %d slots and their agents up", c.cfg.Relays, c.cfg.Engines, c.cfg.Slots)
	return nil
}

// startRelay starts relay i listening on listen (its identity kept, so
// that agents find it again after a restart).
func (c *overloadCluster) startRelay(i int, listen string) error {
	addrFile := filepath.Join(c.dir, fmt.Sprintf("relay-%d.addrs", i))
	_ = os.Remove(addrFile)
	p2p := "/ip4/127.0.0.1/udp/0/quic-v1"
	if i < len(c.relayMA) {
		// A restart listens where it did: the agents redial that address.
		p2p = strings.Split(c.relayMA[i], "/p2p/")[0]
	}
	args := append([]string{"relay", "--listen", listen, "--p2p-listen", p2p,
		"--identity", filepath.Join(c.dir, fmt.Sprintf("relay-%d.key", i)), "--token-file", filepath.Join(c.dir, "token"),
		"--clients-file", filepath.Join(c.dir, "clients.yaml"), "--addr-file", addrFile, "--log-format", "json"},
		c.cfg.RelayArgs...)
	p, err := startWith(fmt.Sprintf("relay-%d", i), c.cfg.Binary, procOptions{Echo: c.cfg.Echo}, args...)
	if err != nil {
		return err
	}
	l, err := p.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "relay http listening" })
	if err != nil {
		return err
	}
	b, err := os.ReadFile(addrFile)
	if err != nil {
		return fmt.Errorf("overload: relay addr file: %w", err)
	}
	ma := strings.TrimSpace(strings.Split(string(b), "\n")[0])
	c.mu.Lock()
	defer c.mu.Unlock()
	if i < len(c.relays) {
		c.relays[i], c.relayURL[i], c.relayMA[i] = p, "http://"+l.str("addr"), ma
	} else {
		c.relays = append(c.relays, p)
		c.relayURL = append(c.relayURL, "http://"+l.str("addr"))
		c.relayMA = append(c.relayMA, ma)
	}
	return nil
}

// waitAgents waits until relay i logged every agent's join since since.
func (c *overloadCluster) waitAgents(i int, since time.Time) error {
	for j := range c.cfg.Engines {
		if _, err := c.relays[i].waitLog(startTimeout, func(l logLine) bool {
			return l.at.After(since) && l.str("message") == "agent joined" && l.str("agent") == agentName(j)
		}); err != nil {
			return err
		}
	}
	return nil
}

func (c *overloadCluster) stop() {
	var wg sync.WaitGroup
	for _, p := range append(append(slices.Clone(c.relays), c.agents...), c.engines...) {
		if p == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.stop(5 * time.Second)
		}()
	}
	wg.Wait()
}

// tally collects one client's answers in one phase.
type tally struct {
	mu   sync.Mutex
	ttft []time.Duration
	f    ClientFigures
}

func (t *tally) add(ttft time.Duration, tokens int, failure string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if failure != "" {
		if t.f.Failed == nil {
			t.f.Failed = map[string]int{}
		}
		t.f.Failed[failure]++
		return
	}
	t.ttft = append(t.ttft, ttft)
	t.f.Done++
	t.f.Tokens += tokens
}

// streamed counts one token received.
func (t *tally) streamed() {
	t.mu.Lock()
	t.f.Streamed++
	t.mu.Unlock()
}

func (t *tally) figures() ClientFigures {
	t.mu.Lock()
	defer t.mu.Unlock()
	f := t.f
	f.TTFT = summarize(t.ttft)
	return f
}

// ask sends one streamed chat request for client to relay i and returns
// its time to first token, its completion tokens, or why it failed. Only
// answers that end inside [from, to) count; tally may be nil.
func (c *overloadCluster) ask(ctx context.Context, relay int, client string, maxTokens, n int) (ttft time.Duration, tokens int, failure string) {
	return c.askStream(ctx, relay, client, maxTokens, n, nil)
}

// askStream is ask calling onToken (when not nil) for every content chunk
// as it arrives.
func (c *overloadCluster) askStream(ctx context.Context, relay int, client string, maxTokens, n int, onToken func()) (ttft time.Duration, tokens int, failure string) {
	body, _ := json.Marshal(map[string]any{
		"model": "computeflux-sim", "stream": true, "max_tokens": maxTokens,
		"stream_options": map[string]any{"include_usage": true},
		"messages":       []map[string]string{{"role": "user", "content": fmt.Sprintf("%s request %d: say something", client, n)}},
	})
	start := time.Now()
	c.mu.Lock()
	url := c.relayURL[relay]
	c.mu.Unlock()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return 0, 0, "request"
	}
	req.Header.Set("Authorization", "Bearer "+c.keys[client])
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return 0, 0, "cancelled"
		}
		return 0, 0, "connect"
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		return 0, 0, fmt.Sprint(resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	for {
		line, err := br.ReadString('\n')
		if data, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok {
			if data == "[DONE]" {
				if ttft == 0 {
					return 0, 0, "empty"
				}
				return ttft, tokens, ""
			}
			if strings.HasPrefix(data, `{"error"`) {
				return 0, 0, "error event"
			}
			var ev struct {
				Choices []struct {
					Delta struct {
						Content string `json:"content"`
					} `json:"delta"`
				} `json:"choices"`
				Usage *struct {
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
			}
			if json.Unmarshal([]byte(data), &ev) == nil {
				if len(ev.Choices) > 0 && ev.Choices[0].Delta.Content != "" {
					if ttft == 0 {
						ttft = time.Since(start)
					}
					if onToken != nil {
						onToken()
					}
				}
				if ev.Usage != nil {
					tokens = ev.Usage.CompletionTokens
				}
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return 0, 0, "cancelled"
			}
			return 0, 0, "cut"
		}
	}
}

// heavy keeps streams requests of client going to relay until ctx ends;
// answers ending inside the window go to t.
func (c *overloadCluster) heavy(ctx context.Context, relay int, client string, streams int, t *tally, window func() bool, wg *sync.WaitGroup) {
	for s := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(s), uint64(len(client))))
			for n := 0; ctx.Err() == nil; n++ {
				tokens := c.cfg.HeavyTokens
				if sp := c.cfg.HeavySpread; sp > 0 {
					tokens = max(1, int(float64(tokens)*(1-sp+2*sp*rng.Float64())))
				}
				ttft, tokens, failure := c.askStream(ctx, relay, client, tokens, s*100000+n, func() {
					if window() {
						t.streamed()
					}
				})
				if failure == "cancelled" || !window() {
					continue
				}
				t.add(ttft, tokens, failure)
				if failure != "" {
					time.Sleep(100 * time.Millisecond) // a refused client backs off a little
				}
			}
		}()
	}
}

// light sends one request every LightEvery to relay for d.
func (c *overloadCluster) light(ctx context.Context, relay int, d time.Duration) ClientFigures {
	var t tally
	var wg sync.WaitGroup
	tick := time.NewTicker(c.cfg.LightEvery)
	defer tick.Stop()
	end := time.After(d)
	for n := 0; ; n++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ttft, tokens, failure := c.ask(ctx, relay, "light", c.cfg.LightTokens, n)
			if failure != "cancelled" {
				t.add(ttft, tokens, failure)
			}
		}()
		select {
		case <-tick.C:
			continue
		case <-end:
		case <-ctx.Done():
		}
		break
	}
	wg.Wait()
	return t.figures()
}

// flood runs heavy clients (name -> streams) on relay from, measuring from
// warm on for d, while during runs; it returns each client's figures.
func (c *overloadCluster) flood(ctx context.Context, relay int, clients []string, warm, d time.Duration, during func()) []ClientFigures {
	fctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var mu sync.Mutex
	open := false
	window := func() bool { mu.Lock(); defer mu.Unlock(); return open }
	tallies := make([]tally, len(clients))
	for i, name := range clients {
		c.heavy(fctx, relay, name, c.cfg.HeavyStreams, &tallies[i], window, &wg)
	}
	select {
	case <-time.After(warm):
	case <-ctx.Done():
	}
	mu.Lock()
	open = true
	mu.Unlock()
	if during != nil {
		during()
	} else {
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
	}
	mu.Lock()
	open = false
	mu.Unlock()
	cancel()
	wg.Wait()
	out := make([]ClientFigures, len(clients))
	for i := range tallies {
		out[i] = tallies[i].figures()
	}
	return out
}

func (c *overloadCluster) run(ctx context.Context) (*OverloadResult, error) {
	res := &OverloadResult{Config: c.cfg}
	heavyRelay := c.cfg.Relays - 1
	// One heavy request on the idle fleet, after a warm-up request.
	for range 2 {
		start := time.Now()
		if _, _, failure := c.ask(ctx, heavyRelay, "heavy", c.cfg.HeavyTokens, -1); failure != "" {
			return nil, fmt.Errorf("overload: a heavy request on the idle fleet failed: %s", failure)
		}
		res.HeavyServiceTime = time.Since(start)
	}
	c.progress("one heavy request alone: %s; the light client alone for %v", ms(res.HeavyServiceTime), c.cfg.Phase)
	res.LightAlone = c.light(ctx, 0, c.cfg.Phase)
	warm := 2 * res.HeavyServiceTime
	c.progress("the heavy client alone for %v", c.cfg.Phase)
	res.HeavyAlone = c.flood(ctx, heavyRelay, []string{"heavy"}, warm, c.cfg.Phase, nil)[0]
	c.progress("the light client under the heavy client's flood for %v", c.cfg.Phase)
	var light ClientFigures
	res.HeavyFlood = c.flood(ctx, heavyRelay, []string{"heavy"}, warm, c.cfg.Phase, func() {
		light = c.light(ctx, 0, c.cfg.Phase)
	})[0]
	res.LightFlood = light
	if c.cfg.Weighted {
		c.progress("two heavy clients of weights 2 and 1 for %v", c.cfg.Phase)
		two := c.flood(ctx, heavyRelay, []string{"heavy", "heavy-one"}, warm, c.cfg.Phase, nil)
		res.HeavyTwo, res.HeavyOne = two[0], two[1]
	}
	if c.cfg.RestartRelay && c.cfg.Relays == 2 {
		c.progress("relay 0 killed and started again under load")
		var killed, after tally
		var mu sync.Mutex
		var killedAt, backAt time.Time // guarded by mu
		rctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		for _, relay := range []int{0, 1} {
			for s := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for n := 0; rctx.Err() == nil; n++ {
						sent := time.Now()
						_, tokens, failure := c.ask(rctx, relay, "light", c.cfg.LightTokens, 1e6+s*1000+n)
						mu.Lock()
						k, b := killedAt, backAt
						mu.Unlock()
						switch {
						case failure == "cancelled":
						case failure == "connect":
							time.Sleep(20 * time.Millisecond) // the relay is down: the client retries
						case !b.IsZero() && sent.After(b):
							after.add(0, tokens, failure)
						case !k.IsZero() && sent.Before(k):
							killed.add(0, tokens, failure)
						}
					}
				}()
			}
		}
		time.Sleep(2 * time.Second)
		listen := strings.TrimPrefix(c.relayURL[0], "http://")
		mu.Lock()
		killedAt = time.Now()
		mu.Unlock()
		c.relays[0].kill()
		err := c.startRelay(0, listen)
		mu.Lock()
		backAt = time.Now()
		mu.Unlock()
		if err == nil {
			err = c.waitAgents(0, killedAt)
		}
		if err == nil {
			c.progress("relay 0 back; its agents rejoined %s after it listened", ms(time.Since(backAt)))
			time.Sleep(3 * time.Second)
		}
		cancel()
		wg.Wait()
		if err != nil {
			return nil, err
		}
		res.Killed, res.Restart = killed.figures(), after.figures()
	}
	return res, nil
}
