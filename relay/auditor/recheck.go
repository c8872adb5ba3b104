package auditor

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// Re-checks: a client the clients file marks (verify) has a share of its
// own answers sent again, with the same seed, to the operator's
// references for the model, and the agent's answer compared with theirs.
// The client's prompt goes to the operator's references only: no other
// contributor sees it.

// recheck is one client's answer waiting for its re-check.
type recheck struct {
	model, agent, client string
	body                 []byte // as the agent got it
	header               http.Header
	sampled              bool
	answer               audit.Answer
}

// queueRecheck keeps x's answer for a re-check, when it was kept whole;
// past maxChecks waiting, it is dropped.
func (a *Auditor) queueRecheck(x *Exchange) {
	c, ok := x.Tap.completion(x.Stream)
	if !ok {
		return
	}
	var f struct {
		Temperature *float64 `json:"temperature"`
	}
	if json.Unmarshal(x.Body, &f) != nil {
		return
	}
	rc := recheck{model: x.Model, agent: x.Agent, client: x.Client, body: x.Forwarded, header: a.cfg.EngineHeaders(x.Header),
		sampled: f.Temperature == nil || *f.Temperature != 0, answer: c.Answer}
	if rc.body == nil {
		rc.body = x.Body
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.checks) >= maxChecks {
		a.m.rechecks.WithLabelValues("dropped").Inc()
		return
	}
	a.checks = append(a.checks, rc)
}

// recheckOne re-checks the oldest answer waiting, if any: it sends the
// request to a reference of the operator's for the model whose engine
// compares with the agent's, and records the verdict.
func (a *Auditor) recheckOne() {
	a.mu.Lock()
	if len(a.checks) == 0 {
		a.mu.Unlock()
		return
	}
	rc := a.checks[0]
	a.checks = a.checks[1:]
	a.mu.Unlock()

	var subject, ref Member
	found := false
	members := a.cfg.Fleet()
	for _, m := range members {
		if m.Name == rc.agent {
			subject = m
		}
	}
	for _, m := range members {
		if m.Trusted && (!rc.sampled || m.Kind == subject.Kind) && hasModel(m, rc.model) {
			ref, found = m, true
			break
		}
	}
	if subject.Trusted {
		return // the reference itself served it
	}
	if !found {
		a.m.rechecks.WithLabelValues("no_reference").Inc()
		return
	}
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.Timeout)
	defer cancel()
	c, tokens, err := a.ask(ctx, Request{Endpoint: ref.Name, Model: rc.model, Client: rc.client, Body: rc.body, Header: rc.header, Cost: len(rc.body) / 4})
	if a.ctx.Err() != nil {
		return
	}
	now := a.now()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.seq++
	id := fmt.Sprintf("aud-%d-%d", now.Unix(), a.seq)
	rec := Record{ID: id, At: now, Model: rc.model, Subject: rc.agent, Why: "client", Sampled: rc.sampled,
		Verdicts: map[string]string{}, Tokens: tokens}
	a.budget.Spend(tokens)
	a.m.tokens.Add(float64(tokens))
	if err != nil {
		a.m.rechecks.WithLabelValues("error").Inc()
		rec.Verdicts[ref.Name] = "error: " + err.Error()
		a.remember(rec)
		return
	}
	parts := []audit.Participant{
		{Agent: rc.agent, Kind: subject.Kind, Answer: rc.answer},
		{Agent: ref.Name, Kind: ref.Kind, Trusted: true, Answer: c.Answer},
	}
	v := audit.Judge(parts, audit.Rules{Sampled: rc.sampled})[0]
	k := audit.Key{Agent: rc.agent, Model: rc.model}
	a.apply(k, a.book.Record(now, id, k, v), id)
	a.m.verdicts.WithLabelValues(v.Outcome.String()).Inc()
	a.m.rechecks.WithLabelValues(v.Outcome.String()).Inc()
	rec.Verdicts[rc.agent], rec.Against, rec.Reason = v.Outcome.String(), v.Against, v.Reason
	a.remember(rec)
	ev := a.log.Info()
	if v.Outcome == audit.Disagree {
		ev = a.log.Warn()
	}
	ev.Str("audit", id).Str("model", rc.model).Str("agent", rc.agent).Str("why", "client").
		Str("against", ref.Name).Str("verdict", v.Outcome.String()).Str("reason", v.Reason).Int("tokens", tokens).Msg("audit")
}

func hasModel(m Member, model string) bool {
	for _, x := range m.Models {
		if x == model {
			return true
		}
	}
	return false
}
