package auditor

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// An audit round, in stages:
//
//	plan   (tick, under mu) the pair due (Book.Next), then its prompt: a
//	       bank item its group was never sent, answered by others before,
//	       for it alone (a replay); or a new prompt of the model's traffic
//	       form for it and references of other groups at once
//	send   (run) every participant's request, the way a client's goes to
//	       that endpoint, at once
//	judge  (run, under mu) the item takes the answers and judges them;
//	       the verdicts go to the book and into routing, a new item to
//	       the bank

// participant is one endpoint a round sends its prompt to.
type participant struct {
	m       Member
	group   string
	weight  float64
	suspect bool
	names   map[string]string // identity values of its own traffic, set in its copy of the prompt
	reqID   string            // its copy's X-Request-Id: a fresh one of the client's form
}

// plan is one round about to be sent.
type plan struct {
	id      string
	key     audit.Key
	why     audit.Why
	item    *audit.Item
	replay  bool
	parts   []participant // the subject first
	client  string        // a recent client of the model, named by the flow
	cost    int           // expected tokens of one request
	subject Member
}

// tick samples the agents' published load, re-checks one client's answer
// when one waits, and runs at most one audit round.
func (a *Auditor) tick() {
	now := a.now()
	a.sampleLoads(now)
	a.recheckOne()
	members := a.cfg.Fleet()
	p, ok := func() (plan, bool) {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.plan(now, members)
	}()
	if ok {
		a.run(p)
	}
}

func (a *Auditor) rules() audit.Rules { return audit.Rules{MinVoices: a.cfg.MinVoices} }

// group returns m's independence group.
func (a *Auditor) group(m Member) string {
	if m.Provider {
		return "provider:" + m.Name
	}
	return a.cfg.Independence.Group(m.Name, m.Addr)
}

// voice returns the weight of m's vote on model.
func (a *Auditor) voice(now time.Time, m Member, model string) float64 {
	if m.Provider || m.Trusted {
		return 1
	}
	var since time.Time
	if a.cfg.FirstSeen != nil {
		since = a.cfg.FirstSeen(m.Name)
	}
	return a.book.Voice(now, audit.Key{Agent: m.Name, Model: model}, since)
}

// plan chooses the next round, if one is due. The caller holds mu.
func (a *Auditor) plan(now time.Time, members []Member) (p plan, ok bool) {
	byModel := map[string][]Member{}
	byName := map[string]Member{}
	var live []audit.Key
	for _, m := range members {
		byName[m.Name] = m
		for _, model := range m.Models {
			byModel[model] = append(byModel[model], m)
			if !m.Provider && !m.Trusted {
				live = append(live, audit.Key{Agent: m.Name, Model: model})
			}
		}
	}
	rules := a.rules()
	// Worth a round: models clients use (their requests give the form),
	// and agents someone else can be compared with, now or from the bank.
	cands := live[:0]
	for _, k := range live {
		t := a.traffic[k.Model]
		if t == nil || t.n == 0 {
			continue
		}
		g := a.group(byName[k.Agent])
		other := slices.ContainsFunc(byModel[k.Model], func(m Member) bool { return a.group(m) != g })
		if other || a.bank.For(now, k.Model, g, byName[k.Agent].Kind, true, rules, a.rng) != nil ||
			a.bank.For(now, k.Model, g, byName[k.Agent].Kind, false, rules, a.rng) != nil {
			cands = append(cands, k)
		}
	}
	if len(cands) == 0 {
		return plan{}, false
	}
	affordable := a.budget.Afford(2 * a.traffic[cands[0].Model].cost())
	k, why, due := a.book.Next(now, cands, affordable)
	if !due {
		return plan{}, false
	}
	subject := byName[k.Agent]
	t := a.traffic[k.Model]
	a.seq++
	p = plan{id: fmt.Sprintf("aud-%d-%d", now.Unix(), a.seq), key: k, why: why, client: t.client(a.rng), cost: t.cost(), subject: subject}
	g := a.group(subject)
	p.parts = []participant{{m: subject, group: g, weight: a.voice(now, subject, k.Model), suspect: a.book.Quarantined(k)}}
	defer func() {
		if !ok {
			return
		}
		// Each participant's copy names a user of its own traffic, and
		// has a request ID of its own.
		id := http.Header(p.item.Header).Get("X-Request-Id")
		for i := range p.parts {
			p.parts[i].names = t.namesFor(p.parts[i].m.Name, a.rng)
			if id != "" {
				p.parts[i].reqID = audit.Shaped(id, a.rng)
			}
		}
	}()
	if it := a.bank.For(now, k.Model, g, subject.Kind, true, rules, a.rng); it != nil {
		p.item, p.replay, p.cost = it, true, max(it.Cost, 1)
		return p, true
	}
	tmpl, hdr := t.template(a.rng)
	refs := a.references(now, k, g, subject.Kind, tmpl.Sampled, byModel[k.Model])
	if len(refs) == 0 {
		// Nobody to compare with now: add an answer to a prompt that
		// waits for more, or start one.
		if it := a.bank.For(now, k.Model, g, subject.Kind, false, rules, a.rng); it != nil {
			p.item, p.replay, p.cost = it, true, max(it.Cost, 1)
			return p, true
		}
		if !why.Mandatory() {
			return plan{}, false
		}
	}
	p.parts = append(p.parts, refs...)
	body := a.cfg.Seed(tmpl.Fill(k.Model, t.phrases, a.rng))
	if id := hdr.Get("X-Request-Id"); id != "" {
		hdr.Set("X-Request-Id", audit.Shaped(id, a.rng)) // the client's own stays out of the bank
	}
	p.item = audit.NewItem(p.id, k.Model, body, hdr, tmpl.Sampled, now)
	return p, true
}

// references returns the endpoints a new prompt goes to beside the
// subject: the operator's references for the model that compare with it,
// if any (they decide alone); otherwise up to References agents of other
// groups, one per group, of the subject's engine kind when the prompt is
// sampled, not quarantined, least recently audited first; and the
// provider endpoints serving the model while the agents are fewer than
// MinVoices groups (a provider's tokens cost the operator money). The
// caller holds mu.
func (a *Auditor) references(now time.Time, k audit.Key, group, kind string, sampled bool, members []Member) []participant {
	compares := func(m Member) bool { return !sampled || m.Kind == kind }
	var out []participant
	for _, m := range members {
		if m.Trusted && compares(m) {
			out = append(out, participant{m: m, group: a.group(m), weight: 1})
		}
	}
	if len(out) > 0 {
		return out
	}
	var agents, providers []Member
	for _, m := range members {
		switch {
		case m.Name == k.Agent || m.Trusted || !compares(m):
		case m.Provider:
			providers = append(providers, m)
		case a.group(m) != group && !a.book.Quarantined(audit.Key{Agent: m.Name, Model: k.Model}):
			agents = append(agents, m)
		}
	}
	a.rng.Shuffle(len(agents), func(i, j int) { agents[i], agents[j] = agents[j], agents[i] })
	last := func(m Member) time.Time {
		st, _ := a.book.Standing(audit.Key{Agent: m.Name, Model: k.Model})
		return st.LastAudit
	}
	slices.SortStableFunc(agents, func(x, y Member) int { return last(x).Compare(last(y)) })
	seen := map[string]bool{}
	for _, m := range agents {
		g := a.group(m)
		if seen[g] || len(out) >= a.cfg.References {
			continue
		}
		seen[g] = true
		out = append(out, participant{m: m, group: g, weight: a.voice(now, m, k.Model)})
	}
	minVoices := a.cfg.MinVoices
	if minVoices <= 0 {
		minVoices = audit.DefaultMinVoices
	}
	if len(out) < minVoices {
		for _, m := range providers {
			out = append(out, participant{m: m, group: a.group(m), weight: 1})
		}
	}
	return out
}

// answer is what one participant answered.
type answer struct {
	c      audit.Completion
	tokens int
	err    error
}

// run sends the plan's prompt to its participants at once, judges the
// answers and records the verdicts.
func (a *Auditor) run(p plan) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.Timeout)
	defer cancel()
	answers := make([]answer, len(p.parts))
	var wg sync.WaitGroup
	for i, pt := range p.parts {
		wg.Go(func() {
			// The user a participant's own traffic names: no engine decodes
			// by it, so the answers still compare.
			req := Request{Endpoint: pt.m.Name, Model: p.key.Model, Client: p.client, Body: audit.SetFields(p.item.Body, pt.names),
				Header: http.Header(p.item.Header).Clone(), Cost: p.cost}
			if pt.reqID != "" {
				// A client's request ID is its own: every copy gets a
				// fresh one of the same form.
				req.Header.Set("X-Request-Id", pt.reqID)
			}
			answers[i].c, answers[i].tokens, answers[i].err = a.ask(ctx, req)
		})
	}
	wg.Wait()
	if a.ctx.Err() != nil {
		return // stopping: no evidence
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	rec := Record{ID: p.id, At: now, Model: p.key.Model, Subject: p.key.Agent, Why: p.why.String(),
		Item: p.item.ID, Replay: p.replay, Sampled: p.item.Sampled, Verdicts: map[string]string{}}
	var parts []audit.Participant
	for i, pt := range p.parts {
		ans := answers[i]
		rec.Tokens += ans.tokens
		if ans.err != nil {
			rec.Verdicts[pt.m.Name] = "error: " + ans.err.Error()
			p.item.Saw(pt.group)
			continue
		}
		if i == 0 && p.item.Cost == 0 {
			p.item.Cost = ans.tokens
		}
		parts = append(parts, audit.Participant{Agent: pt.m.Name, Group: pt.group, Weight: pt.weight, Kind: pt.m.Kind,
			Trusted: pt.m.Trusted, Suspect: pt.suspect, Answer: ans.c.Answer})
	}
	a.budget.Spend(rec.Tokens)
	a.m.tokens.Add(float64(rec.Tokens))
	before := 0
	if p.replay {
		before = p.item.Size()
	}
	verdicts := p.item.Answer(a.rules(), parts...)
	if err := answers[0].err; err != nil {
		// The subject did not answer: a timeout, an overloaded or
		// restarting engine. No evidence, but the audit happened.
		verdicts = append(verdicts, audit.Verdict{Agent: p.key.Agent, Outcome: audit.Inconclusive, Reason: "no answer: " + err.Error()})
	}
	providers := map[string]bool{}
	for _, pt := range p.parts {
		providers[pt.m.Name] = pt.m.Provider
	}
	for _, v := range verdicts {
		if providers[v.Agent] {
			continue // a provider endpoint is a voice, never audited
		}
		pk := audit.Key{Agent: v.Agent, Model: p.key.Model}
		change := a.book.Record(now, p.id, pk, v)
		rec.Verdicts[v.Agent] = v.Outcome.String()
		if v.Agent == p.key.Agent {
			rec.Against, rec.Reason = v.Against, v.Reason
			if v.Evidence.Reason != "" {
				rec.Reason += ": " + v.Evidence.Reason
			}
		}
		a.m.verdicts.WithLabelValues(v.Outcome.String()).Inc()
		a.apply(pk, change, p.id)
	}
	if p.replay {
		a.bank.Grew(p.item, before)
	} else {
		a.bank.Keep(now, p.item)
	}
	a.remember(rec)
	ev := a.log.Info()
	if rec.Verdicts[p.key.Agent] == audit.Disagree.String() {
		ev = a.log.Warn()
	}
	ev.Str("audit", p.id).Str("model", p.key.Model).Str("agent", p.key.Agent).Str("why", rec.Why).
		Str("item", p.item.ID).Bool("replay", p.replay).Bool("sampled", p.item.Sampled).
		Str("verdicts", verdictString(rec.Verdicts)).Str("against", rec.Against).Str("reason", rec.Reason).
		Int("tokens", rec.Tokens).Msg("audit")
}

// remember keeps rec among the recent audits. The caller holds mu.
func (a *Auditor) remember(rec Record) {
	a.recent = append(a.recent, rec)
	if len(a.recent) > maxRecent {
		a.recent = slices.Delete(a.recent, 0, len(a.recent)-maxRecent)
	}
}

// apply puts a pair's standing into routing, and logs a change. The
// caller holds mu.
func (a *Auditor) apply(k audit.Key, change audit.Change, id string) {
	st, _ := a.book.Standing(k)
	a.cfg.SetWeight(k.Agent, k.Model, st.Weight)
	switch change {
	case audit.Quarantined:
		a.m.quarantines.Inc()
		a.bank.Distrust(k.Agent, k.Model)
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
	errOverloaded = errors.New("engine overloaded")
	errStatus     = errors.New("engine answered an error")
)

// maxAnswer bounds an audit answer read.
const maxAnswer = 4 << 20

// ask sends one audit request and reads the answer, streamed or not, as
// the request asked.
func (a *Auditor) ask(ctx context.Context, req Request) (audit.Completion, int, error) {
	resp, err := a.cfg.Send(ctx, req)
	if err != nil {
		return audit.Completion{}, 0, err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable:
		return audit.Completion{}, 0, fmt.Errorf("%w (%d)", errOverloaded, resp.StatusCode)
	case resp.StatusCode != http.StatusOK:
		return audit.Completion{}, 0, fmt.Errorf("%w (%d)", errStatus, resp.StatusCode)
	}
	var comp audit.Completion
	events := 0 // stream events: about one per token
	lr := io.LimitReader(resp.Body, maxAnswer)
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		sc := bufio.NewScanner(lr)
		sc.Buffer(make([]byte, 64<<10), maxAnswer)
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
	tokens := EstimateTokens(len(req.Body), len(comp.Answer.Text), events)
	if u := comp.Usage; u != nil {
		tokens = u.Prompt + u.Completion
	}
	return comp, tokens, nil
}

// EstimateTokens stands in for an answer's usage when it has none (a
// stream whose client did not ask for it): a token per 4 bytes of the
// request, and a token per stream event (engines send about one token per
// event) or per 4 bytes of a whole answer's text. Client answers and audit
// answers are counted alike.
func EstimateTokens(requestBytes, textBytes, events int) int {
	if events > 0 {
		return requestBytes/4 + events
	}
	return requestBytes/4 + textBytes/4
}
