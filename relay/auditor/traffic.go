package auditor

import (
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"slices"
	"time"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// What the auditor knows of a model's client requests, to write its
// prompts like them: their forms (audit.Template: no byte a client wrote),
// the phrases many clients share (audit.Phrases), the headers engines get,
// and the model's recent clients (whose flows audits name).

// modelTraffic is a model's recent request forms and clients.
type modelTraffic struct {
	forms   [16]form
	n       int                  // forms seen; the ring holds the last len(forms)
	clients map[string]time.Time // client names that used the model recently
	sampled time.Time            // when a request was last read for its form
	tapped  time.Time            // when an answer was last kept for the answer checks
	phrases *audit.Phrases
	// names holds, by agent, the identity field values (pseudonyms) of the
	// requests it served lately: an audit names to each participant a
	// user of its own traffic, as a request of that user would.
	names map[string]*names
}

// identityFields are the fields whose values agents get as pseudonyms.
var identityFields = [...]string{"user", "safety_identifier"}

// names is one agent's recent identity values, by field.
type names struct {
	vals [len(identityFields)][8]string
	n    [len(identityFields)]int
}

// maxNamedAgents bounds the agents whose names are kept per model.
const maxNamedAgents = 256

// noteNames keeps the identity values of a request agent served (as the
// agent got it). The caller holds mu.
func (t *modelTraffic) noteNames(agent string, forwarded []byte) {
	var f struct {
		User     *string `json:"user"`
		Identity *string `json:"safety_identifier"`
	}
	if json.Unmarshal(forwarded, &f) != nil || (f.User == nil && f.Identity == nil) {
		return
	}
	nm := t.names[agent]
	if nm == nil {
		if len(t.names) >= maxNamedAgents {
			return
		}
		nm = &names{}
		t.names[agent] = nm
	}
	for i, v := range [...]*string{f.User, f.Identity} {
		if v != nil {
			nm.vals[i][nm.n[i]%len(nm.vals[i])] = *v
			nm.n[i]++
		}
	}
}

// namesFor returns identity values agent's own traffic named, one per
// field it saw, to set in an audit's body for it; nil when none.
func (t *modelTraffic) namesFor(agent string, rng *rand.Rand) map[string]string {
	nm := t.names[agent]
	if nm == nil {
		return nil
	}
	out := map[string]string{}
	for i, f := range identityFields {
		if n := min(nm.n[i], len(nm.vals[i])); n > 0 {
			out[f] = nm.vals[i][rng.IntN(n)]
		}
	}
	return out
}

// form is one client request's template and the headers its engine got.
type form struct {
	t      *audit.Template
	header http.Header
}

// template returns a recent form of the model's requests: its template and
// a copy of its headers. The caller holds mu.
func (t *modelTraffic) template(rng *rand.Rand) (*audit.Template, http.Header) {
	f := t.forms[rng.IntN(min(t.n, len(t.forms)))]
	return f.t, f.header.Clone()
}

// client returns one of the model's recent clients, or "". The caller
// holds mu.
func (t *modelTraffic) client(rng *rand.Rand) string {
	if len(t.clients) == 0 {
		return ""
	}
	names := make([]string, 0, len(t.clients))
	for c := range t.clients {
		names = append(names, c)
	}
	slices.Sort(names)
	return names[rng.IntN(len(names))]
}

// cost estimates the tokens of one audit request of the model: its
// latest form's prompt and answer.
func (t *modelTraffic) cost() int {
	f := t.forms[(t.n-1)%len(t.forms)].t
	answer := f.MaxTokens
	if answer <= 0 {
		answer = 256
	}
	return f.PromptBytes/4 + 16 + answer
}

// Bounds of what is remembered of traffic.
const (
	maxModels          = 1024 // models whose traffic is remembered
	maxClientsPerModel = 64
	maxChecks          = 64 // clients' answers waiting for a re-check
)

// shapeEvery is how often a model's request is read for its form (and its
// phrases): reading every request would cost the relay's hot path a JSON
// parse of the prompt.
const shapeEvery = 200 * time.Millisecond

// answerEvery is how often a model's answer is kept and parsed for the
// answer checks (CheckAnswer): at most 50 a second per model, which checks
// every answer of light traffic and a steady sample of heavy traffic
// (parsing every answer cost about a sixth of the relay's CPU on small
// answers). An agent is sampled in proportion to what it serves.
const answerEvery = 20 * time.Millisecond

// TapDue reports whether the answer to a request of model that starts now
// should be kept (Tap) for the answer checks. verify forces it: the client
// asked that the answer be re-checked.
func (a *Auditor) TapDue(model string, verify bool) bool {
	if verify {
		return true
	}
	now := a.now()
	a.mu.Lock()
	defer a.mu.Unlock()
	t := a.traffic[model]
	if t == nil {
		return true // the model's first request: Answered records it
	}
	if now.Sub(t.tapped) < answerEvery {
		return false
	}
	t.tapped = now
	return true
}

// Served counts the tokens an agent served a client, which the audit
// budget is a share of.
func (a *Auditor) Served(tokens int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.budget.Served(int(tokens))
	a.m.served.Add(float64(max(tokens, 0)))
}

// Exchange is one client request's answer, as the request path hands it
// to the auditor.
type Exchange struct {
	// Model and Client are the request's model and client name (the API
	// key's; empty without keys); Agent the endpoint that served it.
	Model, Client, Agent string
	// Provider is true when Agent is a provider endpoint.
	Provider bool
	// Body is the request as the client sent it; Forwarded as the agent
	// got it (the relay's seed and pseudonyms in it).
	Body, Forwarded []byte
	// Header is the client's request header.
	Header http.Header
	// Stream is true for a streamed answer.
	Stream bool
	// Tap is what the answer's tap kept.
	Tap *Tap
	// Verify asks that the answer be re-checked against the operator's
	// references (the client's own choice, from the clients file).
	Verify bool
}

// Answered takes one client request and its answer: the request's form is
// kept now and then, the answer's tokens feed the budget (Served), the
// cheap checks look at it, and a re-check is queued when asked for. The
// request path calls it once, when an attempt's answer reached the client.
func (a *Auditor) Answered(x *Exchange) {
	now := a.now()
	a.mu.Lock()
	t := a.traffic[x.Model]
	sample := t == nil || now.Sub(t.sampled) >= shapeEvery
	if sample && t != nil {
		t.sampled = now
	}
	a.mu.Unlock()
	o := audit.Observed{Model: x.Model, RequestBytes: len(x.Body)}
	if sample {
		var texts []string
		tmpl, err := audit.Capture(x.Body, a.cfg.Pseudonym, func(s string) { texts = append(texts, s) })
		if err == nil {
			o.PromptText, o.Messages = tmpl.PromptBytes, tmpl.Messages
			a.addForm(now, x.Model, x.Client, form{t: tmpl, header: a.cfg.EngineHeaders(x.Header)}, texts)
		}
	}
	if x.Agent == "" || x.Provider || x.Tap == nil {
		return
	}
	if x.Forwarded != nil {
		a.mu.Lock()
		if t := a.traffic[x.Model]; t != nil {
			t.noteNames(x.Agent, x.Forwarded)
		}
		a.mu.Unlock()
	}
	if _, ok := x.Tap.observed(&o, x.Stream); ok {
		a.observeAnswer(x.Agent, o)
	}
	if x.Verify {
		a.queueRecheck(x)
	}
}

// addForm keeps a request's form and reads its texts' phrases.
func (a *Auditor) addForm(now time.Time, model, client string, f form, texts []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t := a.traffic[model]
	if t == nil {
		if len(a.traffic) >= maxModels {
			return
		}
		t = &modelTraffic{clients: make(map[string]time.Time), sampled: now,
			phrases: audit.NewPhrases(a.cfg.PhraseClients, 0, 0), names: map[string]*names{}}
		a.traffic[model] = t
	}
	t.forms[t.n%len(t.forms)] = f
	t.n++
	for _, s := range texts {
		t.phrases.Observe(client, s)
	}
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

// observeAnswer runs the cheap checks on one sampled answer of agent.
func (a *Auditor) observeAnswer(agent string, o audit.Observed) {
	findings := audit.CheckAnswer(o, audit.Limits{})
	now := a.now()
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
func (a *Auditor) sampleLoads(now time.Time) {
	if a.cfg.Loads == nil {
		return
	}
	for _, l := range a.cfg.Loads() {
		if l.InFlight == 0 {
			continue
		}
		a.mu.Lock()
		lc := a.loads[l.Agent]
		if lc == nil {
			if len(a.loads) >= maxModels {
				a.mu.Unlock()
				continue
			}
			lc = &audit.LoadCheck{}
			a.loads[l.Agent] = lc
		}
		if f, ok := lc.Sample(now, now, l.Published, l.InFlight); ok {
			for _, m := range l.Models {
				a.finding(now, audit.Key{Agent: l.Agent, Model: m}, f)
			}
		}
		a.mu.Unlock()
	}
}

// finding records a cheap check's finding. The caller holds mu.
func (a *Auditor) finding(now time.Time, k audit.Key, f audit.Finding) {
	a.book.Violation(now, k, f.Check, f.Detail)
	a.m.findings.WithLabelValues(f.Check).Inc()
	a.log.Info().Str("agent", k.Agent).Str("model", k.Model).Str("check", f.Check).Str("detail", f.Detail).Msg("answer check")
}
