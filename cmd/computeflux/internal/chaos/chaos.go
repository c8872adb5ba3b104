// Package chaos runs a ComputeFlux cluster as real processes of the
// computeflux binary (a relay, simulated engines and their agents on
// loopback) under a steady load of sessions, half of them streamed, while
// agents die the way home machines do: one is SIGKILLed (no goodbye
// reaches anyone), another is frozen with SIGSTOP and woken with SIGCONT
// (a laptop lid), and the killed one is started again on its identity. It
// reports every request's fate, how long the relay took to notice, and
// whether the restarted agent is back in the relay's routing table and
// serves: new sessions, then requests it alone may take (the relay's admin
// API drains the others for them).
//
// Soak runs the same kind of cluster under many concurrent clients for
// minutes (soak.go): every answer checked, every process watched for
// panics, heap, goroutines and CPU per request for growth.
package chaos

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
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
	DefaultRestartChk = 4
	startTimeout      = 30 * time.Second
	// backTimeout bounds the wait for the restarted agent to show as "ok"
	// in the relay's routing table: generous, as a loaded CI machine may
	// be slow, and never a measure of speed.
	backTimeout = 30 * time.Second
	// freshSessions is how many new sessions are sent, one at a time,
	// once the restarted agent is routable, to see where they land.
	freshSessions = 12
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
	// RestartChecks is the number of requests, half streamed, sent after the
	// load while every agent but the restarted one is drained. Default 4.
	RestartChecks int
	// Progress, if set, receives one line per phase.
	Progress io.Writer
	// Echo, if set, receives the children's log lines.
	Echo io.Writer
}

func (c *Config) populate() {
	c.Agents = cmp.Or(c.Agents, DefaultAgents)
	c.Workers = cmp.Or(c.Workers, DefaultWorkers)
	c.Freeze = cmp.Or(c.Freeze, DefaultFreeze)
	c.TimeScale = cmp.Or(c.TimeScale, DefaultTimeScale)
	c.MaxTokens = cmp.Or(c.MaxTokens, DefaultMaxTokens)
	c.RequestTimeout = cmp.Or(c.RequestTimeout, DefaultReqTimeout)
	c.RestartChecks = cmp.Or(c.RestartChecks, DefaultRestartChk)
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
	// RestartedBack is the time from the restarted agent's join to the
	// relay's routing table (its admin API, polled every 20 ms under the
	// load) showing it "ok"; zero if it did not within 30 s.
	// RestartedState is the state the table showed last.
	RestartedBack  time.Duration
	RestartedState string
	// RestartedLoad is how many requests of the load that began after the
	// restart the restarted agent served (sessions are sticky, so often
	// none: their agents still live).
	RestartedLoad int
	// RestartedFresh is how many of FreshSent new sessions, sent one at a
	// time after the load, the restarted agent served.
	RestartedFresh, FreshSent int
	// Checks are the requests sent while every agent but the restarted one
	// was drained: each must be served ("ok") by the restarted agent.
	Checks []Request
	// Wall is the load's duration.
	Wall time.Duration
	// Events are the relay's log lines about the killed and frozen agents
	// during the load, with their time since the load began.
	Events []string
	// Panics are the panics any process reported (see cluster.panics).
	Panics []string
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
	gossipDead := "gossip dead after " + r.KillGossipDead.Round(time.Millisecond).String()
	if r.KillGossipDead == 0 {
		gossipDead = "gossip did not declare it dead within the run"
	}
	fmt.Fprintf(w, "  relay noticed: SIGKILL after %v (%s), SIGSTOP after %v; frozen agent routable again %v after SIGCONT\n",
		r.KillDetect.Round(time.Millisecond), gossipDead, r.FreezeDetect.Round(time.Millisecond), r.BackAfterCont.Round(time.Millisecond))
	served := 0
	for _, q := range r.Checks {
		if q.Cause == "ok" {
			served++
		}
	}
	back := fmt.Sprintf("%q in the routing table %v after its join", r.RestartedState, r.RestartedBack.Round(time.Millisecond))
	if r.RestartedBack == 0 {
		back = fmt.Sprintf("still %q in the routing table %v after its join", r.RestartedState, backTimeout)
	}
	fmt.Fprintf(w, "  restarted agent: %s; served %d requests of the load after the restart, %d of %d new sessions, %d of %d with the others drained\n",
		back, r.RestartedLoad, r.RestartedFresh, r.FreshSent, served, len(r.Checks))
	writePanics(w, r.Panics)
}

// writePanics prints the panics a run saw (each distinct line once, with
// its count), or that there were none.
func writePanics(w io.Writer, panics []string) {
	fmt.Fprintf(w, "  panics in any process: %d\n", len(panics))
	count := map[string]int{}
	var order []string
	for _, p := range panics {
		if count[p] == 0 {
			order = append(order, p)
		}
		count[p]++
	}
	for _, p := range order {
		fmt.Fprintf(w, "    %dx %s\n", count[p], p)
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
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "computeflux-chaos-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	c := &chaosRun{cfg: cfg, cluster: newCluster(clusterSpec{
		Name: "chaos", Binary: cfg.Binary, Dir: dir, Agents: cfg.Agents,
		EngineArgs: []string{"--time-scale", fmt.Sprint(cfg.TimeScale)},
		AgentArgs:  []string{"--drain-timeout", "2s"},
		Progress:   cfg.Progress, Echo: cfg.Echo,
	})}
	defer c.stop()
	if err := c.start(); err != nil {
		return nil, err
	}
	return c.run(ctx)
}

// chaosRun is one chaos run on its cluster.
type chaosRun struct {
	*cluster
	cfg Config
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
func (c *chaosRun) detected(name string, since time.Time) (first, gossipDead time.Duration) {
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
func (c *chaosRun) routableAgain(name string, since time.Time) time.Duration {
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

func (c *chaosRun) run(ctx context.Context) (*Result, error) {
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
	var joinedAt time.Time
	if ok {
		c.progress("restart %s", agentName(killed))
		joinedAt, startErr = c.startAgent(killed)
	}
	if ok && startErr == nil {
		// The load goes on while the table is watched.
		startErr = c.waitRoutable(ctx, client, killed, joinedAt, res)
		ok = ctx.Err() == nil
	}
	if ok {
		ok = sleep(time.Until(joinedAt.Add(3 * time.Second)))
	}
	close(stop)
	wg.Wait()
	res.Wall = time.Since(loadStart)
	if ok && startErr == nil {
		for _, q := range res.Requests {
			if q.Agent == agentName(killed) && loadStart.Add(q.Start).After(joinedAt) {
				res.RestartedLoad++
			}
		}
		if res.RestartedBack > 0 {
			startErr = c.checkRestarted(ctx, client, killed, loadStart, res)
		}
	}
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
	res.Panics = c.panics(ctx, client)
	if startErr != nil {
		return res, startErr
	}
	if !ok && ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, nil
}

// waitRoutable watches the relay's routing table (its admin API) until the
// restarted agent i shows "ok", for at most backTimeout, and notes when.
// Errors are about the run (the admin API failing); what the agent did is
// in res.
func (c *chaosRun) waitRoutable(ctx context.Context, client *http.Client, i int, joinedAt time.Time, res *Result) error {
	name := agentName(i)
	for deadline := time.Now().Add(backTimeout); ; {
		rows, err := c.table(ctx, client)
		if err != nil {
			return err
		}
		res.RestartedState = "absent"
		for _, r := range rows {
			if r.Name == name {
				res.RestartedState = r.State
			}
		}
		if res.RestartedState == "ok" {
			res.RestartedBack = max(time.Since(joinedAt), time.Nanosecond)
			c.progress("%s %q in the routing table %v after its join", name, res.RestartedState, res.RestartedBack.Round(time.Millisecond))
			return nil
		}
		if time.Now().After(deadline) {
			c.progress("%s still %q in the routing table %v after its join", name, res.RestartedState, backTimeout)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// checkRestarted checks, once the load has stopped, that the restarted
// agent i serves: new sessions may land on it, and with every other agent
// drained (the admin API) requests reach it and it answers them. Errors
// are about the run (the admin API failing); what the agent did is in res.
func (c *chaosRun) checkRestarted(ctx context.Context, client *http.Client, i int, loadStart time.Time, res *Result) error {
	name := agentName(i)
	for n := range freshSessions {
		q := c.request(ctx, client, fmt.Sprintf("fresh-%d", n), false, 0, loadStart)
		res.FreshSent++
		if q.Cause == "ok" && q.Agent == name {
			res.RestartedFresh++
		}
	}
	var others []string
	for j := range c.cfg.Agents {
		if j != i {
			others = append(others, agentName(j))
		}
	}
	for _, o := range others {
		if err := c.admin(ctx, client, o, "drain"); err != nil {
			return err
		}
	}
	c.progress("%s served %d of %d new sessions; the others drained", name, res.RestartedFresh, res.FreshSent)
	for n := range c.cfg.RestartChecks {
		// Old sessions (their agents drained, so they move) and new ones.
		session := fmt.Sprintf("w%d-s0", n%c.cfg.Workers)
		if n%2 == 1 {
			session = fmt.Sprintf("check-%d", n)
		}
		q := c.request(ctx, client, session, n%2 == 1, n, loadStart)
		if q.Cause == "ok" && q.Agent != name {
			q.Cause, q.Detail = "wrong_agent", "served by "+q.Agent
		}
		res.Checks = append(res.Checks, q)
	}
	for _, o := range others {
		if err := c.admin(ctx, client, o, "undrain"); err != nil {
			return err
		}
	}
	return nil
}

// request sends one chat turn and classifies how it ended.
func (c *chaosRun) request(ctx context.Context, client *http.Client, session string, stream bool, turn int, loadStart time.Time) Request {
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
