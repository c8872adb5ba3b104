package relay_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/p2p/protocol/ping"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/scheduler"
)

// oneViewBound is how long after a silent death the router, the routable
// gauge and the admin API must all have stopped counting the agent: the
// idle silence bound (3 s) with room for a loaded machine, well short of
// the 10 s after which the relay takes a silent agent out of routing
// altogether (the lag the operator's view used to have).
const oneViewBound = 5 * time.Second

// An agent killed without a goodbye (every packet of its host dropped) is
// avoided by the router within the silence bound; the routable gauge on
// /metrics, /healthz and the admin API's table stop counting it at the
// same moment, not when the relay gives up on it seconds later.
func TestOperatorViewFollowsRouter(t *testing.T) {
	t.Parallel() // waits on agents over QUIC, in its own relay
	ctx := context.Background()
	const adminKey = "sk-admin-oneview"
	cl, err := relaytest.Start(ctx, relaytest.Config{Engines: 2, Engine: simengine.Config{TimeScale: 100}, AdminKey: adminKey})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	r := cl.Relay()
	waitFor(t, "the admin API to listen", func() bool { return r.AdminAddr() != "" })
	admin := "http://" + r.AdminAddr()

	gauge := func() int { return int(scrapeGauge(t, cl.URL()+"/metrics", "computeflux_agents_routable")) }
	healthz := func() int {
		resp, err := http.Get(cl.URL() + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v struct {
			Routable int `json:"agents_routable"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			t.Fatal(err)
		}
		return v.Routable
	}
	adminOK := func() map[string]bool {
		req, _ := http.NewRequest(http.MethodGet, admin+"/admin/v1/endpoints", nil)
		req.Header.Set("Authorization", "Bearer "+adminKey)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v struct{ Endpoints []relay.TableRow }
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			t.Fatal(err)
		}
		ok := map[string]bool{}
		for _, row := range v.Endpoints {
			if row.State == "ok" {
				ok[row.Name] = true
			}
		}
		return ok
	}
	waitFor(t, "both agents counted everywhere", func() bool {
		return gauge() == 2 && healthz() == 2 && len(adminOK()) == 2
	})

	name := cl.Engine(1).Name
	killed := time.Now()
	if err := cl.KillAgent(1); err != nil {
		t.Fatal(err)
	}
	var router, gaugeAt, healthzAt, adminAt time.Duration
	for router == 0 || gaugeAt == 0 || healthzAt == 0 || adminAt == 0 {
		since := time.Since(killed)
		if since > 3*oneViewBound {
			break
		}
		if router == 0 && suspectOrGone(r.Scheduler(), name) {
			router = since
		}
		if gaugeAt == 0 && gauge() == 1 {
			gaugeAt = since
		}
		if healthzAt == 0 && healthz() == 1 {
			healthzAt = since
		}
		if adminAt == 0 && !adminOK()[name] {
			adminAt = since
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("after the silent kill: router %v, gauge %v, /healthz %v, admin API %v", router, gaugeAt, healthzAt, adminAt)
	for what, at := range map[string]time.Duration{"the router": router, "the routable gauge": gaugeAt, "/healthz": healthzAt, "the admin API": adminAt} {
		if at == 0 || at > oneViewBound {
			t.Errorf("%s still counted the silent agent %v after its death (bound %v; 0: until the end of the wait)", what, at, oneViewBound)
		}
	}
	if gaugeAt > router+time.Second || adminAt > router+time.Second || healthzAt > router+time.Second {
		t.Errorf("the operator's view lagged the router's (router %v, gauge %v, /healthz %v, admin %v)", router, gaugeAt, healthzAt, adminAt)
	}
	if got := gauge(); got != 1 {
		t.Errorf("routable gauge %d after the kill, want 1 (the live agent)", got)
	}
}

// scrapeGauge reads the value of an unlabelled series from a /metrics URL.
func scrapeGauge(t testing.TB, url, name string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, name+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return v
		}
	}
	t.Fatalf("%s not in %s", name, url)
	return 0
}

// An operator's drain holds while the request path's liveness checks find
// the agent silent and after it answers again: the liveness verdict changes
// the agent's suspicion, never the operator's word.
func TestOperatorDrainSurvivesSilence(t *testing.T) {
	t.Parallel() // waits on agents over QUIC, in its own relay
	rl := startRelayLogger(t, zerolog.New(io.Discard))
	// No ping service: the relay's probes go unanswered, as a frozen
	// process's.
	h := newHostOpts(t, libp2p.Ping(false))
	joinHost(t, rl, h, "frozen")
	waitAgents(t, rl, "frozen")
	if err := rl.Relay.SetAdmin("frozen", "drain", 0); err != nil {
		t.Fatal(err)
	}
	health := func() scheduler.Health {
		hl, ok := agentHealth(rl, "frozen")
		if !ok {
			t.Fatal("the agent left the scheduler")
		}
		return hl
	}
	if !health().Draining {
		t.Fatal("the admin drain did not reach the scheduler")
	}
	waitFor(t, "the silent agent to turn suspect", func() bool { return health().Suspect })
	if hl := health(); !hl.Draining {
		t.Fatalf("health %+v once silent: the operator's drain was lost", hl)
	}
	ping.NewPingService(h) // it wakes up
	waitFor(t, "the agent to answer again", func() bool { return !health().Suspect })
	if hl := health(); !hl.Draining {
		t.Fatalf("health %+v once it answered again: the operator's drain was lost", hl)
	}
	for _, row := range rl.Relay.Table() {
		if row.Name == "frozen" && (row.State != "draining" || !row.Draining) {
			t.Fatalf("admin row %+v, want draining", row)
		}
	}
	if err := rl.Relay.SetAdmin("frozen", "undrain", 0); err != nil {
		t.Fatal(err)
	}
	if health().Draining {
		t.Fatal("undrain did not reach the scheduler")
	}
}
