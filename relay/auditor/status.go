package auditor

import (
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// Status is the admin API's view of the audits.
type Status struct {
	// Share is the budget's share of served tokens; ServedTokens and
	// AuditTokens the tokens served to clients and spent on audits since
	// the start.
	Share        float64 `json:"share"`
	ServedTokens int64   `json:"served_tokens"`
	AuditTokens  int64   `json:"audit_tokens"`
	// Bank is the number of audit prompts kept for later rounds.
	Bank int `json:"bank"`
	// Standings are every agent and model's score and evidence.
	Standings []audit.Standing `json:"standings"`
	// Recent are the latest audits, oldest first.
	Recent []Record `json:"recent"`
}

// Status returns the auditor's state for the admin API.
func (a *Auditor) Status() Status {
	a.mu.Lock()
	defer a.mu.Unlock()
	served, spent := a.budget.Totals()
	return Status{Share: a.budget.Fraction(), ServedTokens: served, AuditTokens: spent, Bank: a.bank.Len(),
		Standings: a.book.Standings(), Recent: slices.Clone(a.recent)}
}

// Quarantine quarantines agent for model by the operator's hand.
func (a *Auditor) Quarantine(agent, model, reason string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	k := audit.Key{Agent: agent, Model: model}
	a.apply(k, a.book.Quarantine(a.now(), k, reason), "")
}

// Release ends agent's quarantine for model by the operator's hand, and
// reports whether there was one.
func (a *Auditor) Release(agent, model string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	k := audit.Key{Agent: agent, Model: model}
	ch := a.book.Release(a.now(), k)
	a.apply(k, ch, "")
	return ch == audit.Released
}

// Standing returns agent's record for model, and false for none.
func (a *Auditor) Standing(agent, model string) (audit.Standing, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.book.Standing(audit.Key{Agent: agent, Model: model})
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

// Quarantined returns the pairs in quarantine, for the status page and
// the metrics.
func (a *Auditor) Quarantined() []QuarantineRow {
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

// metrics are the audits' Prometheus metrics.
type metrics struct {
	tokens      prometheus.Counter     // tokens spent on audits
	served      prometheus.Counter     // tokens served to clients
	verdicts    *prometheus.CounterVec // by outcome
	findings    *prometheus.CounterVec // cheap-check findings, by check
	rechecks    *prometheus.CounterVec // clients' answers re-checked, by outcome
	quarantines prometheus.Counter
}

func newMetrics(a *Auditor, reg prometheus.Registerer) *metrics {
	m := &metrics{
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
		rechecks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_client_rechecks_total",
			Help: "Clients' answers re-checked against the operator's references, by outcome (agree, disagree, inconclusive, error, no_reference, dropped).",
		}, []string{"outcome"}),
		quarantines: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_audit_quarantines_total",
			Help: "Times an agent was quarantined for a model (by audits or by hand).",
		}),
	}
	if reg == nil {
		return m
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
	}, func() float64 { return float64(len(a.Quarantined())) })
	bank := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "computeflux_audit_bank_items",
		Help: "Audit prompts kept, with their answers, for later rounds of agents that were never sent them.",
	}, func() float64 {
		a.mu.Lock()
		defer a.mu.Unlock()
		return float64(a.bank.Len())
	})
	reg.MustRegister(m.tokens, m.served, m.verdicts, m.findings, m.rechecks, m.quarantines, share, quarantined, bank,
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
type quarantineCollector struct{ a *Auditor }

func (c quarantineCollector) Describe(ch chan<- *prometheus.Desc) { ch <- quarantineDesc }

func (c quarantineCollector) Collect(ch chan<- prometheus.Metric) {
	for _, q := range c.a.Quarantined() {
		id := q.Audit
		if q.ByOperator {
			id = "operator"
		}
		ch <- prometheus.MustNewConstMetric(quarantineDesc, prometheus.GaugeValue,
			float64(q.Since.UnixNano())/1e9, q.Agent, q.Model, id)
	}
}
