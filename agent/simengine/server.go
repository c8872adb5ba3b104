package simengine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
)

// Defaults for the zero values of Config.
const (
	DefaultListen            = "127.0.0.1:8000"
	DefaultModel             = "computeflux-sim"
	DefaultTimeScale         = 1.0
	DefaultMaxTokens         = 50 // 0.5 s of decode alone: the seed table's decode latency
	DefaultStreamInterval    = 10 * time.Millisecond
	DefaultMaxBodyBytes      = 32 << 20 // a 256K-token chat history is about 1.3 MB
	DefaultEmbeddingDims     = 64
	DefaultShutdownTimeout   = 5 * time.Second
	defaultReadHeaderTimeout = 10 * time.Second
)

// Config configures a Server. The zero value of every field means its
// default; New fills the defaults and checks the result.
type Config struct {
	// Listen is the TCP address Run listens on. Empty means 127.0.0.1:8000.
	Listen string
	// Models are the names the engine answers to, all aliases of one engine
	// sharing its cache and batch (vLLM's --served-model-name). Metrics are
	// labelled with the first. Empty means ["computeflux-sim"].
	Models []string
	// TimeScale runs the model this many times faster than real time: 10
	// makes a 5 s prefill take 0.5 s. Zero means 1.
	TimeScale float64
	// Engine configures the model.
	Engine EngineConfig
	// DefaultMaxTokens is the answer length when a request sets no
	// max_tokens. Zero means 50.
	DefaultMaxTokens int
	// StreamInterval is how often, in real time, streams are sent the tokens
	// decoded since the last send (each token in its own chunk). Zero means
	// 10 ms.
	StreamInterval time.Duration
	// MaxBodyBytes bounds request bodies. Zero means 32 MiB.
	MaxBodyBytes int64
	// AdminRemote lets /admin/ endpoints answer clients that are not on
	// loopback. False (the zero value) answers loopback clients only.
	AdminRemote bool
	// ShutdownTimeout bounds how long Run waits for connections to close
	// when its context ends. Zero means 5 s.
	ShutdownTimeout time.Duration
	// Logger receives the server's logs. The zero value discards them.
	Logger zerolog.Logger
}

func (c *Config) populate() {
	if c.Listen == "" {
		c.Listen = DefaultListen
	}
	if len(c.Models) == 0 {
		c.Models = []string{DefaultModel}
	}
	if c.TimeScale == 0 {
		c.TimeScale = DefaultTimeScale
	}
	if c.DefaultMaxTokens == 0 {
		c.DefaultMaxTokens = DefaultMaxTokens
	}
	if c.StreamInterval == 0 {
		c.StreamInterval = DefaultStreamInterval
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	c.Engine.populate()
}

func (c *Config) validate() error {
	for _, m := range c.Models {
		if m == "" {
			return errors.New("empty model name")
		}
	}
	switch {
	case !(c.TimeScale > 0) || math.IsInf(c.TimeScale, 0):
		return fmt.Errorf("time scale %v: must be positive and finite", c.TimeScale)
	case c.DefaultMaxTokens < 1:
		return fmt.Errorf("default max tokens %d: must be positive", c.DefaultMaxTokens)
	case c.StreamInterval < 0 || c.MaxBodyBytes < 0 || c.ShutdownTimeout < 0:
		return errors.New("stream interval, body limit and shutdown timeout must not be negative")
	}
	return c.Engine.validate()
}

// errClosing is returned to requests in flight when the server stops.
var errClosing = errors.New("simengine: server is shutting down")

// Server serves one Engine over the OpenAI HTTP API against the real clock
// scaled by Config.TimeScale. Its methods are safe for concurrent use.
type Server struct {
	cfg     Config
	log     zerolog.Logger
	handler http.Handler

	realEpoch time.Time // real time at New; model time equals it at that instant
	ids       atomic.Uint64
	stored    *responseStore // Responses API objects (responses.go)
	wake      chan struct{}  // capacity 1: the engine's next event may have moved
	closing   chan struct{}  // closed when Run stops: requests in flight end

	mu        sync.Mutex // guards the following fields
	eng       *Engine
	calls     map[uint64]*call
	streaming int // calls streaming tokens
	ln        net.Listener
	ran       bool
	events    []Event
}

// call is the server side of one generation request.
type call struct {
	notify chan struct{} // capacity 1: state changed
	stream bool
	first  bool  // guarded by Server.mu
	done   bool  // guarded by Server.mu
	usage  Usage // guarded by Server.mu
}

// New returns a server for cfg, its zero fields set to their defaults.
func New(cfg Config) (*Server, error) {
	cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("simengine: %w", err)
	}
	eng, err := NewEngine(cfg.Engine)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:       cfg,
		log:       cfg.Logger.With().Str("component", "simengine").Logger(),
		realEpoch: time.Now(),
		wake:      make(chan struct{}, 1),
		closing:   make(chan struct{}),
		eng:       eng,
		calls:     make(map[uint64]*call),
		stored:    newResponseStore(),
	}
	s.handler = s.routes()
	return s, nil
}

// Config returns the server's configuration with defaults filled in.
func (s *Server) Config() Config { return s.cfg }

// Listen opens the listener Run will serve on and returns its address
// (useful with port 0). Run calls it when it was not called before.
func (s *Server) Listen() (net.Addr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln != nil {
		return s.ln.Addr(), nil
	}
	ln, err := net.Listen("tcp", s.cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("simengine: listen: %w", err)
	}
	s.ln = ln
	return ln.Addr(), nil
}

// URL returns the base URL of the listener ("http://127.0.0.1:8000"), or ""
// before Listen.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln == nil {
		return ""
	}
	return "http://" + s.ln.Addr().String()
}

// Run serves until ctx ends, then stops: requests in flight are ended and
// Run waits for its goroutines. A Server runs once.
func (s *Server) Run(ctx context.Context) error {
	if _, err := s.Listen(); err != nil {
		return err
	}
	s.mu.Lock()
	if s.ran {
		s.mu.Unlock()
		return errors.New("simengine: server already ran")
	}
	s.ran = true
	ln := s.ln
	s.mu.Unlock()

	hs := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: defaultReadHeaderTimeout,
		ErrorLog:          nil,
	}
	loopCtx, stopLoop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { s.loop(loopCtx) })
	serveErr := make(chan error, 1)
	wg.Go(func() { serveErr <- hs.Serve(ln) })
	s.log.Info().Str("url", "http://"+ln.Addr().String()).Strs("models", s.cfg.Models).
		Float64("time_scale", s.cfg.TimeScale).Msg("sim engine serving")

	var err error
	select {
	case <-ctx.Done():
	case err = <-serveErr:
	}
	close(s.closing)
	shutCtx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
	if serr := hs.Shutdown(shutCtx); serr != nil {
		_ = hs.Close()
	}
	cancel()
	stopLoop()
	wg.Wait()
	if err == nil {
		err = <-serveErr
	}
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// SetSlowdown makes the engine factor times slower from now on (1 is
// normal speed), as the benchmark's degraded scenario needs.
func (s *Server) SetSlowdown(factor float64) error {
	s.mu.Lock()
	s.syncLocked()
	err := s.eng.SetSlowdown(s.modelNow(), factor)
	s.mu.Unlock()
	s.poke()
	if err == nil {
		s.log.Info().Float64("factor", factor).Msg("slowdown set")
	}
	return err
}

// Stats returns the engine's statistics now.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	s.syncLocked()
	st := s.eng.Stats()
	s.mu.Unlock()
	s.poke()
	return st
}

// modelNow maps the real clock to model time.
func (s *Server) modelNow() time.Time {
	return s.realEpoch.Add(time.Duration(float64(time.Since(s.realEpoch)) * s.cfg.TimeScale))
}

func (s *Server) realDuration(model time.Duration) time.Duration {
	return time.Duration(float64(model) / s.cfg.TimeScale)
}

// poke wakes the loop to recompute when the engine's next event is.
func (s *Server) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// syncLocked advances the engine to now and hands its events to the calls.
func (s *Server) syncLocked() {
	s.events = s.eng.Advance(s.modelNow(), s.events[:0])
	for _, ev := range s.events {
		c := s.calls[ev.ID]
		if c == nil {
			continue
		}
		switch ev.Kind {
		case EventFirstToken:
			c.first = true
			if c.stream {
				s.streaming++
			}
		case EventDone:
			c.done = true
			if c.stream && c.first {
				s.streaming--
			}
		}
		c.usage = ev.Usage
		notify(c.notify)
	}
	clear(s.events)
	if s.streaming > 0 {
		for _, c := range s.calls {
			if c.stream && c.first && !c.done {
				notify(c.notify)
			}
		}
	}
}

func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// loop advances the engine at its event times, and every StreamInterval
// while tokens are streaming.
func (s *Server) loop(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		s.mu.Lock()
		s.syncLocked()
		next, ok := s.eng.Next()
		streaming := s.streaming > 0
		now := s.modelNow()
		s.mu.Unlock()
		wait := time.Hour
		if ok {
			wait = max(0, s.realDuration(next.Sub(now)))
		}
		if streaming {
			wait = min(wait, s.cfg.StreamInterval)
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		case <-t.C:
		}
	}
}

// release removes a call; a call that did not finish is cancelled in the
// engine, which frees its place in the batch.
func (s *Server) release(id uint64, c *call) {
	s.mu.Lock()
	delete(s.calls, id)
	if !c.done {
		if c.stream && c.first {
			s.streaming--
		}
		s.eng.Cancel(s.modelNow(), id)
	}
	s.mu.Unlock()
	if !c.done {
		s.log.Debug().Uint64("request", id).Msg("request cancelled")
	}
	s.poke()
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", s.handle(s.chatCompletions))
	mux.HandleFunc("POST /v1/completions", s.handle(s.completions))
	mux.HandleFunc("POST /v1/embeddings", s.handle(s.embeddings))
	mux.HandleFunc("GET /v1/models", s.handle(s.models))
	mux.HandleFunc("POST /v1/responses", s.handle(s.responses))
	mux.HandleFunc("GET /v1/responses/{id}", s.handle(s.storedResponseHandler))
	mux.HandleFunc("DELETE /v1/responses/{id}", s.handle(s.storedResponseHandler))
	mux.HandleFunc("GET /admin/slowdown", s.handle(s.adminSlowdown))
	mux.HandleFunc("POST /admin/slowdown", s.handle(s.adminSlowdown))
	reg := prometheus.NewRegistry()
	reg.MustRegister(&collector{s: s})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/", s.handle(func(w http.ResponseWriter, r *http.Request) error {
		return &APIError{Status: http.StatusNotFound, Type: "invalid_request_error", Message: fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path)}
	}))
	return mux
}

// errStarted marks an error after the response began: nothing more to write.
type errStarted struct{ err error }

func (e errStarted) Error() string { return e.err.Error() }

// handle adapts a handler that returns errors; writeError answers them.
func (s *Server) handle(h func(http.ResponseWriter, *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		err := h(w, r)
		if err == nil {
			return
		}
		var started errStarted
		if errors.As(err, &started) {
			s.log.Debug().Err(started.err).Str("path", r.URL.Path).Msg("response aborted")
			return
		}
		if r.Context().Err() != nil {
			return // the client is gone
		}
		writeError(w, err)
	}
}

func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		return nil, fmt.Errorf("read body: %w", err)
	}
	return body, nil
}

// resolveModel returns the model name to answer with.
func (s *Server) resolveModel(name string) (string, error) {
	if name == "" {
		return s.cfg.Models[0], nil
	}
	for _, m := range s.cfg.Models {
		if m == name {
			return name, nil
		}
	}
	return "", &APIError{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "model_not_found", Param: "model",
		Message: fmt.Sprintf("The model `%s` does not exist.", name)}
}

func (s *Server) chatCompletions(w http.ResponseWriter, r *http.Request) error {
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	g, err := parseChat(body)
	if err != nil {
		return err
	}
	return s.generate(w, r, g)
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) error {
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	g, err := parseCompletion(body)
	if err != nil {
		return err
	}
	return s.generate(w, r, g)
}

// generate runs g through the engine and writes the response.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, g *genRequest) error {
	model, err := s.resolveModel(g.model)
	if err != nil {
		return err
	}
	maxTokens, finish := g.maxTokens, "length"
	if maxTokens == 0 {
		maxTokens, finish = s.cfg.DefaultMaxTokens, "stop"
	}
	id := s.ids.Add(1)
	req := &Request{ID: id, Tokens: g.tokens, MaxTokens: maxTokens, Draw: g.draw}
	req.Hashes = BlockHashes(nil, req.Tokens, s.cfg.Engine.BlockSize)
	pieces := answerPieces(answerWords(s.cfg.Engine.Seed, s.eng.requestKey(req, req.Hashes)^req.Draw, maxTokens))
	c := &call{notify: make(chan struct{}, 1), stream: g.stream}

	s.mu.Lock()
	s.syncLocked()
	err = s.eng.Submit(s.modelNow(), req)
	if err == nil {
		s.calls[id] = c
	}
	s.mu.Unlock()
	if err != nil {
		return err
	}
	s.poke()
	defer s.release(id, c)

	var out answerWriter
	if g.kind == kindResponse {
		out = newResponsesWriter(s, w, g, model)
	} else {
		rs := &responder{w: w, kind: g.kind, model: model, created: time.Now().Unix(),
			id: fmt.Sprintf("%s-%016x", idPrefix[g.kind], mix64(id^s.cfg.Engine.Seed))}
		if g.tool != nil {
			rs.tool = g.tool
			rs.toolID = fmt.Sprintf("call_%016x", mix64(id^s.cfg.Engine.Seed^0x7001))
			rs.argParts = splitArgs(g.tool.args, len(pieces))
			finish = "tool_calls"
		}
		out = rs
	}
	sent := 0
	for {
		select {
		case <-r.Context().Done():
			return r.Context().Err()
		case <-s.closing:
			if out.hasStarted() {
				return errStarted{errClosing}
			}
			return errClosing
		case <-c.notify:
		}
		s.mu.Lock()
		first, done, usage := c.first, c.done, c.usage
		ready := 0
		if done {
			ready = usage.CompletionTokens
		} else if first {
			ready, _ = s.eng.Generated(id)
		}
		s.mu.Unlock()
		if !g.stream {
			if !done {
				continue
			}
			s.logDone(id, usage)
			return out.whole(strings.Join(pieces, ""), finish, usage)
		}
		if !first {
			continue
		}
		next := newPieces(pieces, sent, ready)
		if err := out.chunks(next); err != nil {
			return errStarted{err}
		}
		sent += len(next)
		if done {
			s.logDone(id, usage)
			if err := out.end(finish, usage); err != nil {
				return errStarted{err}
			}
			return nil
		}
	}
}

// newPieces returns the pieces after the sent ones up to ready. The engine's
// count can read lower than what was sent (a request that finished between
// the notification and the read counts 0 until done is seen) and is capped
// by the answer's length.
func newPieces(pieces []string, sent, ready int) []string {
	ready = min(ready, len(pieces))
	if ready <= sent {
		return nil
	}
	return pieces[sent:ready]
}

func (s *Server) logDone(id uint64, u Usage) {
	s.log.Debug().Uint64("request", id).Int("prompt_tokens", u.PromptTokens).
		Int("cached_tokens", u.CachedTokens).Int("completion_tokens", u.CompletionTokens).Msg("request done")
}

var idPrefix = map[kind]string{kindChat: "chatcmpl", kindText: "cmpl"}

func (s *Server) models(w http.ResponseWriter, r *http.Request) error {
	type model struct {
		ID          string `json:"id"`
		Object      string `json:"object"`
		Created     int64  `json:"created"`
		OwnedBy     string `json:"owned_by"`
		MaxModelLen int    `json:"max_model_len"`
	}
	list := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list"}
	for _, m := range s.cfg.Models {
		list.Data = append(list.Data, model{ID: m, Object: "model", Created: s.realEpoch.Unix(), OwnedBy: "computeflux", MaxModelLen: s.cfg.Engine.MaxModelLen})
	}
	writeJSON(w, http.StatusOK, &list)
	return nil
}

// embeddings answers with deterministic unit vectors: the normalised sum of
// one pseudo-random vector per token, so texts sharing words are close.
func (s *Server) embeddings(w http.ResponseWriter, r *http.Request) error {
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	er, inputs, err := parseEmbedding(body)
	if err != nil {
		return err
	}
	model, err := s.resolveModel(er.Model)
	if err != nil {
		return err
	}
	dims := er.Dimensions
	if dims == 0 {
		dims = DefaultEmbeddingDims
	}
	type item struct {
		Object    string    `json:"object"`
		Index     int       `json:"index"`
		Embedding []float32 `json:"embedding"`
	}
	resp := struct {
		Object string         `json:"object"`
		Data   []item         `json:"data"`
		Model  string         `json:"model"`
		Usage  map[string]int `json:"usage"`
	}{Object: "list", Model: model}
	total := 0
	for i, text := range inputs {
		toks := Tokenize(nil, text)
		total += len(toks)
		resp.Data = append(resp.Data, item{Object: "embedding", Index: i, Embedding: embed(toks, dims)})
	}
	resp.Usage = map[string]int{"prompt_tokens": total, "total_tokens": total}
	writeJSON(w, http.StatusOK, &resp)
	return nil
}

func embed(toks []Token, dims int) []float32 {
	v := make([]float64, dims)
	for _, t := range toks {
		x := uint64(t)
		for i := range v {
			x = mix64(x + 0x9e3779b97f4a7c15)
			v[i] += float64(int64(x)) / math.MaxInt64
		}
	}
	norm := 0.0
	for _, f := range v {
		norm += f * f
	}
	norm = math.Sqrt(norm)
	out := make([]float32, dims)
	for i, f := range v {
		if norm > 0 {
			out[i] = float32(f / norm)
		}
	}
	return out
}

// adminSlowdown reads (GET) or sets (POST, ?factor=X or {"factor": X}) the
// slowdown factor. Only loopback clients may use it unless AdminRemote.
func (s *Server) adminSlowdown(w http.ResponseWriter, r *http.Request) error {
	if !s.cfg.AdminRemote && !isLoopback(r.RemoteAddr) {
		return &APIError{Status: http.StatusForbidden, Type: "permission_error", Message: "admin endpoints answer loopback clients only"}
	}
	if r.Method == http.MethodPost {
		var req struct {
			Factor float64 `json:"factor"`
		}
		if q := r.URL.Query().Get("factor"); q != "" {
			f, err := strconv.ParseFloat(q, 64)
			if err != nil {
				return badRequest("factor", "factor %q is not a number", q)
			}
			req.Factor = f
		} else {
			body, err := s.readBody(w, r)
			if err != nil {
				return err
			}
			if err := decode(body, &req); err != nil {
				return err
			}
		}
		if err := s.SetSlowdown(req.Factor); err != nil {
			return badRequest("factor", "%v", err)
		}
	}
	s.mu.Lock()
	f := s.eng.Slowdown()
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]float64{"factor": f})
	return nil
}

func isLoopback(remote string) bool {
	host, _, err := net.SplitHostPort(remote)
	if err != nil {
		host = remote
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// usageJSON is OpenAI's usage object.
type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func toUsageJSON(u Usage) *usageJSON {
	j := &usageJSON{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens, TotalTokens: u.PromptTokens + u.CompletionTokens}
	j.PromptTokensDetails.CachedTokens = u.CachedTokens
	return j
}

type delta struct {
	Role      string         `json:"role,omitempty"`
	Content   *string        `json:"content,omitempty"`
	ToolCalls []toolCallJSON `json:"tool_calls,omitempty"`
}

// toolCallJSON is a function call of an answer; in a stream's delta it
// has its index, and its id and name only in the call's first delta.
type toolCallJSON struct {
	Index    *int         `json:"index,omitempty"`
	ID       string       `json:"id,omitempty"`
	Type     string       `json:"type,omitempty"`
	Function functionJSON `json:"function"`
}

type functionJSON struct {
	Name      string `json:"name,omitempty"`
	Arguments string `json:"arguments"`
}

type choice struct {
	Index        int       `json:"index"`
	Message      *message  `json:"message,omitempty"` // chat, whole response
	Delta        *delta    `json:"delta,omitempty"`   // chat, stream
	Text         *string   `json:"text,omitempty"`    // completions
	Logprobs     *struct{} `json:"logprobs"`          // always null
	FinishReason *string   `json:"finish_reason"`
}

type message struct {
	Role      string         `json:"role"`
	Content   *string        `json:"content"` // null for a tool call
	ToolCalls []toolCallJSON `json:"tool_calls,omitempty"`
}

type completion struct {
	ID      string     `json:"id"`
	Object  string     `json:"object"`
	Created int64      `json:"created"`
	Model   string     `json:"model"`
	Choices []choice   `json:"choices"`
	Usage   *usageJSON `json:"usage,omitempty"`
}

// answerWriter writes one request's answer in its API's shapes.
type answerWriter interface {
	whole(text, finish string, u Usage) error
	chunks(pieces []string) error
	end(finish string, u Usage) error
	hasStarted() bool
}

// responder writes one request's response in OpenAI's shapes.
type responder struct {
	w       http.ResponseWriter
	kind    kind
	model   string
	id      string
	created int64
	started bool // stream headers sent
	buf     []byte
	// A chat answer that calls a tool: the call, its id, and its
	// arguments in one part per answer piece (a stream sends a part where
	// a text answer sends a piece); next is the next part to send.
	tool     *toolCall
	toolID   string
	argParts []string
	next     int
}

// splitArgs cuts a call's arguments into n parts (at least one), in order.
func splitArgs(args string, n int) []string {
	n = max(1, min(n, len(args)))
	parts := make([]string, 0, n)
	for i := range n {
		parts = append(parts, args[i*len(args)/n:(i+1)*len(args)/n])
	}
	return parts
}

func (o *responder) hasStarted() bool { return o.started }

func (o *responder) object(stream bool) string {
	switch {
	case o.kind == kindText:
		return "text_completion"
	case stream:
		return "chat.completion.chunk"
	}
	return "chat.completion"
}

func (o *responder) whole(text, finish string, u Usage) error {
	ch := choice{FinishReason: &finish}
	switch {
	case o.tool != nil:
		ch.Message = &message{Role: "assistant", ToolCalls: []toolCallJSON{{ID: o.toolID, Type: "function",
			Function: functionJSON{Name: o.tool.name, Arguments: o.tool.args}}}}
	case o.kind == kindChat:
		ch.Message = &message{Role: "assistant", Content: &text}
	default:
		ch.Text = &text
	}
	writeJSON(o.w, http.StatusOK, &completion{ID: o.id, Object: o.object(false), Created: o.created, Model: o.model,
		Choices: []choice{ch}, Usage: toUsageJSON(u)})
	return nil
}

// chunks sends one chunk per token; the first call also sends the headers
// and, for chat, the assistant role.
func (o *responder) chunks(pieces []string) error {
	if !o.started {
		startStream(o.w)
		o.started = true
		if o.kind == kindChat {
			empty := ""
			o.event(&completion{Choices: []choice{{Delta: &delta{Role: "assistant", Content: &empty}}}})
		}
	}
	for _, p := range pieces {
		ch := choice{}
		switch {
		case o.tool != nil:
			if o.next >= len(o.argParts) {
				continue
			}
			call := toolCallJSON{Index: new(int), Function: functionJSON{Arguments: o.argParts[o.next]}}
			if o.next == 0 {
				call.ID, call.Type, call.Function.Name = o.toolID, "function", o.tool.name
			}
			o.next++
			ch.Delta = &delta{ToolCalls: []toolCallJSON{call}}
		case o.kind == kindChat:
			ch.Delta = &delta{Content: &p}
		default:
			ch.Text = &p
		}
		o.event(&completion{Choices: []choice{ch}})
	}
	return o.flush()
}

// end sends the finish chunk, the usage chunk and [DONE].
func (o *responder) end(finish string, u Usage) error {
	if o.tool != nil && o.next < len(o.argParts) {
		// Fewer pieces came than parts: the rest of the arguments.
		rest := strings.Join(o.argParts[o.next:], "")
		call := toolCallJSON{Index: new(int), Function: functionJSON{Arguments: rest}}
		if o.next == 0 {
			call.ID, call.Type, call.Function.Name = o.toolID, "function", o.tool.name
		}
		o.next = len(o.argParts)
		o.event(&completion{Choices: []choice{{Delta: &delta{ToolCalls: []toolCallJSON{call}}}}})
	}
	ch := choice{FinishReason: &finish}
	if o.kind == kindChat {
		ch.Delta = &delta{}
	} else {
		empty := ""
		ch.Text = &empty
	}
	o.event(&completion{Choices: []choice{ch}})
	o.event(&completion{Choices: []choice{}, Usage: toUsageJSON(u)})
	o.buf = append(o.buf, "data: [DONE]\n\n"...)
	return o.flush()
}

func (o *responder) event(c *completion) {
	c.ID, c.Object, c.Created, c.Model = o.id, o.object(true), o.created, o.model
	b, _ := json.Marshal(c) // plain structs: cannot fail
	o.buf = append(o.buf, "data: "...)
	o.buf = append(o.buf, b...)
	o.buf = append(o.buf, "\n\n"...)
}

func (o *responder) flush() error { return flushStream(o.w, &o.buf) }

// startStream sends the headers of a stream of server-sent events.
func startStream(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
}

// flushStream writes the buffered server-sent events to w, empties the
// buffer and flushes w so the client sees them now.
func flushStream(w http.ResponseWriter, buf *[]byte) error {
	if len(*buf) == 0 {
		return nil
	}
	_, err := w.Write(*buf)
	*buf = (*buf)[:0]
	if err != nil {
		return fmt.Errorf("write stream: %w", err)
	}
	if err := http.NewResponseController(w).Flush(); err != nil {
		return fmt.Errorf("flush stream: %w", err)
	}
	return nil
}
