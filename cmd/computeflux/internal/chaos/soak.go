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
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The soak: a relay, sim engines at real time with a vLLM-sized batch and
// their agents, under many concurrent clients for minutes: keyless
// multi-turn conversations that share system prompts, half streamed, a few
// cancelled mid-stream, a few with session keys; one agent restarted
// midway (its engine keeps running: a warm engine behind a cold index).
// Every answer is checked, every process watched for panics, and the relay's
// and agents' heap and goroutines, and the relay's CPU per request, are
// sampled to see that they stay flat. A shorter second run with the relay's
// round-robin policy gives the cache hit ratio to compare with.

// Defaults for the zero values of SoakConfig.
const (
	DefaultSoakAgents    = 4
	DefaultSoakClients   = 1000
	DefaultSoakDuration  = 10 * time.Minute
	DefaultSoakWarmup    = time.Minute
	DefaultSoakSlots     = 256
	DefaultSoakMinTokens = 24
	DefaultSoakMaxTokens = 64
	DefaultSoakSample    = 10 * time.Second
	// DefaultSoakTimeout bounds one request: far beyond an answer's time
	// (a few seconds at 256 running sequences); a request still running
	// then is a hang.
	DefaultSoakTimeout = 2 * time.Minute
	// soakDrain is the restarted agent's --drain-timeout: its streams in
	// flight end before it exits.
	soakDrain = time.Minute
	// soakSystemPrompts is how many system prompts the conversations share.
	soakSystemPrompts = 16
	// soakRamp is the time over which the clients start.
	soakRamp = 10 * time.Second
	// soakBackoff is about how long a client waits after a failed request.
	soakBackoff = time.Second
)

// SoakConfig configures Soak. The zero value of every field but Binary
// means the default in its comment.
type SoakConfig struct {
	// Binary is the computeflux executable (required).
	Binary string
	// Agents is the number of engines, each with its agent. Default 4.
	Agents int
	// Clients is the number of concurrent clients. Default 1,000.
	Clients int
	// Duration is how long the clients run. Default 10 minutes.
	Duration time.Duration
	// Warmup is when the figures that must stay flat are first taken.
	// Default 1 minute.
	Warmup time.Duration
	// RestartAt is when agent 0 is restarted (its engine keeps running).
	// Zero means half the Duration; negative, no restart.
	RestartAt time.Duration
	// Baseline is the length of the round-robin run, and of the window of
	// both runs whose hit ratios are compared. Zero means half the
	// Duration, at most 2 minutes; negative, no round-robin run.
	Baseline time.Duration
	// Slots is the engines' batch size (--max-running). Default 256.
	Slots int
	// MinTokens and MaxTokens bound an answer's length. Default 24 and 64.
	MinTokens, MaxTokens int
	// StreamShare, CancelShare and KeyedShare are the shares of requests
	// streamed, of streams cancelled mid-way, and of conversations with a
	// session key. Default 0.5, 0.03 and 0.03.
	StreamShare, CancelShare, KeyedShare float64
	// Sample is how often the processes are measured. Default 10 s.
	Sample time.Duration
	// RequestTimeout bounds one request. Default 2 minutes.
	RequestTimeout time.Duration
	// Seed makes the conversations repeatable. Default 1.
	Seed uint64
	// Progress, if set, receives progress lines; Echo the processes'
	// output.
	Progress, Echo io.Writer
}

func (c *SoakConfig) populate() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	defShare := func(v *float64, d float64) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.Agents, DefaultSoakAgents)
	def(&c.Clients, DefaultSoakClients)
	def(&c.Slots, DefaultSoakSlots)
	def(&c.MinTokens, DefaultSoakMinTokens)
	def(&c.MaxTokens, DefaultSoakMaxTokens)
	defDur(&c.Duration, DefaultSoakDuration)
	defDur(&c.Warmup, DefaultSoakWarmup)
	defDur(&c.RestartAt, c.Duration/2)
	defDur(&c.Baseline, min(c.Duration/2, 2*time.Minute))
	defDur(&c.Sample, DefaultSoakSample)
	defDur(&c.RequestTimeout, DefaultSoakTimeout)
	defShare(&c.StreamShare, 0.5)
	defShare(&c.CancelShare, 0.03)
	defShare(&c.KeyedShare, 0.03)
	if c.Seed == 0 {
		c.Seed = 1
	}
}

func (c *SoakConfig) validate() error {
	switch {
	case c.Binary == "":
		return errors.New("soak: no binary")
	case c.Agents < 2:
		return fmt.Errorf("soak: %d agents: need at least 2 (one is restarted)", c.Agents)
	case c.Clients < 1 || c.Slots < 1 || c.MinTokens < 1 || c.MaxTokens < c.MinTokens:
		return fmt.Errorf("soak: %d clients, %d slots, answers of %d to %d tokens", c.Clients, c.Slots, c.MinTokens, c.MaxTokens)
	case c.Warmup >= c.Duration:
		return fmt.Errorf("soak: warm-up %v is not shorter than the run (%v)", c.Warmup, c.Duration)
	}
	return nil
}

// SoakReport is what Soak saw: the run under the relay's default policy and
// the round-robin run.
type SoakReport struct {
	Config     SoakConfig
	Main       *SoakRun
	RoundRobin *SoakRun // nil without one
}

// SoakRun is one run's figures.
type SoakRun struct {
	// Policy is the relay's --policy.
	Policy string
	// Wall is the load's duration (clients running).
	Wall time.Duration
	// Causes counts the requests by how they ended: ok, cancelled (by the
	// client, mid-stream), or a broken answer: cut (a stream without
	// [DONE]), error_event, mixed (two completions in a stream),
	// bad_event, bad_json (an answer that does not parse), hang; or failed
	// (an error status or no answer).
	Causes map[string]int
	// Examples of each cause but ok and cancelled, a few each.
	Examples map[string][]string
	// Streams and Keyed count the requests streamed and with a session key.
	Streams, Keyed int
	// PromptTokens and CachedTokens sum the usage of the answers; Window
	// the same for requests started within the Baseline window.
	PromptTokens, CachedTokens             int64
	WindowPromptTokens, WindowCachedTokens int64
	// Samples are the processes' figures every Sample.
	Samples []SoakSample
	// Restarted is when agent 0 was stopped, and Rejoined when its new
	// process joined the relay again (zero: no restart).
	Restarted, Rejoined time.Duration
	// Panics are the panics any process reported.
	Panics []string
	// Events are the warnings and errors the relay and the agents logged
	// during the load (the first soakEvents), with their time since the
	// load began: what to read when a check fails.
	Events []string
}

// SoakSample is the processes' figures at one time.
type SoakSample struct {
	// At is the time since the load began.
	At time.Duration
	// Completed counts the requests ended so far.
	Completed int64
	// RelayHeap and RelayGoroutines are the relay's heap in use after a
	// collection and its goroutines; AgentHeap and AgentGoroutines the
	// same by agent (-1 when unknown, as while one restarts).
	RelayHeap, RelayGoroutines    int64
	AgentHeap, AgentGoroutines    []int64
	RelayCPU, AgentCPU, EngineCPU time.Duration // user+system so far (agents and engines summed; a restarted agent's first process left out)
	ClientCPU                     time.Duration // this process
	// Running and Waiting sum the engines' batch and queue.
	Running, Waiting int
}

// HitRatio returns the share of prompt tokens served from the engines'
// caches, over all answers and over the Baseline window.
func (r *SoakRun) HitRatio() (all, window float64) {
	if r.PromptTokens > 0 {
		all = float64(r.CachedTokens) / float64(r.PromptTokens)
	}
	if r.WindowPromptTokens > 0 {
		window = float64(r.WindowCachedTokens) / float64(r.WindowPromptTokens)
	}
	return all, window
}

// Requests returns the number of requests the run sent.
func (r *SoakRun) Requests() int {
	n := 0
	for _, v := range r.Causes {
		n += v
	}
	return n
}

// Broken returns the answers that were broken (cancelled ones are not) and
// the requests that failed.
func (r *SoakRun) Broken() (broken, failed int) {
	for k, v := range r.Causes {
		switch k {
		case "ok", "cancelled":
		case "failed":
			failed += v
		default:
			broken += v
		}
	}
	return broken, failed
}

// Soak runs the soak: the main run, then the round-robin run. Errors are
// about the runs themselves (a process that would not start); what the
// processes did is in the report (see SoakReport.Failures).
func Soak(ctx context.Context, cfg SoakConfig) (*SoakReport, error) {
	cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rep := &SoakReport{Config: cfg}
	var err error
	rep.Main, err = soakRun(ctx, cfg, "sticky", cfg.Duration, cfg.RestartAt)
	if err != nil || cfg.Baseline < 0 {
		return rep, err
	}
	rep.RoundRobin, err = soakRun(ctx, cfg, "round-robin", cfg.Baseline, -1)
	return rep, err
}

// soak is one run on its cluster.
type soak struct {
	*cluster
	cfg       SoakConfig
	run       *SoakRun
	client    *http.Client
	loadStart time.Time
	completed atomic.Int64
	prompts   []string

	mu    sync.Mutex // guards the following fields, and run's Restarted and Rejoined
	stats []soakStat
	// cpuGone is the CPU time of agent processes that ended (restarted).
	cpuGone time.Duration
}

// soakStat is one request's fate.
type soakStat struct {
	start          time.Duration
	cause          string
	stream, keyed  bool
	prompt, cached int32
}

func soakRun(ctx context.Context, cfg SoakConfig, policy string, dur, restartAt time.Duration) (*SoakRun, error) {
	dir, err := os.MkdirTemp("", "computeflux-soak-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	s := &soak{cfg: cfg, run: &SoakRun{Policy: policy, Causes: map[string]int{}, Examples: map[string][]string{}}}
	s.cluster = newCluster(clusterSpec{
		Name: "soak " + policy, Binary: cfg.Binary, Dir: dir, Agents: cfg.Agents,
		RelayArgs:  []string{"--policy", policy},
		EngineArgs: []string{"--max-running", strconv.Itoa(cfg.Slots), "--max-queue", strconv.Itoa(4 * cfg.Clients)},
		AgentArgs:  []string{"--drain-timeout", soakDrain.String()},
		// Every process serves pprof on a port of its own: heap and
		// goroutines are read there.
		Env: []string{envPprof + "=127.0.0.1:0"},
		// The relay's line per request is not kept: a million of them
		// would be the biggest thing in this process.
		Keep:     func(l logLine) bool { return l.str("message") != "request" },
		Progress: cfg.Progress, Echo: cfg.Echo,
	})
	defer s.stop()
	if err := s.start(); err != nil {
		return nil, err
	}
	tr := &http.Transport{
		// One connection per client at most, kept alive between its
		// requests, as a fleet of clients would hold.
		MaxConnsPerHost: cfg.Clients + 8, MaxIdleConnsPerHost: cfg.Clients + 8,
		IdleConnTimeout: 90 * time.Second, DisableCompression: true,
	}
	defer tr.CloseIdleConnections()
	s.client = &http.Client{Transport: tr, Timeout: cfg.RequestTimeout}
	s.prompts = systemPrompts(cfg.Seed)
	return s.run, s.load(ctx, dur, restartAt)
}

// envPprof is the environment variable naming pprof's listen address (see
// cmd/computeflux/pprof.go).
const envPprof = "COMPUTEFLUX_PPROF"

// load runs the clients for dur, restarts agent 0 at restartAt (if
// positive) and samples the processes (in the main run), then gathers the
// figures.
func (s *soak) load(ctx context.Context, dur, restartAt time.Duration) error {
	sampling := restartAt > 0 || s.run.Policy == "sticky"
	s.progress("%d clients for %v", s.cfg.Clients, dur)
	s.loadStart = time.Now()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range s.cfg.Clients {
		wg.Go(func() { s.client1(ctx, i, stop) })
	}
	var bg sync.WaitGroup
	sampleStop := make(chan struct{})
	if sampling {
		bg.Go(func() { s.sampleLoop(ctx, sampleStop) })
	}
	var restartErr error
	if restartAt > 0 && restartAt < dur {
		bg.Go(func() { restartErr = s.restart(ctx, restartAt) })
	}
	select {
	case <-ctx.Done():
	case <-time.After(dur):
	}
	if sampling {
		s.sample(ctx) // the last figures under full load
	}
	close(sampleStop)
	close(stop)
	wg.Wait()
	bg.Wait()
	s.run.Wall = time.Since(s.loadStart)
	s.progress("load ended after %v: %d requests", s.run.Wall.Round(time.Second), s.completed.Load())
	s.tally()
	s.run.Panics = s.panics(context.WithoutCancel(ctx), s.client)
	s.run.Events = s.events()
	if restartErr != nil {
		return restartErr
	}
	return ctx.Err()
}

// soakEvents bounds SoakRun.Events.
const soakEvents = 60

// events returns the warnings and errors the relay and the agents logged
// since the load began, in order.
func (s *soak) events() []string {
	var lines []logLine
	var names []string
	for _, p := range s.processes() {
		if !strings.HasPrefix(p.name, "engine") {
			for _, l := range p.logs() {
				if lv := l.str("level"); l.at.After(s.loadStart) && (lv == "warn" || lv == "error") {
					lines = append(lines, l)
					names = append(names, p.name)
				}
			}
		}
	}
	idx := make([]int, len(lines))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int { return lines[a].at.Compare(lines[b].at) })
	var out []string
	for _, i := range idx[:min(len(idx), soakEvents)] {
		l := lines[i]
		out = append(out, fmt.Sprintf("%v %s: %s (agent %s, error %v)", l.at.Sub(s.loadStart).Round(time.Millisecond), names[i], l.str("message"), l.str("agent"), l.fields["error"]))
	}
	return out
}

// restart stops agent 0 at restartAt (SIGTERM: it drains) and starts it
// again on its identity, its engine untouched.
func (s *soak) restart(ctx context.Context, at time.Duration) error {
	select {
	case <-ctx.Done():
		return nil
	case <-time.After(time.Until(s.loadStart.Add(at))):
	}
	old := s.agent(0)
	at = time.Since(s.loadStart)
	s.mu.Lock()
	s.run.Restarted = at
	s.mu.Unlock()
	s.progress("restart %s at %v (its engine keeps running)", agentName(0), at.Round(time.Second))
	old.stop(soakDrain + 10*time.Second)
	s.mu.Lock()
	if st := old.cmd.ProcessState; st != nil {
		s.cpuGone += st.UserTime() + st.SystemTime()
	}
	s.mu.Unlock()
	joined, err := s.startAgent(0)
	if err != nil {
		return fmt.Errorf("soak: restart %s: %w", agentName(0), err)
	}
	s.mu.Lock()
	s.run.Rejoined = joined.Sub(s.loadStart)
	s.mu.Unlock()
	s.progress("%s joined again at %v", agentName(0), joined.Sub(s.loadStart).Round(time.Second))
	return nil
}

// pprofURL returns p's pprof base URL, read from its stderr.
func pprofURL(p *proc) string {
	for _, l := range p.rawLines() {
		if rest, ok := strings.CutPrefix(l, "computeflux: pprof on "); ok {
			return strings.TrimSpace(rest)
		}
	}
	return ""
}

// sampleLoop samples every Sample until stop.
func (s *soak) sampleLoop(ctx context.Context, stop chan struct{}) {
	t := time.NewTicker(s.cfg.Sample)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-stop:
			return
		case <-t.C:
			s.sample(ctx)
		}
	}
}

// sample measures the processes once.
func (s *soak) sample(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Sample)
	defer cancel()
	sm := SoakSample{At: time.Since(s.loadStart), Completed: s.completed.Load()}
	sm.RelayHeap, sm.RelayGoroutines = s.memory(ctx, s.relay)
	sm.RelayCPU, _ = procCPU(s.relay.cmd.Process.Pid)
	sm.ClientCPU, _ = procCPU(os.Getpid())
	for i := range s.cfg.Agents {
		a := s.agent(i)
		h, g := s.memory(ctx, a)
		sm.AgentHeap, sm.AgentGoroutines = append(sm.AgentHeap, h), append(sm.AgentGoroutines, g)
		if c, err := procCPU(a.cmd.Process.Pid); err == nil {
			sm.AgentCPU += c
		}
	}
	for i, e := range s.engines {
		if c, err := procCPU(e.cmd.Process.Pid); err == nil {
			sm.EngineCPU += c
		}
		m, err := fetchMetrics(ctx, s.client, s.engURL[i]+"/metrics")
		if err == nil {
			sm.Running += int(sumSeries(m, "vllm:num_requests_running"))
			sm.Waiting += int(sumSeries(m, "vllm:num_requests_waiting"))
		}
	}
	s.mu.Lock()
	sm.AgentCPU += s.cpuGone
	s.run.Samples = append(s.run.Samples, sm)
	s.mu.Unlock()
}

// memory returns p's heap in use after a collection and its goroutines,
// from its pprof; -1 when unknown (a process stopping or gone).
func (s *soak) memory(ctx context.Context, p *proc) (heap, goroutines int64) {
	heap, goroutines = -1, -1
	if p == nil || p.ended.Load() {
		return
	}
	base := pprofURL(p)
	if base == "" {
		return
	}
	if b, err := getBody(ctx, s.client, base+"heap?gc=1&debug=1"); err == nil {
		if i := bytes.Index(b, []byte("# HeapInuse = ")); i >= 0 {
			heap = leadingInt(b[i+len("# HeapInuse = "):])
		}
	}
	if b, err := getBody(ctx, s.client, base+"goroutine?debug=1"); err == nil {
		if rest, ok := bytes.CutPrefix(b, []byte("goroutine profile: total ")); ok {
			goroutines = leadingInt(rest)
		}
	}
	return heap, goroutines
}

func leadingInt(b []byte) int64 {
	n := 0
	for n < len(b) && b[n] >= '0' && b[n] <= '9' {
		n++
	}
	v, err := strconv.ParseInt(string(b[:n]), 10, 64)
	if err != nil {
		return -1
	}
	return v
}

// sumSeries sums the series of metric name (any labels).
func sumSeries(m map[string]float64, name string) float64 {
	var sum float64
	for k, v := range m {
		if k == name || strings.HasPrefix(k, name+"{") {
			sum += v
		}
	}
	return sum
}

// procCPU returns the user and system time process pid used so far, from
// /proc/<pid>/stat (Linux; clock ticks of 10 ms).
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces: fields count from the
	// last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("soak: unreadable /proc stat")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, errors.New("soak: short /proc stat")
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, errors.New("soak: bad /proc stat")
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond, nil
}

// client1 is one client: conversations one after another until stop, each
// a few turns on a shared system prompt, the history re-sent every turn.
func (s *soak) client1(ctx context.Context, id int, stop chan struct{}) {
	rng := rand.New(rand.NewPCG(s.cfg.Seed, uint64(id)))
	// A fleet does not start in one millisecond: the clients come over
	// the first soakRamp.
	if !s.pause(ctx, stop, time.Duration(rng.Int64N(int64(soakRamp)))) {
		return
	}
	for conv := 0; ; conv++ {
		key := ""
		if rng.Float64() < s.cfg.KeyedShare {
			key = fmt.Sprintf("soak-%d-%d", id, conv)
		}
		msgs := []chatMessage{{Role: "system", Content: s.prompts[rng.IntN(len(s.prompts))]}}
		turns := 2 + rng.IntN(5)
		for range turns {
			select {
			case <-stop:
				return
			case <-ctx.Done():
				return
			default:
			}
			msgs = append(msgs, chatMessage{Role: "user", Content: userMessage(rng)})
			stream := rng.Float64() < s.cfg.StreamShare
			cancelAfter := 0
			if stream && rng.Float64() < s.cfg.CancelShare {
				cancelAfter = 1 + rng.IntN(8)
			}
			answer, cause := s.turn(ctx, msgs, key, stream, cancelAfter, s.cfg.MinTokens+rng.IntN(s.cfg.MaxTokens-s.cfg.MinTokens+1))
			if cause == "failed" {
				// As the OpenAI SDKs do: a while before trying again.
				if !s.pause(ctx, stop, soakBackoff/2+time.Duration(rng.Int64N(int64(soakBackoff)))) {
					return
				}
			}
			if cause != "ok" {
				break // a new conversation
			}
			msgs = append(msgs, chatMessage{Role: "assistant", Content: answer})
		}
	}
}

// pause waits d, and reports false if the run ended meanwhile.
func (s *soak) pause(ctx context.Context, stop chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-stop:
	case <-ctx.Done():
	}
	return false
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatRequest struct {
	Model         string        `json:"model"`
	Messages      []chatMessage `json:"messages"`
	MaxTokens     int           `json:"max_tokens"`
	Stream        bool          `json:"stream,omitempty"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options,omitempty"`
}

type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// turn sends one request and records how it ended; it returns the answer
// and how the request ended (see SoakRun.Causes).
func (s *soak) turn(ctx context.Context, msgs []chatMessage, key string, stream bool, cancelAfter, maxTokens int) (string, string) {
	body := chatRequest{Model: "computeflux-sim", Messages: msgs, MaxTokens: maxTokens, Stream: stream}
	if stream {
		body.StreamOptions = &struct {
			IncludeUsage bool `json:"include_usage"`
		}{true}
	}
	b, _ := json.Marshal(&body)
	st := soakStat{start: time.Since(s.loadStart), stream: stream, keyed: key != ""}
	answer, usage, cause, detail := s.send(ctx, b, key, stream, cancelAfter)
	st.cause = cause
	if usage != nil {
		st.prompt, st.cached = int32(usage.PromptTokens), int32(usage.PromptTokensDetails.CachedTokens)
	}
	s.completed.Add(1)
	s.mu.Lock()
	s.stats = append(s.stats, st)
	if cause != "ok" && cause != "cancelled" && len(s.run.Examples[cause]) < 5 {
		s.run.Examples[cause] = append(s.run.Examples[cause], fmt.Sprintf("at %v (stream %v): %s", st.start.Round(time.Millisecond), stream, detail))
	}
	s.mu.Unlock()
	return answer, cause
}

// send sends one chat request and reads its answer whole.
func (s *soak) send(ctx context.Context, body []byte, key string, stream bool, cancelAfter int) (answer string, usage *usageJSON, cause, detail string) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.relayURL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return "", nil, "failed", err.Error()
	}
	req.Header.Set("Authorization", "Bearer "+s.key)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("X-Session-ID", key)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		if isTimeout(err) {
			return "", nil, "hang", err.Error()
		}
		return "", nil, "failed", err.Error()
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return "", nil, "failed", fmt.Sprintf("status %d: %s", resp.StatusCode, b)
	}
	if !stream {
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			if isTimeout(err) {
				return "", nil, "hang", err.Error()
			}
			return "", nil, "cut", err.Error()
		}
		var out struct {
			Choices []struct {
				Message chatMessage `json:"message"`
			} `json:"choices"`
			Usage *usageJSON `json:"usage"`
		}
		if err := json.Unmarshal(b, &out); err != nil || len(out.Choices) == 0 {
			return "", nil, "bad_json", fmt.Sprintf("%v: %.200s", err, b)
		}
		return out.Choices[0].Message.Content, out.Usage, "ok", ""
	}
	var sb strings.Builder
	var id string
	br := bufio.NewReader(resp.Body)
	events := 0
	for {
		line, err := br.ReadSlice('\n')
		if data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data: ")); ok {
			if string(data) == "[DONE]" {
				return sb.String(), usage, "ok", ""
			}
			var ev struct {
				ID      string `json:"id"`
				Choices []struct {
					Delta struct {
						Content string `json:"content"`
					} `json:"delta"`
				} `json:"choices"`
				Usage *usageJSON                `json:"usage"`
				Error *struct{ Message string } `json:"error"`
			}
			if err := json.Unmarshal(data, &ev); err != nil {
				return "", nil, "bad_event", fmt.Sprintf("%v: %.200s", err, data)
			}
			if ev.Error != nil {
				return "", nil, "error_event", ev.Error.Message
			}
			switch {
			case id == "":
				id = ev.ID
			case ev.ID != "" && ev.ID != id:
				return "", nil, "mixed", fmt.Sprintf("completions %s and %s", id, ev.ID)
			}
			for _, c := range ev.Choices {
				sb.WriteString(c.Delta.Content)
			}
			if ev.Usage != nil {
				usage = ev.Usage
			}
			events++
			if cancelAfter > 0 && events >= cancelAfter {
				return "", nil, "cancelled", ""
			}
		}
		if err != nil {
			if isTimeout(err) {
				return "", nil, "hang", err.Error()
			}
			return "", nil, "cut", fmt.Sprintf("after %d events: %v", events, err)
		}
	}
}

// tally turns the requests' fates into the run's figures.
func (s *soak) tally() {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.run
	for _, st := range s.stats {
		r.Causes[st.cause]++
		if st.stream {
			r.Streams++
		}
		if st.keyed {
			r.Keyed++
		}
		if st.cause != "ok" || st.prompt <= 0 {
			continue
		}
		r.PromptTokens += int64(st.prompt)
		r.CachedTokens += int64(st.cached)
		if st.start < s.cfg.Baseline {
			r.WindowPromptTokens += int64(st.prompt)
			r.WindowCachedTokens += int64(st.cached)
		}
	}
	s.stats = nil
}

// soakWords are the words prompts are made of.
var soakWords = strings.Fields(`the a of to and in is it that for on with as was at by be this from or
have an they which one you were her all she there would their we him been has when who will more no if
out so said what up its about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state good
very make world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take three
gpu cache prefix token model engine batch stream relay agent home power memory request answer queue
latency throughput context window prompt system user assistant kernel tensor matrix vector layer`)

// systemPrompts returns the shared system prompts: about a thousand tokens
// each.
func systemPrompts(seed uint64) []string {
	rng := rand.New(rand.NewPCG(seed, 0x5e5))
	out := make([]string, soakSystemPrompts)
	for i := range out {
		var sb strings.Builder
		fmt.Fprintf(&sb, "You are assistant number %d of the soak. ", i)
		for j := range 900 {
			sb.WriteString(soakWords[rng.IntN(len(soakWords))])
			if j%15 == 14 {
				sb.WriteString(". ")
			} else {
				sb.WriteByte(' ')
			}
		}
		out[i] = sb.String()
	}
	return out
}

// userMessage returns a question of 30 to 80 words.
func userMessage(rng *rand.Rand) string {
	n := 30 + rng.IntN(51)
	var sb strings.Builder
	for j := range n {
		if j > 0 {
			sb.WriteByte(' ')
		}
		sb.WriteString(soakWords[rng.IntN(len(soakWords))])
	}
	sb.WriteString("?")
	return sb.String()
}

// flatness is a figure after the warm-up and at the end of a run.
type flatness struct {
	what       string
	base, end  float64
	skipReason string
	// checked: the figure is bounded (the others are reported only).
	checked bool
}

func (f flatness) ratio() float64 {
	if f.base <= 0 {
		return 0
	}
	return f.end / f.base
}

// median returns the median of the values of samples with At in [from,
// to) that get gives (ignoring negative ones), and how many there were.
func median(samples []SoakSample, from, to time.Duration, get func(SoakSample) float64) (float64, int) {
	var v []float64
	for _, sm := range samples {
		if sm.At >= from && sm.At < to {
			if x := get(sm); x >= 0 {
				v = append(v, x)
			}
		}
	}
	if len(v) == 0 {
		return -1, 0
	}
	slices.Sort(v)
	return v[len(v)/2], len(v)
}

// flat returns the heap and goroutines after the warm-up (the median of
// the samples of the following three sample periods) and at the end (the
// median of the last three samples): the relay's, the agents' together,
// and each agent's. An agent's own figures move with the share of the
// requests the relay routes to it, which shifts by tens of percent from one
// sample to the next: they are reported, and the agents' total, which moves
// only with all the requests in flight, is what is bounded, with the
// relay's. The restarted agent's own warm-up starts at its rejoin; too
// short a rest of the run leaves it out.
func (rep *SoakReport) flat() []flatness {
	r, cfg := rep.Main, rep.Config
	if r == nil || len(r.Samples) == 0 {
		return nil
	}
	endFrom := r.Samples[max(0, len(r.Samples)-3)].At
	window := 3 * cfg.Sample
	var out []flatness
	add := func(what string, checked bool, from time.Duration, get func(SoakSample) float64) {
		f := flatness{what: what, checked: checked}
		var n int
		f.base, n = median(r.Samples, from, from+window, get)
		f.end, _ = median(r.Samples, endFrom, r.Wall+time.Hour, get)
		switch {
		case from+window > endFrom:
			f.skipReason = fmt.Sprintf("its warm-up ends at %v, too late in a run of %v", (from + window).Round(time.Second), r.Wall.Round(time.Second))
		case n == 0 || f.end < 0:
			f.skipReason = "not measured"
		}
		out = append(out, f)
	}
	total := func(v []int64) float64 {
		var sum int64
		for _, x := range v {
			if x < 0 {
				return -1 // an agent restarting
			}
			sum += x
		}
		return float64(sum)
	}
	add("relay heap", true, cfg.Warmup, func(s SoakSample) float64 { return float64(s.RelayHeap) })
	add("relay goroutines", true, cfg.Warmup, func(s SoakSample) float64 { return float64(s.RelayGoroutines) })
	add("agents' heap", true, cfg.Warmup, func(s SoakSample) float64 { return total(s.AgentHeap) })
	add("agents' goroutines", true, cfg.Warmup, func(s SoakSample) float64 { return total(s.AgentGoroutines) })
	for i := range cfg.Agents {
		from := cfg.Warmup
		if i == 0 && r.Rejoined > 0 {
			from = max(from, r.Rejoined+cfg.Warmup)
		}
		add(agentName(i)+" heap", false, from, func(s SoakSample) float64 {
			if i < len(s.AgentHeap) {
				return float64(s.AgentHeap[i])
			}
			return -1
		})
		add(agentName(i)+" goroutines", false, from, func(s SoakSample) float64 {
			if i < len(s.AgentGoroutines) {
				return float64(s.AgentGoroutines[i])
			}
			return -1
		})
	}
	return out
}

// cpuPerRequest returns the relay's CPU time per request over the first
// minute after the warm-up and over the last minute of the run (or a third
// of what follows the warm-up, if shorter).
func (rep *SoakReport) cpuPerRequest() (first, last time.Duration, ok bool) {
	r := rep.Main
	if r == nil || len(r.Samples) < 2 {
		return 0, 0, false
	}
	w := min(time.Minute, (r.Wall-rep.Config.Warmup)/3)
	at := func(t time.Duration) SoakSample { // the first sample at or after t
		for _, s := range r.Samples {
			if s.At >= t {
				return s
			}
		}
		return r.Samples[len(r.Samples)-1]
	}
	per := func(a, b SoakSample) time.Duration {
		if n := b.Completed - a.Completed; n > 0 {
			return (b.RelayCPU - a.RelayCPU) / time.Duration(n)
		}
		return 0
	}
	end := r.Samples[len(r.Samples)-1]
	first = per(at(rep.Config.Warmup), at(rep.Config.Warmup+w))
	last = per(at(end.At-w), end)
	return first, last, first > 0 && last > 0
}

// Bounds the soak checks.
const (
	// soakFlat is how far heap and goroutines may move from their value
	// after the warm-up.
	soakFlat = 0.10
	// soakCPUGrowth is how much more CPU per request the relay may use at
	// the end than after the warm-up: room for a noisy shared machine; a
	// cost that grows with the run's length (a leak, a scan of a growing
	// table) goes well past it.
	soakCPUGrowth = 1.5
)

// Failures returns what the soak's checks found wrong: broken answers,
// failed requests, panics, heap or goroutines not flat, relay CPU per
// request growing, or a cache hit ratio no better than round-robin's.
func (rep *SoakReport) Failures() []string {
	var out []string
	for _, r := range []*SoakRun{rep.Main, rep.RoundRobin} {
		if r == nil {
			continue
		}
		broken, failed := r.Broken()
		if broken+failed > 0 {
			out = append(out, fmt.Sprintf("%s: %d broken answers and %d failed requests of %d: %v %v", r.Policy, broken, failed, r.Requests(), r.Causes, r.Examples))
		}
		if r.Causes["ok"] == 0 {
			out = append(out, r.Policy+": no request was served")
		}
		for _, p := range r.Panics {
			out = append(out, r.Policy+": panic: "+p)
		}
	}
	for _, f := range rep.flat() {
		if f.checked && f.skipReason != "" {
			out = append(out, fmt.Sprintf("%s not compared: %s", f.what, f.skipReason))
		}
		if f.checked && f.skipReason == "" && (f.ratio() > 1+soakFlat || f.ratio() < 1-soakFlat) {
			out = append(out, fmt.Sprintf("%s not flat: %.0f after the warm-up, %.0f at the end (%.2fx; bound ±%.0f%%)", f.what, f.base, f.end, f.ratio(), 100*soakFlat))
		}
	}
	if first, last, ok := rep.cpuPerRequest(); ok && float64(last) > soakCPUGrowth*float64(first) {
		out = append(out, fmt.Sprintf("relay CPU per request grew from %v to %v (bound %.1fx)", first, last, soakCPUGrowth))
	}
	if rep.Main != nil && rep.RoundRobin != nil {
		_, main := rep.Main.HitRatio()
		_, rr := rep.RoundRobin.HitRatio()
		if main <= rr {
			out = append(out, fmt.Sprintf("cache hit ratio %.1f%% is no better than round-robin's %.1f%% over the first %v", 100*main, 100*rr, rep.Config.Baseline))
		}
	}
	return out
}

// Write prints the report's figures.
func (rep *SoakReport) Write(w io.Writer) {
	cfg := rep.Config
	fmt.Fprintf(w, "soak (real processes): 1 relay, %d agents, sim engines at real time with %d batch slots; %d clients, %.0f%% streamed, %.0f%% of streams cancelled, %.0f%% of conversations with a session key\n",
		cfg.Agents, cfg.Slots, cfg.Clients, 100*cfg.StreamShare, 100*cfg.CancelShare, 100*cfg.KeyedShare)
	for _, r := range []*SoakRun{rep.Main, rep.RoundRobin} {
		if r == nil {
			continue
		}
		broken, failed := r.Broken()
		all, window := r.HitRatio()
		fmt.Fprintf(w, "%s: %d requests in %v (%.0f/s; %d streamed, %d with a session key): %v\n",
			r.Policy, r.Requests(), r.Wall.Round(time.Second), float64(r.Requests())/r.Wall.Seconds(), r.Streams, r.Keyed, r.Causes)
		fmt.Fprintf(w, "  broken answers %d, failed requests %d; cache hit ratio %.1f%% (first %v: %.1f%%)\n", broken, failed, 100*all, cfg.Baseline, 100*window)
		for cause, ex := range r.Examples {
			for _, e := range ex {
				fmt.Fprintf(w, "    %s %s\n", cause, e)
			}
		}
		if r.Restarted > 0 {
			fmt.Fprintf(w, "  %s stopped at %v (drained), joined again at %v\n", agentName(0), r.Restarted.Round(time.Second), r.Rejoined.Round(time.Second))
		}
		writePanics(w, r.Panics)
	}
	if rep.Main != nil && rep.RoundRobin != nil {
		_, main := rep.Main.HitRatio()
		_, rr := rep.RoundRobin.HitRatio()
		ratio := "-"
		if rr > 0 {
			ratio = fmt.Sprintf("%.2fx", main/rr)
		}
		fmt.Fprintf(w, "cache hit ratio over the first %v of each run: %s %.1f%%, round-robin %.1f%% (%s)\n", cfg.Baseline, rep.Main.Policy, 100*main, 100*rr, ratio)
	}
	for _, f := range rep.flat() {
		if f.skipReason != "" {
			fmt.Fprintf(w, "  %s: not compared (%s)\n", f.what, f.skipReason)
			continue
		}
		unit := ""
		base, end := f.base, f.end
		if strings.HasSuffix(f.what, "heap") {
			unit, base, end = " MiB", base/(1<<20), end/(1<<20)
		}
		bound := fmt.Sprintf("bound ±%.0f%%", 100*soakFlat)
		if !f.checked {
			bound = "not bounded: moves with routing"
		}
		fmt.Fprintf(w, "  %s: %.1f%s after the warm-up, %.1f%s at the end (%.2fx; %s)\n", f.what, base, unit, end, unit, f.ratio(), bound)
	}
	if first, last, ok := rep.cpuPerRequest(); ok {
		fmt.Fprintf(w, "  relay CPU per request: %v after the warm-up, %v at the end (%.2fx)\n", first.Round(time.Microsecond), last.Round(time.Microsecond), float64(last)/float64(first))
	}
	if r := rep.Main; r != nil && len(r.Samples) > 1 {
		a, b := r.Samples[0], r.Samples[len(r.Samples)-1]
		span := (b.At - a.At).Seconds()
		var running, waiting float64
		n := 0
		for _, s := range r.Samples {
			if s.At >= cfg.Warmup {
				running += float64(s.Running)
				waiting += float64(s.Waiting)
				n++
			}
		}
		if n > 0 {
			running, waiting = running/float64(n), waiting/float64(n)
		}
		fmt.Fprintf(w, "  at the engines after the warm-up: %.0f running and %.0f waiting on average, of %d clients\n", running, waiting, cfg.Clients)
		fmt.Fprintf(w, "  CPU in cores: relay %.2f, agents %.2f, engines %.2f, clients (this process) %.2f\n",
			(b.RelayCPU-a.RelayCPU).Seconds()/span, (b.AgentCPU-a.AgentCPU).Seconds()/span, (b.EngineCPU-a.EngineCPU).Seconds()/span, (b.ClientCPU-a.ClientCPU).Seconds()/span)
		fmt.Fprintln(w, "  samples (time, completed, relay heap MiB, relay goroutines, agents' heap MiB, agents' goroutines, engines running+waiting):")
		for _, s := range r.Samples {
			var ah, ag []string
			for i := range s.AgentHeap {
				h, g := "-", "-" // not measured: stopping or starting
				if s.AgentHeap[i] >= 0 {
					h = fmt.Sprintf("%.1f", float64(s.AgentHeap[i])/(1<<20))
				}
				if s.AgentGoroutines[i] >= 0 {
					g = strconv.FormatInt(s.AgentGoroutines[i], 10)
				}
				ah, ag = append(ah, h), append(ag, g)
			}
			fmt.Fprintf(w, "    %6v %7d %6.1f %6d  [%s] [%s]  %d+%d\n", s.At.Round(time.Second), s.Completed, float64(s.RelayHeap)/(1<<20), s.RelayGoroutines,
				strings.Join(ah, " "), strings.Join(ag, " "), s.Running, s.Waiting)
		}
	}
	if f := rep.Failures(); len(f) > 0 {
		fmt.Fprintf(w, "FAILED: %d checks\n", len(f))
		for _, x := range f {
			fmt.Fprintf(w, "  %s\n", x)
		}
		for _, r := range []*SoakRun{rep.Main, rep.RoundRobin} {
			if r != nil && len(r.Events) > 0 {
				fmt.Fprintf(w, "%s: warnings and errors logged during the load:\n", r.Policy)
				for _, e := range r.Events {
					fmt.Fprintf(w, "  %s\n", e)
				}
			}
		}
	} else {
		fmt.Fprintln(w, "all checks passed")
	}
}
