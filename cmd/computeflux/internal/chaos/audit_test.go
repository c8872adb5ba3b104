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
// serving another model under the same name; when llama.cpp engines are
// installed, also an operator's reference, an honest llama.cpp agent and
// one serving another GGUF. Each liar must leave routing (quarantine)
// within the run (under the 2 minutes after its first request that the
// audits promise) and serve under 1% of its model's requests afterwards;
// no honest agent may be quarantined; audits may cost at most 2% of the
// served tokens. Then two of three agents lie together: consensus alone
// convicts nobody, an operator's reference convicts both liars.
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
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	res, err := RunAudit(ctx, AuditConfig{Binary: binary, Groups: groups, Duration: 60 * time.Second, Progress: testWriter{t}})
	if res != nil {
		res.Write(testWriter{t})
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range res.Agents {
		switch a.Kind {
		case "liar":
			if a.Quarantined == 0 || a.First < 0 {
				t.Errorf("%s (another model) was not quarantined in %v (first request at %v)", a.Name, res.Wall, a.First)
				continue
			}
			if d := a.Quarantined - a.First; d > 2*time.Minute {
				t.Errorf("%s left routing %v after its first request, want at most 2m", a.Name, d)
			}
			if a.AllAfter < 20 || 100*a.ServedAfter >= a.AllAfter {
				t.Errorf("%s served %d of %d requests after its quarantine, want under 1%% of at least 20", a.Name, a.ServedAfter, a.AllAfter)
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

	// Two of three lying together.
	for _, ref := range []bool{false, true} {
		res, err := RunAudit(ctx, AuditConfig{Binary: binary, Groups: []AuditGroup{{Honest: 1, Liars: 2, Reference: ref}},
			Duration: 20 * time.Second, Progress: testWriter{t}})
		if res != nil {
			res.Write(testWriter{t})
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range res.Agents {
			caught := a.Quarantined != 0
			if want := ref && a.Kind == "liar"; caught != want {
				t.Errorf("reference %v: %s (%s) quarantined %v, want %v", ref, a.Name, a.Kind, caught, want)
			}
		}
	}
}
