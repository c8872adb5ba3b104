package chaos

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/llamaengine"
	"github.com/computeflux/computeflux/agent/llamaengine/llamatest"
)

// TestAuditRealProcesses runs the audit scenario as real processes with
// the relay's audits at their defaults: three honest sim agents and one
// serving another model (another seed) under the same name; when llama.cpp
// engines are installed (CI installs them), also an operator's reference,
// an honest llama.cpp agent and one serving another GGUF. Each liar leaves
// routing (quarantine) by its third audit and within 2 minutes of its
// first request, and none of the requests sent in the 10 s of load after
// that reaches it; no honest agent is quarantined; every agent but the
// operator's reference takes part in audits (a new agent is audited at
// once, whatever the budget); the audits cost at most
// 2% of the served tokens. Two agents lying together are shown in
// TestAuditCollusion (relay) and by bench --scenario audit.
func TestAuditRealProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the computeflux binary as processes")
	}
	groups := []AuditGroup{{Honest: 3, Liars: 1}}
	if err := llamaengine.Available(""); err == nil {
		groups = append(groups, AuditGroup{Reference: true, Honest: 1, Liars: 1, Llama: true})
	} else if os.Getenv(llamatest.RequireEnv) != "" {
		t.Fatalf("%s is set but: %v", llamatest.RequireEnv, err)
	} else {
		t.Logf("without llama.cpp engines: %v", err)
	}
	// The load runs 10 s past the last quarantine, 2 minutes at most.
	const bound, after = 2 * time.Minute, 10 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	res, err := RunAudit(ctx, AuditConfig{Binary: binary, Groups: groups, Duration: bound, After: after, Progress: testWriter{t}})
	if res != nil {
		res.Write(testWriter{t})
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range res.Agents {
		if a.Audits == 0 && a.Kind != "reference" {
			t.Errorf("%s (%s) took part in no audit in %v", a.Name, a.Kind, res.Wall)
		}
		switch a.Kind {
		case "liar":
			if a.Quarantined == 0 || a.First < 0 {
				t.Errorf("%s (another model) was not quarantined in %v (first request at %v)", a.Name, res.Wall, a.First)
				continue
			}
			// Two convicting audits in a row from a clean start; one
			// inconclusive on the way allowed.
			if a.AuditsToQuarantine > 3 {
				t.Errorf("%s was quarantined by its audit %d, want by its third at the latest", a.Name, a.AuditsToQuarantine)
			}
			if d := a.Quarantined - a.First; d > bound {
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
	if res.Share <= 0 || res.Share > 0.02 {
		t.Errorf("audits cost %.4f of the served tokens (%.0f of %.0f), want above 0 and at most 0.02", res.Share, res.AuditTokens, res.ServedTokens)
	}
}
