// Package chaos runs a ComputeFlux cluster as real processes of the
// computeflux binary (a relay, simulated engines and their agents on
// loopback) under a steady load of sessions, half of them streamed, while
// agents die the way home machines do: one is SIGKILLed (no goodbye
// reaches anyone), another is frozen with SIGSTOP and woken with SIGCONT
// (a laptop lid), and the killed one is started again on its identity. It
// reports every request's fate and how long the relay took to notice.
package chaos

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Defaults for the zero values of Config.
const (
	DefaultAgents     = 3
	DefaultWorkers    = 6
	DefaultFreeze     = 6 * time.Second
	DefaultTimeScale  = 4
	DefaultMaxTokens  = 48
	DefaultReqTimeout = 30 * time.Second
	startTimeout      = 30 * time.Second
)

// Config configures a Run. The zero value of every field but Binary means
// the default in its comment.
type Config struct {
	// Binary is the computeflux executable (required).
	Binary string
	// Dir holds identities, token and key files. Empty means a temporary
	// directory removed at the end.
	Dir string
	// Agents is the number of engines, each with its agent. Default 3 (at
	// least 3: one killed, one frozen, one serving).
	Agents int
	// Workers is the number of concurrent sessions; odd ones stream.
	// Default 6.
	Workers int
	// Freeze is how long the frozen agent stays stopped. Default 6 s.
	Freeze time.Duration
	// TimeScale speeds up the simulated engines. Default 4.
	TimeScale float64
	// MaxTokens is each answer's length. Default 48.
	MaxTokens int
	// RequestTimeout is the client's bound on one request; a request
	// still running then is a hang. Default 30 s.
	RequestTimeout time.Duration
	// Progress, if set, receives one line per phase.
	Progress io.Writer
	// Echo, if set, receives the children's log lines.
	Echo io.Writer
}

func (c *Config) populate() {
	if c.Agents == 0 {
		c.Agents = DefaultAgents
	}
	if c.Workers == 0 {
		c.Workers = DefaultWorkers
	}
	if c.Freeze == 0 {
		c.Freeze = DefaultFreeze
	}
	if c.TimeScale == 0 {
		c.TimeScale = DefaultTimeScale
	}
	if c.MaxTokens == 0 {
		c.MaxTokens = DefaultMaxTokens
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = DefaultReqTimeout
	}
}

// Request is the fate of one request.
type Request struct {
	Stream bool
	Start  time.Duration // since the load began
	Took   time.Duration
	// Cause is "ok", "error_event" (a stream ended by an OpenAI error
	// event), "failed" (an error status or connection error before the
	// first byte), "cut" (a stream ended without [DONE] or error event),
	// "mixed" (events of more than one completion in one stream) or
	// "hang" (still running at the client's timeout).
	Cause  string
	Detail string
	// ErrorGap is, for "error_event", the time from the stream's last
	// event to its error event.
	ErrorGap time.Duration
	// Agent served the request (X-ComputeFlux-Agent).
	Agent string
}

// Result is what a Run saw.
type Result struct {
	Requests []Request
	// KillDetect is the time from SIGKILL to the relay's first log line
	// that takes the agent out of normal routing (suspect, dead or left);
	// FreezeDetect the same for SIGSTOP. Zero if never seen.
	KillDetect, FreezeDetect time.Duration
	// KillGossipDead is the time from SIGKILL to gossip declaring the
	// agent dead (zero if not within the run).
	KillGossipDead time.Duration
	// BackAfterCont is the time from SIGCONT to the relay routing to the
	// frozen agent again (zero if it did not within the run).
	BackAfterCont time.Duration
	// Wall is the load's duration.
	Wall time.Duration
	// Events are the relay's log lines about the killed and frozen agents
	// during the load, with their time since the load began.
	Events []string
}

// Counts tallies the requests by stream and cause.
func (r *Result) Counts() map[string]int {
	m := map[string]int{}
	for _, q := range r.Requests {
		k := "plain/" + q.Cause
		if q.Stream {
			k = "stream/" + q.Cause
		}
		m[k]++
	}
	return m
}

// Longest returns the longest non-streamed request and the longest stream
// that ended with an error event, and the largest ErrorGap.
func (r *Result) Longest() (plain, cutStream, errGap time.Duration) {
	for _, q := range r.Requests {
		switch {
		case !q.Stream:
			plain = max(plain, q.Took)
		case q.Cause == "error_event":
			cutStream = max(cutStream, q.Took)
			errGap = max(errGap, q.ErrorGap)
		}
	}
	return
}

// Write prints the result's figures.
func (r *Result) Write(w io.Writer) {
	c := r.Counts()
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, c[k]))
	}
	plain, cut, gap := r.Longest()
	fmt.Fprintf(w, "chaos (real processes): %d requests in %v: %s\n", len(r.Requests), r.Wall.Round(time.Millisecond), strings.Join(parts, " "))
	fmt.Fprintf(w, "  longest non-streamed request: %v\n", plain.Round(time.Millisecond))
	fmt.Fprintf(w, "  streams cut by a fault: longest %v, error event at most %v after the last event\n", cut.Round(time.Millisecond), gap.Round(time.Millisecond))
	fmt.Fprintf(w, "  relay noticed: SIGKILL after %v (gossip dead after %v), SIGSTOP after %v; frozen agent routable again %v after SIGCONT\n",
		r.KillDetect.Round(time.Millisecond), r.KillGossipDead.Round(time.Millisecond), r.FreezeDetect.Round(time.Millisecond), r.BackAfterCont.Round(time.Millisecond))
}

// cluster is the running processes.
type cluster struct {
	cfg      Config
	dir      string
	key      string
	relay    *proc
	relayURL string
	relayMA  string
	engines  []*proc
	engURL   []string
	agents   []*proc
}

func (c *cluster) progress(format string, a ...any) {
	if c.cfg.Progress != nil {
		fmt.Fprintf(c.cfg.Progress, "chaos: "+format+"\n", a...)
	}
}

// Run starts the cluster, runs the load and the faults, stops everything
// and returns what it saw. Errors are about the run itself (a process that
// would not start); the requests' fates are in the Result.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	cfg.populate()
	if cfg.Binary == "" {
		return nil, errors.New("chaos: no binary")
	}
	if cfg.Agents < 3 {
		return nil, fmt.Errorf("chaos: %d agents: need at least 3", cfg.Agents)
	}
	c := &cluster{cfg: cfg, dir: cfg.Dir}
	if c.dir == "" {
		d, err := os.MkdirTemp("", "computeflux-chaos-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		c.dir = d
	}
	defer c.stop()
	if err := c.start(); err != nil {
		return nil, err
	}
	return c.run(ctx)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (c *cluster) start() error {
	c.key = "sk-cf-" + randomHex(16)
	token := filepath.Join(c.dir, "token")
	keys := filepath.Join(c.dir, "keys")
	if err := os.WriteFile(token, []byte(randomHex(32)), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(keys, []byte(c.key+"\n"), 0o600); err != nil {
		return err
	}
	addrFile := filepath.Join(c.dir, "relay.addrs")
	var err error
	c.relay, err = start("relay", c.cfg.Binary, c.cfg.Echo, "relay",
		"--listen", "127.0.0.1:0", "--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1",
		"--identity", filepath.Join(c.dir, "relay.key"), "--token-file", token, "--api-keys-file", keys,
		"--addr-file", addrFile, "--log-format", "json")
	if err != nil {
		return err
	}
	l, err := c.relay.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "relay http listening" })
	if err != nil {
		return err
	}
	c.relayURL = "http://" + l.str("addr")
	b, err := os.ReadFile(addrFile)
	if err != nil {
		return fmt.Errorf("chaos: relay addr file: %w", err)
	}
	c.relayMA = strings.TrimSpace(strings.Split(string(b), "\n")[0])
	for i := range c.cfg.Agents {
		e, err := start(fmt.Sprintf("engine-%d", i), c.cfg.Binary, c.cfg.Echo, "sim-engine",
			"--listen", "127.0.0.1:0", "--time-scale", fmt.Sprint(c.cfg.TimeScale), "--log-format", "json")
		if err != nil {
			return err
		}
		c.engines = append(c.engines, e)
		l, err := e.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "sim engine serving" })
		if err != nil {
			return err
		}
		c.engURL = append(c.engURL, l.str("url"))
	}
	for i := range c.cfg.Agents {
		c.agents = append(c.agents, nil)
		if err := c.startAgent(i); err != nil {
			return err
		}
	}
	c.progress("relay %s, %d engines and agents up", c.relayURL, c.cfg.Agents)
	return nil
}

func agentName(i int) string { return fmt.Sprintf("agent-%d", i) }

// startAgent starts agent i on its identity and waits for the relay to
// log its join.
func (c *cluster) startAgent(i int) error {
	since := time.Now()
	a, err := start(agentName(i), c.cfg.Binary, c.cfg.Echo, "agent",
		"--relay", c.relayMA, "--token-file", filepath.Join(c.dir, "token"), "--upstream", c.engURL[i],
		"--name", agentName(i), "--identity", filepath.Join(c.dir, agentName(i)+".key"),
		"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--drain-timeout", "2s", "--log-format", "json")
	if err != nil {
		return err
	}
	c.agents[i] = a
	_, err = c.relay.waitLog(startTimeout, func(l logLine) bool {
		return l.at.After(since) && l.str("message") == "agent joined" && l.str("agent") == agentName(i)
	})
	return err
}

func (c *cluster) stop() {
	var wg sync.WaitGroup
	for _, p := range append(append([]*proc{c.relay}, c.agents...), c.engines...) {
		if p != nil {
			wg.Go(func() { p.stop(5 * time.Second) })
		}
	}
	wg.Wait()
}

// out is the relay's log messages that take an agent out of normal
// routing.
var out = map[string]bool{
	"agent silent: suspect, its requests end":      true,
	"agent left a request unacknowledged: suspect": true,
	"agent left":               true,
	"agent membership changed": false, // only when not routable
}

// detected returns the first relay log line after since that takes agent
// name out of normal routing, and the first that says gossip found it dead.
func (c *cluster) detected(name string, since time.Time) (first, gossipDead time.Duration) {
	for _, l := range c.relay.logs() {
		if !l.at.After(since) || l.str("agent") != name {
			continue
		}
		msg := l.str("message")
		isOut, known := out[msg]
		if msg == "agent membership changed" {
			g := l.str("gossip")
			isOut = g == "dead" || g == "suspect" || g == "left"
			if g == "dead" && gossipDead == 0 {
				gossipDead = l.at.Sub(since)
			}
		}
		if known && isOut && first == 0 {
			first = l.at.Sub(since)
		}
	}
	return first, gossipDead
}

// routableAgain returns the time from since to the relay's first log line
// that puts agent name back into normal routing (it answers probes again,
// or gossip sees it alive and routable), or zero.
func (c *cluster) routableAgain(name string, since time.Time) time.Duration {
	for _, l := range c.relay.logs() {
		if !l.at.After(since) || l.str("agent") != name {
			continue
		}
		routable, _ := l.fields["routable"].(bool)
		switch msg := l.str("message"); {
		case msg == "agent answers again", msg == "agent joined", msg == "agent membership changed" && routable:
			return l.at.Sub(since)
		}
	}
	return 0
}

func (c *cluster) run(ctx context.Context) (*Result, error) {
	res := &Result{}
	tr := &http.Transport{MaxIdleConnsPerHost: c.cfg.Workers}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: c.cfg.RequestTimeout}
	loadStart := time.Now()
	stop := make(chan struct{})
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := range c.cfg.Workers {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				session := fmt.Sprintf("w%d-s%d", w, i%3)
				q := c.request(ctx, client, session, w%2 == 1, i, loadStart)
				mu.Lock()
				res.Requests = append(res.Requests, q)
				mu.Unlock()
			}
		})
	}
	sleep := func(d time.Duration) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(d):
			return true
		}
	}
	ok := sleep(2 * time.Second)
	killed, frozen := 0, 1
	var killAt, stopAt, contAt time.Time
	if ok {
		killAt = time.Now()
		c.progress("SIGKILL %s", agentName(killed))
		c.agents[killed].kill()
		ok = sleep(3 * time.Second)
	}
	if ok {
		stopAt = time.Now()
		c.progress("SIGSTOP %s for %v", agentName(frozen), c.cfg.Freeze)
		_ = c.agents[frozen].signal(syscall.SIGSTOP)
		ok = sleep(c.cfg.Freeze)
		// Taken before the signal: the agent may answer (and the relay log
		// it) before the signal call returns.
		contAt = time.Now()
		_ = c.agents[frozen].signal(syscall.SIGCONT)
		c.progress("SIGCONT %s", agentName(frozen))
	}
	if ok {
		ok = sleep(time.Second)
	}
	var startErr error
	if ok {
		c.progress("restart %s", agentName(killed))
		startErr = c.startAgent(killed)
		ok = sleep(3 * time.Second)
	}
	close(stop)
	wg.Wait()
	res.Wall = time.Since(loadStart)
	if !killAt.IsZero() {
		res.KillDetect, res.KillGossipDead = c.detected(agentName(killed), killAt)
	}
	if !stopAt.IsZero() {
		res.FreezeDetect, _ = c.detected(agentName(frozen), stopAt)
	}
	if !contAt.IsZero() {
		res.BackAfterCont = c.routableAgain(agentName(frozen), contAt)
	}
	for _, l := range c.relay.logs() {
		if a := l.str("agent"); l.at.After(loadStart) && (a == agentName(killed) || a == agentName(frozen)) {
			res.Events = append(res.Events, fmt.Sprintf("%v %s: %s (gossip %s, routable %v, dead %v)",
				l.at.Sub(loadStart).Round(time.Millisecond), a, l.str("message"), l.str("gossip"), l.fields["routable"], l.fields["dead"]))
		}
	}
	slices.SortFunc(res.Requests, func(a, b Request) int { return int(a.Start - b.Start) })
	if startErr != nil {
		return res, startErr
	}
	if !ok && ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, nil
}

// request sends one chat turn and classifies how it ended.
func (c *cluster) request(ctx context.Context, client *http.Client, session string, stream bool, turn int, loadStart time.Time) Request {
	body, _ := json.Marshal(map[string]any{
		"model": "computeflux-sim", "stream": stream, "max_tokens": c.cfg.MaxTokens,
		"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("session %s turn %d: tell me about home GPUs", session, turn)}},
	})
	start := time.Now()
	q := Request{Stream: stream, Start: start.Sub(loadStart)}
	done := func(cause, detail string) Request {
		q.Took, q.Cause, q.Detail = time.Since(start), cause, detail
		return q
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.relayURL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return done("failed", err.Error())
	}
	req.Header.Set("Authorization", "Bearer "+c.key)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := client.Do(req)
	if err != nil {
		if isTimeout(err) {
			return done("hang", err.Error())
		}
		return done("failed", err.Error())
	}
	defer resp.Body.Close()
	q.Agent = resp.Header.Get("X-ComputeFlux-Agent")
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return done("failed", fmt.Sprintf("status %d: %s", resp.StatusCode, b))
	}
	if !stream {
		b, err := io.ReadAll(resp.Body)
		switch {
		case isTimeout(err):
			return done("hang", err.Error())
		case err != nil:
			return done("failed", err.Error())
		case !json.Valid(b) || !bytes.Contains(b, []byte(`"choices"`)):
			return done("failed", "not a completion: "+string(b[:min(len(b), 200)]))
		}
		return done("ok", "")
	}
	br := bufio.NewReader(resp.Body)
	var lastEvent time.Time
	ids := map[string]bool{}
	events := 0
	for {
		line, err := br.ReadString('\n')
		if data, found := strings.CutPrefix(strings.TrimSpace(line), "data: "); found {
			now := time.Now()
			switch {
			case data == "[DONE]":
				if len(ids) > 1 {
					return done("mixed", fmt.Sprintf("completion ids %v", ids))
				}
				return done("ok", "")
			case strings.HasPrefix(data, `{"error"`):
				if events == 0 {
					return done("failed", "error event before any other: "+data)
				}
				q.ErrorGap = now.Sub(lastEvent)
				return done("error_event", data)
			}
			var ev struct {
				ID string `json:"id"`
			}
			if json.Unmarshal([]byte(data), &ev) == nil && ev.ID != "" {
				ids[ev.ID] = true
			}
			events++
			lastEvent = now
		}
		if err != nil {
			if isTimeout(err) {
				return done("hang", err.Error())
			}
			if events == 0 {
				return done("failed", "stream ended before its first event: "+err.Error())
			}
			return done("cut", err.Error())
		}
	}
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return err != nil && (errors.As(err, &t) && t.Timeout() || errors.Is(err, context.DeadlineExceeded))
}
