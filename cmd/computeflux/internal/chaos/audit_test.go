package chaos

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/llamaengine"
	"github.com/computeflux/computeflux/agent/llamaengine/llamatest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/scheduler/audit"
)

// TestAuditRealProcesses runs the audit scenario as real processes with
// the relay's audits at their defaults, under sampled traffic with a user
// field, as chat front ends send: three honest sim agents and one serving
// another model (another seed) under the same name; when llama.cpp
// engines are installed (CI installs them), also three honest llama.cpp
// agents beside a front that serves what looks like an audit from the
// claimed GGUF and the rest from another, two honest ones beside a liar,
// and one honest agent and a liar beside a provider endpoint serving the
// model. Each cheater leaves routing (quarantine) within 150 s of its
// first request (a liar by its third audit, a front by its sixth), and
// none of the requests sent in the 10 s of load after that reaches it; no
// honest agent is quarantined; no request fails; every agent takes part
// in audits (a new agent is audited at once, whatever the budget); the
// audits cost at most 2% of the served tokens and the budget's burst,
// which the mandatory audits may spend ahead. The two parts of bench
// --scenario audit that run longer show the share in the last 30 s of 150
// s and the honest agents' shares with audits on and off.
func TestAuditRealProcesses(t *testing.T) {
	slow.Gate(t, "runs the computeflux binary as processes")
	groups := []AuditGroup{{Honest: 3, Liars: 1}}
	if err := llamaengine.Available(""); err == nil {
		groups = append(groups, AuditGroup{Honest: 3, Fronts: 1, Llama: true}, AuditGroup{Honest: 2, Liars: 1, Llama: true},
			AuditGroup{Honest: 1, Liars: 1, Provider: true, Llama: true})
	} else if os.Getenv(llamatest.RequireEnv) != "" {
		t.Fatalf("%s is set but: %v", llamatest.RequireEnv, err)
	} else {
		t.Logf("without llama.cpp engines: %v", err)
	}
	// The load runs 10 s past the last quarantine, 150 s at most.
	const bound, after = 150 * time.Second, 10 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := RunAudit(ctx, AuditConfig{Binary: binary, Groups: groups, Duration: bound, After: after, Window: after, Progress: testWriter{t}})
	if res != nil {
		res.Write(testWriter{t})
	}
	if err != nil {
		t.Fatal(err)
	}
	for m, n := range res.Failed {
		t.Errorf("%d requests for %s failed", n, m)
	}
	for _, a := range res.Agents {
		if a.Audits == 0 && a.Kind != "reference" {
			t.Errorf("%s (%s) took part in no audit in %v", a.Name, a.Kind, res.Wall)
		}
		switch a.Kind {
		case "liar", "front":
			if a.Quarantined == 0 {
				t.Errorf("%s (%s) was not quarantined in %v (first request at %v)", a.Name, a.Kind, res.Wall, a.First)
				continue
			}
			// A liar: two convicting audits in a row from a clean start,
			// one inconclusive on the way allowed. A front answers from
			// the claimed model what it takes for an audit, and some
			// audits it takes for one.
			most := 3
			if a.Kind == "front" {
				most = 6
				// It is caught after a handful of requests, so how it split
				// them is noise; that it served some from another model is
				// what makes it a cheater.
				if a.Cheap == 0 {
					t.Errorf("%s sent %d requests to the claimed model and none to another: not cheating", a.Name, a.Real)
				}
			}
			if a.AuditsToQuarantine > most {
				t.Errorf("%s was quarantined by its audit %d, want by its %dth at the latest", a.Name, a.AuditsToQuarantine, most)
			}
			if d := a.Quarantined - max(a.First, 0); d > bound {
				t.Errorf("%s left routing %v after its first request, want at most %v", a.Name, d, bound)
			}
			if a.AllAfter < 20 || a.ServedAfter != 0 {
				t.Errorf("%s served %d of the %d requests for %s sent after its quarantine, want 0 of at least 20", a.Name, a.ServedAfter, a.AllAfter, a.Model)
			}
		default:
			if a.Quarantined != 0 {
				t.Errorf("%s (%s) was quarantined: %s", a.Name, a.Kind, a.Reason)
			}
		}
	}
	// The budget: 2% of the served tokens, and what the mandatory audits
	// (every new agent's, at once) spent ahead of it, at most its burst.
	if res.AuditTokens <= 0 || res.AuditTokens > 0.02*res.ServedTokens+audit.DefaultBurst {
		t.Errorf("audits cost %.0f tokens of %.0f served (share %.4f), want above 0 and at most 2%% plus %d", res.AuditTokens, res.ServedTokens, res.Share, audit.DefaultBurst)
	}
}
