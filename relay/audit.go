package relay

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
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/scheduler/audit"
	"github.com/computeflux/computeflux/transport"
)

// Audits: the relay checks what each agent really runs.
//
// At a pace of a share of the tokens the fleet serves (AuditConfig.Share,
// 2% by default) and at least every FloorEvery per agent and model, the
// auditor picks an agent and a model (scheduler/audit's Book.Next), writes
// a prompt shaped like the model's recent client requests (never one of
// them), and sends it, greedy, at the same moment to that agent and to its
// references: the operator's references for the model, or up to
// References other agents serving it. The requests take the path client
// requests take to an agent (the same round tripper, headers and body
// shape). The answers are compared (audit.Judge); the verdicts move each
// participant's score, which becomes its routing weight for the model,
// and quarantine (Scheduler.SetModelWeight). An audit that times out or
// finds an engine overloaded or restarting is no evidence.

// AuditConfig configures the audits. The zero value audits at the
// defaults: it works with no configuration.
type AuditConfig struct {
	// Disabled turns audits off.
	Disabled bool
	// Share is the audits' budget as a share of the tokens served to
	// clients. If zero, audit.DefaultFraction (2%); negative means no
	// budget: only the floor, new agents and quarantine re-audits.
	Share float64
	// FloorEvery: every agent and model is audited at least this often,
	// budget or not. If zero, audit.DefaultFloorEvery.
	FloorEvery time.Duration
	// References is the number of other agents asked alongside the agent
	// under audit when no operator reference serves the model. If zero,
	// DefaultAuditReferences.
	References int
	// MinConsensus is audit.Rules.MinConsensus. If zero, its default (3).
	MinConsensus int
	// MaxTokens caps the tokens an audit asks for. If zero,
	// DefaultAuditMaxTokens.
	MaxTokens int
	// Timeout bounds one audit round. If zero, DefaultAuditTimeout.
	Timeout time.Duration
	// Interval is how often the auditor looks for an audit due. If zero,
	// DefaultAuditInterval.
	Interval time.Duration
	// Policy turns evidence into weight and quarantine; zero fields take
	// audit's defaults (FloorEvery above wins over Policy.FloorEvery).
	Policy audit.Policy
}

// Defaults for the zero values of AuditConfig.
const (
	DefaultAuditReferences = 3
	DefaultAuditMaxTokens  = 32
	DefaultAuditTimeout    = time.Minute
	DefaultAuditInterval   = time.Second
)

func (c AuditConfig) populate() AuditConfig {
	if c.References <= 0 {
		c.References = DefaultAuditReferences
	}
	if c.MaxTokens <= 0 {
		c.MaxTokens = DefaultAuditMaxTokens
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultAuditTimeout
	}
	if c.Interval <= 0 {
		c.Interval = DefaultAuditInterval
	}
	if c.FloorEvery > 0 {
		c.Policy.FloorEvery = c.FloorEvery
	}
	return c
}

// auditor runs the audits (see above).
type auditor struct {
	r   *Relay
	cfg AuditConfig
	log zerolog.Logger
	m   *auditMetrics

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex // guards the following
	book    *audit.Book
	budget  *audit.Budget
	traffic map[string]*modelTraffic // by model
	refs    map[string]bool          // the operator's references, by endpoint name
	recent  []AuditRecord            // the latest audits, oldest first
	seq     uint64
	rng     *rand.Rand
	loads   map[string]*audit.LoadCheck // by agent
}

// maxRecentAudits bounds the audits the admin API shows.
const maxRecentAudits = 64

// AuditRecord is one audit as the admin API and logs show it.
type AuditRecord struct {
	ID      string    `json:"id"`
	At      time.Time `json:"at"`
	Model   string    `json:"model"`
	Subject string    `json:"subject"`
	// Why is the reason it was due: new, floor, recheck, suspected, budget.
	Why string `json:"why"`
	// Verdicts are by participant: agree, disagree or inconclusive, and
	// "error: ..." for a participant whose answer could not be had.
	Verdicts map[string]string `json:"verdicts"`
	// Against and Reason explain the subject's verdict.
	Against string `json:"against,omitempty"`
	Reason  string `json:"reason,omitempty"`
	// Tokens is what the round cost.
	Tokens int `json:"tokens"`
}

func newAuditor(r *Relay) *auditor {
	cfg := r.cfg.Audit.populate()
	a := &auditor{
		r:       r,
		cfg:     cfg,
		log:     r.log.With().Str("component", "audit").Logger(),
		book:    audit.NewBook(cfg.Policy),
		budget:  audit.NewBudget(cfg.Share, 0),
		traffic: make(map[string]*modelTraffic),
		refs:    make(map[string]bool),
		rng:     rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
		loads:   make(map[string]*audit.LoadCheck),
		done:    make(chan struct{}),
	}
	a.m = newAuditMetrics(a)
	a.ctx, a.cancel = context.WithCancel(context.Background())
	return a
}

// start runs the audit loop until stop.
func (a *auditor) start() {
	go func() {
		defer close(a.done)
		t := time.NewTicker(a.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-a.ctx.Done():
				return
			case <-t.C:
				a.tick()
			}
		}
	}()
}

// stop ends the loop and waits for it (an audit in flight is cancelled).
// Safe to call more than once, and on an auditor never started.
func (a *auditor) stop(started bool) {
	a.cancel()
	if started {
		<-a.done
	}
}

// setReferences replaces the operator's references (the endpoints file).
func (a *auditor) setReferences(names []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.refs = make(map[string]bool, len(names))
	for _, n := range names {
		a.refs[n] = true
	}
}

// pairs returns the agent-model pairs that may be audited now (joined, not
// dead or draining, not an operator's reference) and the references that
// serve each model: agents and providers the operator marked.
func (a *auditor) pairs() (live []audit.Key, refs map[string][]string) {
	a.mu.Lock()
	isRef := a.refs
	a.mu.Unlock()
	refs = make(map[string][]string)
	for _, ag := range a.r.reg.Agents() {
		if ag.Dead || ag.Draining || ag.Health.Draining {
			continue
		}
		for _, m := range ag.Models {
			if isRef[ag.Name] {
				refs[m] = append(refs[m], ag.Name)
				continue
			}
			live = append(live, audit.Key{Agent: ag.Name, Model: m})
		}
	}
	for name := range isRef {
		if p := a.r.providers.get(name); p != nil {
			for _, m := range p.models {
				refs[m] = append(refs[m], name)
			}
		}
	}
	return live, refs
}

// roundCost estimates the tokens of a round of n requests for model.
func (a *auditor) roundCost(model string, n int) int {
	prompt := 256
	if t := a.traffic[model]; t != nil && t.n > 0 {
		prompt = t.shapes[(t.n-1)%len(t.shapes)].promptBytes/4 + 16
	}
	return n * (prompt + a.cfg.MaxTokens)
}

// auditable keeps the pairs of the models worth an audit: models that
// clients use (the auditor shapes its prompts like their requests), and
// that have an operator's reference or enough agents for a consensus to
// convict one of them (MinConsensus others); a round that can convict
// nobody would only cost tokens. The caller holds mu.
func (a *auditor) auditable(live []audit.Key, refs map[string][]string) []audit.Key {
	perModel := map[string]int{}
	for _, k := range live {
		perModel[k.Model]++
	}
	quorum := a.cfg.MinConsensus
	if quorum <= 0 {
		quorum = audit.DefaultMinConsensus
	}
	out := live[:0]
	for _, k := range live {
		t := a.traffic[k.Model]
		if t == nil || t.n == 0 || (len(refs[k.Model]) == 0 && perModel[k.Model] <= quorum) {
			continue
		}
		out = append(out, k)
	}
	return out
}

// tick samples the agents' published load and runs at most one audit
// round.
func (a *auditor) tick() {
	now := a.r.cfg.Clock.Now()
	a.sampleLoads(now)
	live, refs := a.pairs()
	a.mu.Lock()
	if live = a.auditable(live, refs); len(live) == 0 {
		a.mu.Unlock()
		return
	}
	// Whether the budget affords a typical round: the subject and its
	// references.
	affordable := a.budget.Afford(a.roundCost(live[0].Model, 1+a.cfg.References))
	k, why, ok := a.book.Next(now, live, affordable)
	if !ok {
		a.mu.Unlock()
		return
	}
	trusted := refs[k.Model]
	var others []audit.Key
	if len(trusted) == 0 {
		others = a.book.References(now, k, live, a.cfg.References, a.rng)
	}
	a.seq++
	id := fmt.Sprintf("aud-%d-%d", now.Unix(), a.seq)
	body, hdr := a.prompt(k.Model)
	a.mu.Unlock()

	parts := []roundPart{{name: k.Agent}}
	for _, o := range others {
		parts = append(parts, roundPart{name: o.Agent})
	}
	for _, t := range trusted {
		parts = append(parts, roundPart{name: t, trusted: true})
	}
	a.round(id, k, why, parts, body, hdr)
}

// roundPart is one participant of a round and what it answered.
type roundPart struct {
	name    string
	trusted bool
	c       audit.Completion
	err     error
	tokens  int
}

// round sends one audit to every participant at once, judges the answers
// and records the verdicts.
func (a *auditor) round(id string, k audit.Key, why audit.Why, parts []roundPart, body []byte, hdr http.Header) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.Timeout)
	defer cancel()
	var wg sync.WaitGroup
	for i := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := &parts[i]
			p.c, p.tokens, p.err = a.ask(ctx, p.name, body, hdr)
		}()
	}
	wg.Wait()
	if a.ctx.Err() != nil {
		return // the relay is stopping: no evidence
	}

	now := a.r.cfg.Clock.Now()
	rec := AuditRecord{ID: id, At: now, Model: k.Model, Subject: k.Agent, Why: why.String(), Verdicts: map[string]string{}}
	var judged []audit.Participant
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, p := range parts {
		rec.Tokens += p.tokens
		if p.err != nil {
			rec.Verdicts[p.name] = "error: " + p.err.Error()
			continue
		}
		judged = append(judged, audit.Participant{Agent: p.name, Trusted: p.trusted,
			Suspect: a.book.Quarantined(audit.Key{Agent: p.name, Model: k.Model}), Answer: p.c.Answer})
	}
	a.budget.Spend(rec.Tokens)
	a.m.tokens.Add(float64(rec.Tokens))
	verdicts := audit.Judge(judged, audit.Rules{MinConsensus: a.cfg.MinConsensus})
	if parts[0].err != nil {
		// The subject did not answer: a timeout, an overloaded or
		// restarting engine. No evidence, but the audit happened.
		verdicts = append(verdicts, audit.Verdict{Agent: k.Agent, Outcome: audit.Inconclusive, Reason: "no answer: " + parts[0].err.Error()})
	}
	for _, v := range verdicts {
		pk := audit.Key{Agent: v.Agent, Model: k.Model}
		change := a.book.Record(now, id, pk, v)
		rec.Verdicts[v.Agent] = v.Outcome.String()
		if v.Agent == k.Agent {
			rec.Against, rec.Reason = v.Against, v.Reason
			if v.Evidence.Reason != "" {
				rec.Reason += ": " + v.Evidence.Reason
			}
		}
		a.m.verdicts.WithLabelValues(v.Outcome.String()).Inc()
		a.apply(pk, change, id)
	}
	a.recent = append(a.recent, rec)
	if len(a.recent) > maxRecentAudits {
		a.recent = slices.Delete(a.recent, 0, len(a.recent)-maxRecentAudits)
	}
	ev := a.log.Info()
	if rec.Verdicts[k.Agent] == audit.Disagree.String() {
		ev = a.log.Warn()
	}
	ev.Str("audit", id).Str("model", k.Model).Str("agent", k.Agent).Str("why", rec.Why).
		Str("verdicts", verdictString(rec.Verdicts)).Str("against", rec.Against).Str("reason", rec.Reason).
		Int("tokens", rec.Tokens).Msg("audit")
}

// apply puts a pair's standing into routing, and logs a change. The
// caller holds mu.
func (a *auditor) apply(k audit.Key, change audit.Change, id string) {
	st, _ := a.book.Standing(k)
	a.r.sched.SetModelWeight(k.Agent, k.Model, st.Weight)
	switch change {
	case audit.Quarantined:
		a.m.quarantines.Inc()
		q := st.Quarantine
		a.log.Warn().Str("agent", k.Agent).Str("model", k.Model).Str("audit", q.Convicted.Audit).
			Str("against", q.Convicted.Against).Str("reason", q.Convicted.Reason).
			Time("next_audit", q.NextAudit).Msg("agent quarantined for model")
	case audit.Released:
		a.log.Info().Str("agent", k.Agent).Str("model", k.Model).Str("audit", id).Msg("agent released from quarantine")
	}
}

func verdictString(m map[string]string) string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	slices.Sort(names)
	var b strings.Builder
	for i, n := range names {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(n + "=" + m[n])
	}
	return b.String()
}

// Errors of an audit request that count as no evidence.
var (
	errAuditOverloaded = errors.New("engine overloaded")
	errAuditStatus     = errors.New("engine answered an error")
)

// maxAuditAnswer bounds an audit answer read.
const maxAuditAnswer = 4 << 20

// ask sends the audit to one endpoint the way client requests go to it,
// and reads the answer: streamed or not, as the request asked.
func (a *auditor) ask(ctx context.Context, name string, body []byte, hdr http.Header) (audit.Completion, int, error) {
	c := scheduler.Choice{EndpointID: name}
	if p := a.r.providers.get(name); p != nil && len(p.keyIDs) > 0 {
		c.Key = p.keyIDs[0]
	}
	tgt, ok := a.r.target(c, "/v1/chat/completions")
	if !ok {
		return audit.Completion{}, 0, ErrAgentGone
	}
	up, err := http.NewRequestWithContext(ctx, http.MethodPost, "", bytes.NewReader(body))
	if err != nil {
		return audit.Completion{}, 0, err
	}
	*up.URL = tgt.u
	up.Host = tgt.u.Host
	up.ContentLength = int64(len(body))
	copyRequestHeaders(up.Header, hdr)
	tgt.authorize(up.Header)
	resp, err := tgt.rt.RoundTrip(up)
	if err != nil {
		return audit.Completion{}, 0, err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable:
		return audit.Completion{}, 0, fmt.Errorf("%w (%d)", errAuditOverloaded, resp.StatusCode)
	case resp.StatusCode != http.StatusOK:
		return audit.Completion{}, 0, fmt.Errorf("%w (%d)", errAuditStatus, resp.StatusCode)
	}
	var comp audit.Completion
	events := 0 // stream events: about one per token
	lr := io.LimitReader(resp.Body, maxAuditAnswer)
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		sc := bufio.NewScanner(lr)
		sc.Buffer(make([]byte, 64<<10), maxAuditAnswer)
		done := false
		for sc.Scan() {
			data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
			if !ok {
				continue
			}
			data = bytes.TrimSpace(data)
			if string(data) == "[DONE]" {
				done = true
				continue
			}
			events++
			if err := comp.StreamChunk(data); err != nil {
				return audit.Completion{}, 0, err
			}
		}
		if err := sc.Err(); err != nil {
			return audit.Completion{}, 0, err
		}
		if !done {
			// A stream cut short (an engine restart, a dropped stream):
			// what came is no answer to compare.
			return audit.Completion{}, 0, io.ErrUnexpectedEOF
		}
	} else {
		b, err := io.ReadAll(lr)
		if err != nil {
			return audit.Completion{}, 0, err
		}
		if comp, err = audit.ParseCompletion(b); err != nil {
			return audit.Completion{}, 0, err
		}
	}
	tokens := estimateTokens(len(body), len(comp.Answer.Text), events)
	if u := comp.Usage; u != nil {
		tokens = u.Prompt + u.Completion
	}
	return comp, tokens, nil
}

// estimateTokens stands in for an answer's usage when it has none (a
// stream whose client did not ask for it): a token per 4 bytes of the
// request, and a token per stream event (engines send about one token per
// event) or per 4 bytes of a whole answer's text. Client answers and audit
// answers are counted alike.
func estimateTokens(requestBytes, textBytes, events int) int {
	if events > 0 {
		return requestBytes/4 + events
	}
	return requestBytes/4 + textBytes/4
}

// Traffic shapes: what the auditor knows of a model's client requests, to
// shape its prompts like them. It keeps the shape (sizes, fields, headers),
// never a prompt's text.

// modelTraffic is a model's recent request shapes and clients.
type modelTraffic struct {
	shapes  [16]shape
	n       int                  // shapes seen; the ring holds the last len(shapes)
	clients map[string]time.Time // client names that used the model recently
	sampled time.Time            // when a request was last decoded for its shape
	tapped  time.Time            // when an answer was last kept for the answer checks
}

// maxShapeKeys bounds the top-level fields remembered of a request.
const maxShapeKeys = 32

// shape is one client request's form.
type shape struct {
	keys        []string // top-level JSON fields, in order
	messages    int      // chat messages, system included
	system      bool     // the first message is a system message
	promptBytes int
	maxTokens   int // 0: not set
	stream      bool
	usage       bool // stream_options.include_usage
	header      http.Header
}

// maxClientsPerModel bounds the client names remembered per model.
const maxClientsPerModel = 64

// shapeEvery is how often a model's request is decoded for its shape (and
// its prompt's size): decoding every request would cost the relay's hot
// path a JSON parse of the prompt.
const shapeEvery = 200 * time.Millisecond

// answerEvery is how often a model's answer is kept and parsed for the
// answer checks (CheckAnswer): at most 50 a second per model, which checks
// every answer of light traffic and a steady sample of heavy traffic
// (parsing every answer cost about a sixth of the relay's CPU on small
// answers). An agent is sampled in proportion to what it serves.
const answerEvery = 20 * time.Millisecond

// tapDue reports whether the answer to a request of model that starts now
// should be kept for the answer checks.
func (a *auditor) tapDue(model string) bool {
	now := a.r.cfg.Clock.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	t := a.traffic[model]
	if t == nil {
		return true // the model's first request: answered records it
	}
	if now.Sub(t.tapped) < answerEvery {
		return false
	}
	t.tapped = now
	return true
}

// served counts the tokens an agent served a client, which the audit
// budget is a share of.
func (a *auditor) served(tokens int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.budget.Served(int(tokens))
	a.m.served.Add(float64(max(tokens, 0)))
}

// answered takes one client request for model, sent by client (the API
// key's name; empty without keys), and its answer as tap saw it: the
// request's shape is kept now and then, the answer's tokens feed the
// budget, and the cheap checks look at it. The request path calls it once,
// when an attempt's answer reached the client; agent is the endpoint that
// served it.
func (a *auditor) answered(model, client string, body []byte, h http.Header, stream bool, tap *answerTap, agent string) {
	now := a.r.cfg.Clock.Now()
	a.mu.Lock()
	t := a.traffic[model]
	sample := t == nil || now.Sub(t.sampled) >= shapeEvery
	if sample && t != nil {
		t.sampled = now
	}
	a.mu.Unlock()
	o := audit.Observed{Model: model, RequestBytes: len(body)}
	if sample {
		if sh, ok := shapeOf(body); ok {
			o.PromptText, o.Messages = sh.promptBytes, sh.messages
			// The headers an engine gets, kept as the client sent them
			// (canonical keys, as ask passes them through
			// copyRequestHeaders); never the session.
			sh.header = make(http.Header, len(forwardedHeaders))
			for _, fh := range forwardedHeaders {
				if v := h[fh.canon]; len(v) > 0 && fh.canon != headerSessionCanon {
					sh.header[fh.canon] = slices.Clone(v)
				}
			}
			a.addShape(now, model, client, sh)
		}
	}
	if agent == "" || a.r.providers.get(agent) != nil {
		return
	}
	if _, ok := tap.observed(&o, stream); ok {
		a.observeAnswer(agent, o)
	}
}

// addShape keeps a request's shape for model.
func (a *auditor) addShape(now time.Time, model, client string, sh shape) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t := a.traffic[model]
	if t == nil {
		if len(a.traffic) >= maxShapeModels {
			return
		}
		t = &modelTraffic{clients: make(map[string]time.Time), sampled: now}
		a.traffic[model] = t
	}
	t.shapes[t.n%len(t.shapes)] = sh
	t.n++
	if client != "" {
		if _, ok := t.clients[client]; !ok && len(t.clients) >= maxClientsPerModel {
			var oldest string
			for c, at := range t.clients {
				if oldest == "" || at.Before(t.clients[oldest]) {
					oldest = c
				}
			}
			delete(t.clients, oldest)
		}
		t.clients[client] = now
	}
}

// maxShapeModels bounds the models whose traffic is remembered.
const maxShapeModels = 1024

// shapeOf reads a chat request's form.
func shapeOf(body []byte) (shape, bool) {
	var sh shape
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return sh, false
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return sh, false
		}
		k, _ := t.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return sh, false
		}
		if len(sh.keys) < maxShapeKeys {
			sh.keys = append(sh.keys, k)
		}
		switch k {
		case "messages":
			var msgs []struct {
				Role    string          `json:"role"`
				Content json.RawMessage `json:"content"`
			}
			if json.Unmarshal(raw, &msgs) != nil {
				return sh, false
			}
			sh.messages = len(msgs)
			sh.system = len(msgs) > 0 && (msgs[0].Role == "system" || msgs[0].Role == "developer")
			for _, m := range msgs {
				sh.promptBytes += len(m.Content)
			}
		case "max_tokens", "max_completion_tokens":
			_ = json.Unmarshal(raw, &sh.maxTokens)
		case "stream":
			_ = json.Unmarshal(raw, &sh.stream)
		case "stream_options":
			var so struct {
				IncludeUsage bool `json:"include_usage"`
			}
			_ = json.Unmarshal(raw, &so)
			sh.usage = so.IncludeUsage
		}
	}
	return sh, sh.messages > 0
}

// Audit prompts are made of these words: plain text a user could send,
// shaped (length, messages) like the model's traffic.
var auditWords = strings.Fields(`the a of to and in is that for it as with on was be by this are from at or
an have not but which one all can their has had more when will there would other about time people into
some what out so up its who could them these than then now only first also new any two may like how
over such our even most after make many before must through back where much your way well should
because each just those how too here little world still between own see men work long get last day
might great old never year off come since against go came right used take three small large every
found house write read water story light river city garden morning letter music market school village
bridge window table history number question answer reason paper travel winter summer friend family
explain describe summarize compare list improve translate plan consider review suggest outline note`)

// prompt builds an audit request for model from a recent request shape:
// the same fields in the same order, the same number of messages and
// about the same length, greedy decoding, at most MaxTokens. It returns
// the body and the headers to send. The caller holds mu.
func (a *auditor) prompt(model string) ([]byte, http.Header) {
	sh := shape{keys: []string{"model", "messages", "max_tokens", "temperature"}, messages: 1, promptBytes: 400}
	hdr := http.Header{}
	var client string
	if t := a.traffic[model]; t != nil && t.n > 0 {
		sh = t.shapes[a.rng.IntN(min(t.n, len(t.shapes)))]
		hdr = sh.header.Clone()
		if id := hdr.Get("X-Request-Id"); id != "" {
			// A client's request ID is its own: the audit gets a fresh one
			// of the same length and alphabet.
			hdr.Set("X-Request-Id", a.lookalike(id))
		}
		var names []string
		for c := range t.clients {
			names = append(names, c)
		}
		if len(names) > 0 {
			slices.Sort(names)
			client = names[a.rng.IntN(len(names))]
		}
	}
	maxTokens := a.cfg.MaxTokens
	if sh.maxTokens > 0 {
		maxTokens = min(sh.maxTokens, a.cfg.MaxTokens)
	}
	// The messages: a system message if the shape had one, then
	// alternating user and assistant turns ending with the user.
	n := min(max(sh.messages, 1), 16)
	per := max(min(sh.promptBytes, 16<<10)/n, 24)
	// Role before content, as the OpenAI SDKs write them (a map would
	// sort the keys).
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	msgs := make([]message, 0, n)
	for i := range n {
		role := "user"
		switch {
		case i == 0 && sh.system:
			role = "system"
		case (n-1-i)%2 == 1:
			role = "assistant"
		}
		msgs = append(msgs, message{Role: role, Content: a.text(per)})
	}
	var b bytes.Buffer
	b.WriteByte('{')
	seen := map[string]bool{}
	write := func(k string, v any) {
		if seen[k] {
			return
		}
		seen[k] = true
		if b.Len() > 1 {
			b.WriteByte(',')
		}
		kb, _ := json.Marshal(k)
		vb, _ := json.Marshal(v)
		b.Write(kb)
		b.WriteByte(':')
		b.Write(vb)
	}
	for _, k := range sh.keys {
		switch k {
		case "model":
			write(k, model)
		case "messages":
			write(k, msgs)
		case "max_tokens", "max_completion_tokens":
			write(k, maxTokens)
		case "temperature":
			write(k, 0)
		case "stream":
			write(k, sh.stream)
		case "stream_options":
			if sh.stream {
				write(k, map[string]bool{"include_usage": sh.usage})
			}
		}
		// Other fields (tools, user, seed, logprobs...) are a client's
		// own: left out.
	}
	write("model", model)
	write("messages", msgs)
	write("max_tokens", maxTokens)
	write("temperature", 0)
	b.WriteByte('}')
	// Every request the relay sends an agent names its client's flow
	// (queue.go): an audit names one of the model's recent clients, as
	// that client's own request would.
	if client != "" {
		fl := flowOf{id: client, weight: 1, cost: expectedTokens(b.Len(), maxTokens)}
		if c := a.r.clients.byName(client); c != nil {
			fl.weight, fl.band = c.Weight, c.Class
		}
		if hdr == nil {
			hdr = http.Header{}
		}
		hdr[transport.HeaderFlow] = []string{fl.header()}
	}
	return b.Bytes(), hdr
}

// lookalike returns a random string shaped like s: each digit replaced by
// a digit, each letter by a letter of the same case (hex stays hex when
// s is hex), anything else kept. The caller holds mu.
func (a *auditor) lookalike(s string) string {
	hex := strings.Trim(strings.ToLower(s), "0123456789abcdef-") == ""
	b := []byte(s)
	for i, c := range b {
		switch {
		case c >= '0' && c <= '9':
			b[i] = '0' + byte(a.rng.IntN(10))
		case hex && c >= 'a' && c <= 'f':
			b[i] = 'a' + byte(a.rng.IntN(6))
		case hex && c >= 'A' && c <= 'F':
			b[i] = 'A' + byte(a.rng.IntN(6))
		case c >= 'a' && c <= 'z':
			b[i] = 'a' + byte(a.rng.IntN(26))
		case c >= 'A' && c <= 'Z':
			b[i] = 'A' + byte(a.rng.IntN(26))
		}
	}
	return string(b)
}

// text returns about n bytes of sentences of auditWords. The caller holds
// mu (the generator).
func (a *auditor) text(n int) string {
	var b strings.Builder
	for b.Len() < n {
		words := 6 + a.rng.IntN(10)
		for i := range words {
			w := auditWords[a.rng.IntN(len(auditWords))]
			if i == 0 {
				w = strings.ToUpper(w[:1]) + w[1:]
			} else {
				b.WriteByte(' ')
			}
			b.WriteString(w)
		}
		b.WriteString(". ")
	}
	return strings.TrimSpace(b.String())
}

// observeAnswer runs the cheap checks on one sampled answer of agent.
func (a *auditor) observeAnswer(agent string, o audit.Observed) {
	findings := audit.CheckAnswer(o, audit.Limits{})
	now := a.r.cfg.Clock.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, f := range findings {
		a.finding(now, audit.Key{Agent: agent, Model: o.Model}, f)
	}
}

// sampleLoads compares, for every agent, the load it publishes in gossip
// (its engine's running and waiting requests, at least its own in-flight
// count, which covers every relay) with the requests this relay has in
// flight on it: a relay's own requests cannot outnumber an honest agent's
// count for long. Without gossip there is nothing published to compare.
func (a *auditor) sampleLoads(now time.Time) {
	if a.r.gossip == nil {
		return
	}
	for _, st := range a.r.sched.Snapshot() {
		if a.r.providers.get(st.ID) != nil || st.InFlight == 0 {
			continue
		}
		a.mu.Lock()
		lc := a.loads[st.ID]
		if lc == nil {
			if len(a.loads) >= maxShapeModels {
				a.mu.Unlock()
				continue
			}
			lc = &audit.LoadCheck{}
			a.loads[st.ID] = lc
		}
		if f, ok := lc.Sample(now, now, st.Health.Running+st.Health.Waiting, st.InFlight); ok {
			for _, m := range st.Models {
				a.finding(now, audit.Key{Agent: st.ID, Model: m}, f)
			}
		}
		a.mu.Unlock()
	}
}

// finding records a cheap check's finding. The caller holds mu.
func (a *auditor) finding(now time.Time, k audit.Key, f audit.Finding) {
	a.book.Violation(now, k, f.Check, f.Detail)
	a.m.findings.WithLabelValues(f.Check).Inc()
	a.log.Info().Str("agent", k.Agent).Str("model", k.Model).Str("check", f.Check).Str("detail", f.Detail).Msg("answer check")
}

// AuditStatus is the admin API's view of the audits.
type AuditStatus struct {
	// Share is the budget's share of served tokens; Served and Spent the
	// tokens served to clients and spent on audits since the start.
	Share         float64 `json:"share"`
	Served, Spent int64   `json:"-"`
	ServedTokens  int64   `json:"served_tokens"`
	AuditTokens   int64   `json:"audit_tokens"`
	// Standings are every agent and model's score and evidence.
	Standings []audit.Standing `json:"standings"`
	// Recent are the latest audits, oldest first.
	Recent []AuditRecord `json:"recent"`
}

// status returns the auditor's state for the admin API.
func (a *auditor) status() AuditStatus {
	a.mu.Lock()
	defer a.mu.Unlock()
	served, spent := a.budget.Totals()
	return AuditStatus{Share: a.budget.Fraction(), ServedTokens: served, AuditTokens: spent,
		Standings: a.book.Standings(), Recent: slices.Clone(a.recent)}
}

// quarantine and release are the operator's overrides.
func (a *auditor) quarantine(agent, model, reason string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	k := audit.Key{Agent: agent, Model: model}
	a.apply(k, a.book.Quarantine(a.r.cfg.Clock.Now(), k, reason), "")
}

func (a *auditor) release(agent, model string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	k := audit.Key{Agent: agent, Model: model}
	ch := a.book.Release(a.r.cfg.Clock.Now(), k)
	a.apply(k, ch, "")
	return ch == audit.Released
}

// QuarantineRow is one agent quarantined for a model, with its evidence,
// as the status page shows it.
type QuarantineRow struct {
	Agent string    `json:"agent"`
	Model string    `json:"model"`
	Since time.Time `json:"since"`
	// ByOperator is true for a quarantine by hand; Reason is then the
	// operator's.
	ByOperator bool `json:"by_operator"`
	// Audit is the ID of the convicting audit (its log line and admin
	// record), Against the reference it was compared with, Reason what
	// differed.
	Audit   string `json:"audit,omitempty"`
	Against string `json:"against,omitempty"`
	Reason  string `json:"reason"`
	// Audits and Agreements are the pair's conclusive audits and the clean
	// ones among them.
	Audits     int `json:"audits"`
	Agreements int `json:"agreements"`
	// Clean counts clean re-audits since the conviction; NextAudit is when
	// the next is due.
	Clean     int       `json:"clean_reaudits"`
	NextAudit time.Time `json:"next_audit"`
}

// quarantined returns the pairs in quarantine, for the status page and
// the metrics.
func (a *auditor) quarantined() []QuarantineRow {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []QuarantineRow
	for _, s := range a.book.Standings() {
		if q := s.Quarantine; q != nil {
			out = append(out, QuarantineRow{Agent: s.Agent, Model: s.Model, Since: q.Since, ByOperator: q.ByOperator,
				Audit: q.Convicted.Audit, Against: q.Convicted.Against, Reason: q.Convicted.Reason,
				Audits: s.Audits, Agreements: s.Agreements, Clean: q.Clean, NextAudit: q.NextAudit})
		}
	}
	return out
}

// auditAction is the body of the admin API's quarantine and release.
type auditAction struct {
	Agent  string `json:"agent"`
	Model  string `json:"model"`
	Reason string `json:"reason"`
}

// serveAuditAction serves POST /admin/v1/audits/{action}: quarantine or
// release an agent for a model by hand.
func (r *Relay) serveAuditAction(w http.ResponseWriter, req *http.Request) {
	if r.audits == nil {
		writeError(w, errBadRequest("audits_disabled", "Audits are disabled on this relay.", nil))
		return
	}
	var act auditAction
	if err := json.NewDecoder(io.LimitReader(req.Body, 64<<10)).Decode(&act); err != nil {
		writeError(w, errBadRequest("invalid_json", `The body must be JSON: {"agent": NAME, "model": MODEL, "reason": TEXT}.`, err))
		return
	}
	if act.Agent == "" || act.Model == "" || len(act.Agent) > maxNameLen || len(act.Model) > 256 || len(act.Reason) > 1024 {
		writeError(w, errBadRequest("invalid_value", "agent and model are required (reason is optional, at most 1024 bytes).", nil))
		return
	}
	switch req.PathValue("action") {
	case "quarantine":
		if act.Reason == "" {
			act.Reason = "no reason given"
		}
		r.audits.quarantine(act.Agent, act.Model, act.Reason)
	case "release":
		if !r.audits.release(act.Agent, act.Model) {
			writeError(w, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "not_quarantined",
				Message: fmt.Sprintf("%s is not quarantined for %s.", act.Agent, act.Model)})
			return
		}
	default:
		writeError(w, errNotFound(req.URL.Path))
		return
	}
	r.log.Info().Str("agent", act.Agent).Str("model", act.Model).Str("action", req.PathValue("action")).Str("reason", act.Reason).Msg("admin audit action")
	st, _ := r.audits.standing(act.Agent, act.Model)
	writeJSON(w, http.StatusOK, st)
}

func (a *auditor) standing(agent, model string) (audit.Standing, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.book.Standing(audit.Key{Agent: agent, Model: model})
}

// auditMetrics are the audits' Prometheus metrics.
type auditMetrics struct {
	tokens      prometheus.Counter     // tokens spent on audits
	served      prometheus.Counter     // tokens served to clients
	verdicts    *prometheus.CounterVec // by outcome
	findings    *prometheus.CounterVec // cheap-check findings, by check
	quarantines prometheus.Counter
}

func newAuditMetrics(a *auditor) *auditMetrics {
	m := &auditMetrics{
		tokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_audit_tokens_total",
			Help: "Tokens (prompt and completion, every participant) spent on audits of agents.",
		}),
		served: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_served_tokens_total",
			Help: "Tokens (prompt and completion) served to clients, the base of the audit budget.",
		}),
		verdicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_audit_verdicts_total",
			Help: "Audit verdicts on agents, by outcome: agree, disagree, inconclusive.",
		}, []string{"outcome"}),
		findings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_answer_findings_total",
			Help: "Answers whose usage, model or published load no honest engine reports, by check.",
		}, []string{"check"}),
		quarantines: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_audit_quarantines_total",
			Help: "Times an agent was quarantined for a model (by audits or by hand).",
		}),
	}
	share := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "computeflux_audit_share",
		Help: "Audit tokens as a share of the tokens served to clients since the start (the budget is 0.02 by default).",
	}, func() float64 {
		a.mu.Lock()
		defer a.mu.Unlock()
		served, spent := a.budget.Totals()
		if served == 0 {
			return 0
		}
		return float64(spent) / float64(served)
	})
	quarantined := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "computeflux_agents_quarantined",
		Help: "Agent and model pairs in quarantine now.",
	}, func() float64 { return float64(len(a.quarantined())) })
	a.r.metrics.reg.MustRegister(m.tokens, m.served, m.verdicts, m.findings, m.quarantines, share, quarantined,
		quarantineCollector{a})
	return m
}

// quarantineDesc is one series per pair in quarantine now (so bounded by
// them): its value the Unix time it began, its audit label the convicting
// audit's ID ("operator" for one by hand), which names the audit's log
// line and its record in GET /admin/v1/audits.
var quarantineDesc = prometheus.NewDesc("computeflux_agent_quarantined_since_seconds",
	"An agent quarantined for a model: the Unix time it began; audit is the convicting audit's ID (operator: by hand).",
	[]string{"agent", "model", "audit"}, nil)

// quarantineCollector reports quarantineDesc.
type quarantineCollector struct{ a *auditor }

func (c quarantineCollector) Describe(ch chan<- *prometheus.Desc) { ch <- quarantineDesc }

func (c quarantineCollector) Collect(ch chan<- prometheus.Metric) {
	for _, q := range c.a.quarantined() {
		id := q.Audit
		if q.ByOperator {
			id = "operator"
		}
		ch <- prometheus.MustNewConstMetric(quarantineDesc, prometheus.GaugeValue,
			float64(q.Since.UnixNano())/1e9, q.Agent, q.Model, id)
	}
}
