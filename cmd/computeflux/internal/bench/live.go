package bench

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/scheduler"
)

// liveRun is one policy's run against a real in-process cluster.
type liveRun struct {
	cfg    *Config
	w      *Workload
	c      *relaytest.Cluster
	urls   []string // the relays' URLs, requests spread over them at random
	client *http.Client
	start  time.Time
	sent   atomic.Int64
	done   atomic.Int64
	failed atomic.Int64

	mu   sync.Mutex // guards recs
	recs []record
}

// runLive runs policy p on a fresh cluster and drives w through the relay.
func runLive(ctx context.Context, cfg *Config, w *Workload, p scheduler.Policy) (Result, error) {
	wall := time.Now()
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	engines := cfg.Engines
	if cfg.Scenario == ScenarioJoin {
		engines--
	}
	ec := cfg.Engine
	ec.Seed = cfg.Seed
	tr := &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096, IdleConnTimeout: 30 * time.Second}
	defer tr.CloseIdleConnections()
	c, err := relaytest.Start(ctx, relaytest.Config{
		Relays:      cfg.Relays,
		Engines:     engines,
		Engine:      simengine.Config{Models: []string{cfg.Model}, TimeScale: cfg.TimeScale, Engine: ec},
		Policy:      p,
		Scheduler:   cfg.Scheduler,
		MaxAttempts: cfg.MaxAttempts,
		Capacity:    cfg.Capacity,
	})
	if err != nil {
		return Result{}, err
	}
	defer c.Close()
	r := &liveRun{cfg: cfg, w: w, c: c, urls: c.URLs(), client: &http.Client{Transport: tr}, start: time.Now()}
	res, err := r.drive(ctx, p, wall)
	if cfg.Relays > 0 {
		r.peerTraffic(&res)
	}
	return res, err
}

// errRelaysScenario refuses a live run of several relays with a fault
// scenario: the faults are the one relay's.
var errRelaysScenario = errors.New("several live relays run the steady scenario only")

// peerTraffic reports the sessions protocol traffic between the relays:
// the bindings sent, and the bytes each relay sent per second of real time
// since the cluster was ready.
func (r *liveRun) peerTraffic(res *Result) {
	var bytes, updates uint64
	relays := r.c.Relays()
	for _, rl := range relays {
		st := rl.PeerStats()
		bytes += st.BytesSent
		updates += st.BindingsSent
	}
	res.Relays = len(relays)
	res.BindingUpdates = int64(updates)
	if d := time.Since(r.start); d > 0 {
		res.BindingBytesPerSec = float64(bytes) / d.Seconds() / float64(len(relays))
	}
}

// drive runs the workload and the scenario through the cluster.
func (r *liveRun) drive(ctx context.Context, p scheduler.Policy, wall time.Time) (Result, error) {
	cfg, w := r.cfg, r.w
	var wg sync.WaitGroup
	stopAux := make(chan struct{})
	var actErr error
	wg.Go(func() { actErr = r.scenario(ctx, stopAux) })
	if cfg.Progress != nil {
		wg.Go(func() { r.progress(p, stopAux) })
	}
	var clients sync.WaitGroup
	if w.Chat {
		for i := range w.Sessions {
			clients.Go(func() { r.chatSession(ctx, i) })
		}
	} else {
		clients.Go(func() { r.replay(ctx, &clients) })
	}
	clients.Wait()
	close(stopAux)
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return Result{}, fmt.Errorf("live run stopped after %d of %d requests: %w", r.done.Load(), w.Requests(), err)
	}
	if actErr != nil {
		return Result{}, actErr
	}
	res := summarize(p.String(), cfg.Scenario.String(), "live", r.recs, cfg.Engines)
	res.Wall = time.Since(wall)
	res.IndexTraffic = indexTraffic(r.prefixTraffic(), r.model(time.Since(r.start)))
	return res, nil
}

// real converts model time to real time.
func (r *liveRun) real(d time.Duration) time.Duration {
	return time.Duration(float64(d) / r.cfg.TimeScale)
}

// model converts real time to model time.
func (r *liveRun) model(d time.Duration) time.Duration {
	return time.Duration(float64(d) * r.cfg.TimeScale)
}

// sleepUntil waits until model time at; false if ctx ended.
func (r *liveRun) sleepUntil(ctx context.Context, at time.Duration) bool {
	d := time.Until(r.start.Add(r.real(at)))
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// admit reports whether another request may be sent now (the run's bounds).
func (r *liveRun) admit() bool {
	if r.cfg.Duration > 0 && r.model(time.Since(r.start)) > r.cfg.Duration {
		return false
	}
	if n := r.sent.Add(1); r.cfg.MaxRequests > 0 && n > int64(r.cfg.MaxRequests) {
		return false
	}
	return true
}

// chatSession plays session i: turn after turn, each after its think time.
func (r *liveRun) chatSession(ctx context.Context, i int) {
	s := &r.w.Sessions[i]
	conv := newConversation(r.w, s)
	at := s.Start
	for t := range s.Turns {
		turn := &s.Turns[t]
		at += turn.Think
		if !r.sleepUntil(ctx, at) || !r.admit() {
			return
		}
		answer, ok := r.request(ctx, s.Key, conv.next(turn), turn.MaxTokens)
		if !ok {
			return // a client gives up on a conversation after an error
		}
		conv.answered(answer)
		at = r.model(time.Since(r.start))
	}
}

// replay sends every trace request at its time.
func (r *liveRun) replay(ctx context.Context, wg *sync.WaitGroup) {
	type item struct {
		s *Session
		t *Turn
	}
	var items []item
	for i := range r.w.Sessions {
		for j := range r.w.Sessions[i].Turns {
			items = append(items, item{&r.w.Sessions[i], &r.w.Sessions[i].Turns[j]})
		}
	}
	slices.SortStableFunc(items, func(a, b item) int { return cmp.Compare(a.t.At, b.t.At) })
	for _, it := range items {
		if !r.sleepUntil(ctx, it.t.At) || !r.admit() {
			return
		}
		conv := newConversation(r.w, it.s)
		msgs := conv.next(it.t)
		wg.Go(func() { r.request(ctx, it.s.Key, msgs, it.t.MaxTokens) })
	}
}

// chatRequest is the body the bench sends.
type chatRequest struct {
	Model         string    `json:"model"`
	Messages      []message `json:"messages"`
	Stream        bool      `json:"stream"`
	MaxTokens     int       `json:"max_tokens"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

// streamChunk is the part of a streamed chunk the bench reads.
type streamChunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		Details          struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// StreamReply is what a streamed chat completion carried.
type StreamReply struct {
	// Answer is the content of every delta, in order.
	Answer string
	// PromptTokens, CompletionTokens and CachedTokens are the usage chunk's
	// counts; Usage tells whether the stream had one.
	PromptTokens, CompletionTokens, CachedTokens int
	Usage                                        bool
	// Done tells whether the stream ended with [DONE].
	Done bool
}

// ReadStream reads a streamed chat completion's server-sent events from
// body until [DONE] or its end, calling first (if not nil) when the first
// content arrives. A chunk that does not decode, an error chunk or an
// answer without any content is an error.
func ReadStream(body io.Reader, first func()) (StreamReply, error) {
	var reply StreamReply
	var answer strings.Builder
	gotFirst := false
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			reply.Done = true
			break
		}
		var ch streamChunk
		if err := json.Unmarshal([]byte(line), &ch); err != nil {
			return reply, fmt.Errorf("stream: %w", err)
		}
		if ch.Error != nil {
			return reply, fmt.Errorf("stream error: %s", ch.Error.Message)
		}
		for _, c := range ch.Choices {
			if c.Delta.Content != "" && !gotFirst {
				gotFirst = true
				if first != nil {
					first()
				}
			}
			answer.WriteString(c.Delta.Content)
		}
		if ch.Usage != nil {
			reply.Usage = true
			reply.PromptTokens, reply.CompletionTokens, reply.CachedTokens = ch.Usage.PromptTokens, ch.Usage.CompletionTokens, ch.Usage.Details.CachedTokens
		}
	}
	reply.Answer = answer.String()
	if err := sc.Err(); err != nil {
		return reply, fmt.Errorf("stream: %w", err)
	}
	if !gotFirst {
		return reply, errors.New("stream ended early")
	}
	return reply, nil
}

// request sends one streamed chat completion and records it. It returns
// the answer's text and whether the request succeeded.
func (r *liveRun) request(ctx context.Context, session string, msgs []message, maxTokens int) (string, bool) {
	rec := record{engine: -1}
	sent := time.Now()
	rec.first = r.model(sent.Sub(r.start))
	answer, err := r.do(ctx, session, msgs, maxTokens, sent, &rec)
	if err != nil {
		rec.failed, rec.why = true, errorCause(err)
		r.failed.Add(1)
	}
	r.done.Add(1)
	r.mu.Lock()
	r.recs = append(r.recs, rec)
	r.mu.Unlock()
	return answer, err == nil
}

func (r *liveRun) do(ctx context.Context, session string, msgs []message, maxTokens int, sent time.Time, rec *record) (string, error) {
	body := chatRequest{Model: r.cfg.Model, Messages: msgs, Stream: true, MaxTokens: maxTokens}
	body.StreamOptions.IncludeUsage = true
	b, err := json.Marshal(&body)
	if err != nil {
		return "", err
	}
	base, key := r.urls[rand.IntN(len(r.urls))], r.c.APIKey()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(b))
	if err != nil {
		return "", err
	}
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	if session != "" { // a keyless workload names no session
		req.Header.Set("X-Session-ID", session)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return "", fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	if name, ok := strings.CutPrefix(resp.Header.Get("X-ComputeFlux-Agent"), "agent-"); ok {
		if n, err := strconv.Atoi(name); err == nil {
			rec.engine = n
		}
	}
	reply, err := ReadStream(resp.Body, func() { rec.ttft = r.model(time.Since(sent)) })
	rec.prompt, rec.completion, rec.cached = reply.PromptTokens, reply.CompletionTokens, reply.CachedTokens
	if err != nil {
		return "", err
	}
	if !reply.Usage || !reply.Done {
		return "", errors.New("stream ended early")
	}
	now := time.Now()
	rec.e2e = r.model(now.Sub(sent))
	rec.done = r.model(now.Sub(r.start))
	return reply.Answer, nil
}

// scenario applies the scenario's actions at their times.
func (r *liveRun) scenario(ctx context.Context, stop <-chan struct{}) error {
	for _, a := range scenarioActions(r.cfg.Scenario, r.w, r.cfg.Engines) {
		t := time.NewTimer(time.Until(r.start.Add(r.real(a.at))))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-stop:
			t.Stop()
			return nil
		case <-t.C:
		}
		var err error
		switch a.kind {
		case actSlow:
			err = r.c.SlowEngine(a.engine, a.factor)
		case actKill:
			err = r.c.KillAgent(a.engine)
		case actRestart:
			err = r.c.RestartAgent(ctx, a.engine)
		case actJoin:
			_, err = r.c.AddEngine(ctx)
		}
		if err != nil && ctx.Err() == nil {
			return fmt.Errorf("scenario %s: %w", r.cfg.Scenario, err)
		}
	}
	return nil
}

// progress prints a line every ProgressEvery until stop.
func (r *liveRun) progress(p scheduler.Policy, stop <-chan struct{}) {
	t := time.NewTicker(r.cfg.ProgressEvery)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			fmt.Fprintf(r.cfg.Progress, "bench %s %s: %d/%d requests done, %d errors, %s elapsed, model time %s\n",
				p, r.cfg.Scenario, r.done.Load(), r.w.Requests(), r.failed.Load(),
				time.Since(r.start).Round(time.Second), r.model(time.Since(r.start)).Round(time.Second))
		}
	}
}

// errorCause shortens an error to a cause worth counting.
func errorCause(err error) string {
	s := err.Error()
	if len(s) > 120 {
		s = s[:120] + "..."
	}
	return s
}

// IndexTraffic is the prefix index traffic of a live run, per agent, in
// bytes per second of model time (the trace's own clock: what an agent
// would send at the trace's real pace).
type IndexTraffic struct {
	Agents int     `json:"agents"`
	Bytes  uint64  `json:"bytes"`
	Mean   float64 `json:"mean_bytes_per_sec"`
	Max    float64 `json:"max_bytes_per_sec"`
}

// indexTraffic summarises the relay's per-agent byte counts over a run of
// span model time; nil when no agent published.
func indexTraffic(byAgent map[string]uint64, span time.Duration) *IndexTraffic {
	if len(byAgent) == 0 || span <= 0 {
		return nil
	}
	t := &IndexTraffic{Agents: len(byAgent)}
	var most uint64
	for _, b := range byAgent {
		t.Bytes += b
		most = max(most, b)
	}
	s := span.Seconds()
	t.Mean = float64(t.Bytes) / float64(len(byAgent)) / s
	t.Max = float64(most) / s
	return t
}

// prefixTraffic returns the prefix index bytes each agent sent, over all
// the run's relays.
func (r *liveRun) prefixTraffic() map[string]uint64 {
	out := make(map[string]uint64)
	for _, rl := range r.c.Relays() {
		for a, b := range rl.PrefixTraffic() {
			out[a] += b
		}
	}
	return out
}
