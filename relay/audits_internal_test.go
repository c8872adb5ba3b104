package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/relay/auditor"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// TestAuditNamesAClientsFlow: an audit carries the flow header every
// request from the relay carries, naming one of the model's recent
// clients with that client's weight and class, as its own request would;
// it holds a slot on the agent until its answer is read, as a client's
// request does.
func TestAuditNamesAClientsFlow(t *testing.T) {
	cf, err := ParseClientsFile([]byte("clients:\n  - name: night\n    keys: [sk-night]\n    weight: 3\n    class: batch\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.Clients = cf })
	resp, err := tb.relay.sendAudit(context.Background(), auditor.Request{Endpoint: "a", Model: "m1", Client: "night", Cost: 100,
		Body: []byte(`{"model":"m1","messages":[{"role":"user","content":"hi"}]}`)})
	if err != nil {
		t.Fatal(err)
	}
	if st := tb.relay.sched.Snapshot()[0]; st.InFlight != 1 {
		t.Errorf("an audit in flight holds %d slots, want 1", st.InFlight)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if st := tb.relay.sched.Snapshot()[0]; st.InFlight != 0 {
		t.Errorf("%d slots held after the answer was read", st.InFlight)
	}
	e := tb.engines["a"]
	e.mu.Lock()
	fl := transport.ParseFlow(e.last.Get(transport.HeaderFlow))
	e.mu.Unlock()
	if fl.Client != "night" || fl.Weight != 3 || fl.Class != scheduler.BandBatch || fl.Cost != 100 {
		t.Fatalf("audit flow %+v, want client night, weight 3, batch, cost 100", fl)
	}
}

// TestAnswersCountTowardTheBudget: every answer an agent serves counts
// toward the audit budget, kept for the answer checks or not: the fake
// engine's answers say 3 + 3 tokens.
func TestAnswersCountTowardTheBudget(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	before := tb.relay.audits.Status().ServedTokens
	const n = 30
	for range n {
		if st, _, _ := tb.chat(""); st != 200 {
			t.Fatalf("status %d", st)
		}
	}
	if got := tb.relay.audits.Status().ServedTokens - before; got != 6*n {
		t.Fatalf("served tokens grew by %d over %d answers of 6 tokens, want %d", got, n, 6*n)
	}
}

// TestForwardBody: agents get a seed where the client set none and
// pseudonyms of the same shape for user, safety_identifier and
// prompt_cache_key, the same for the same value; the rest byte for byte.
func TestForwardBody(t *testing.T) {
	ps := newPseudonyms([]byte("secret"))
	for _, tc := range []struct{ in, want string }{
		{`{"model":"m","messages":[]}`, `{"seed":7,"model":"m","messages":[]}`},
		{` { "model": "m" }`, ` {"seed":7, "model": "m" }`},
		{`{}`, `{"seed":7}`},
		{`{"model":"m","seed":42}`, `{"model":"m","seed":42}`},
	} {
		if got := string(forwardBody([]byte(tc.in), 7, ps.of)); got != tc.want {
			t.Errorf("%s: got %s, want %s", tc.in, got, tc.want)
		}
	}
	in := `{"model":"m","user":"alice-1234","messages":[{"role":"user","content":"user"}],"safety_identifier":"b\u00e9","prompt_cache_key":"chat-42","seed":1}`
	out := forwardBody([]byte(in), 7, ps.of)
	var a, b map[string]any
	if err := json.Unmarshal(out, &a); err != nil {
		t.Fatalf("%s: %v", out, err)
	}
	json.Unmarshal([]byte(in), &b)
	for _, k := range []string{"user", "safety_identifier", "prompt_cache_key"} {
		got, orig := a[k].(string), b[k].(string)
		if got == orig || len(got) != len(orig) && k != "safety_identifier" || got != ps.of(orig) {
			t.Errorf("%s: %q for %q", k, got, orig)
		}
	}
	if a["seed"] != 1.0 || !bytes.Contains(out, []byte(`"messages":[{"role":"user","content":"user"}]`)) {
		t.Errorf("the rest changed: %s", out)
	}
	if o2 := forwardBody([]byte(in), 9, ps.of); !bytes.Equal(out, o2) {
		t.Errorf("pseudonyms differ between two requests: %s, %s", out, o2)
	}
	if strings.Contains(string(out), "alice") {
		t.Errorf("the client's user reached the agent: %s", out)
	}
}
