package relay

import (
	"testing"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// TestAuditNamesAClientsFlow: an audit carries the flow header every
// request from the relay carries, naming one of the model's recent
// clients with that client's weight and class, as its own request would.
func TestAuditNamesAClientsFlow(t *testing.T) {
	cf, err := ParseClientsFile([]byte("clients:\n  - name: night\n    keys: [sk-night]\n    weight: 3\n    class: batch\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, nil, func(c *Config) { c.Clients = cf })
	a := tb.relay.audits
	if a == nil {
		t.Fatal("no auditor")
	}
	a.addShape(time.Now(), "m1", "night", shape{messages: 1, promptBytes: 100, keys: []string{"model", "messages"}})
	_, hdr := a.prompt("m1")
	fl := transport.ParseFlow(hdr.Get(transport.HeaderFlow))
	if fl.Client != "night" || fl.Weight != 3 || fl.Class != scheduler.BandBatch || fl.Cost <= 0 {
		t.Fatalf("audit flow %+v (header %q), want client night, weight 3, batch, a cost", fl, hdr.Get(transport.HeaderFlow))
	}
}

// TestAnswerChecksSampled: a model's answers are kept for the answer
// checks at most once every answerEvery, while every answer an agent
// serves counts toward the audit budget.
func TestAnswerChecksSampled(t *testing.T) {
	clock := newStepClock() // limits_test.go
	a := newTestbed(t, nil, func(c *Config) { c.Clock = clock }).relay.audits
	if !a.tapDue("m9") {
		t.Fatal("a model's first answer is not kept")
	}
	a.addShape(clock.Now(), "m9", "", shape{messages: 1, keys: []string{"model"}})
	kept := 0
	for range 100 {
		if a.tapDue("m9") {
			kept++
		}
		clock.add(answerEvery / 10)
	}
	// 100 requests over 10 answerEvery: one kept in each.
	if kept != 10 {
		t.Fatalf("kept %d answers of 100 over 10 intervals, want 10", kept)
	}

	// Every served answer counts toward the budget, kept or not: the fake
	// engine's answers say 3 + 3 tokens.
	tb := newTestbed(t, []string{"a"}, nil)
	before := tb.relay.audits.status().ServedTokens
	const n = 30
	for range n {
		if st, _, _ := tb.chat(""); st != 200 {
			t.Fatalf("status %d", st)
		}
	}
	if got := tb.relay.audits.status().ServedTokens - before; got != 6*n {
		t.Fatalf("served tokens grew by %d over %d answers of 6 tokens, want %d", got, n, 6*n)
	}
}
