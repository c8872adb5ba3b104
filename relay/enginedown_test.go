package relay_test

import (
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/relaytest"
)

// Engine down, agent up: requests that meet the refused connection are
// retried on another agent at once, and the agent drains (out of routing)
// until its engine answers again. The agent's periodic refresh is an hour
// here: only the checks a failed request triggers (now, then every second
// while the engine fails) can drain it, after two failed checks, and bring
// it back after one good one; each is bounded by two of those seconds.
func TestEngineDownAgentUp(t *testing.T) {
	const (
		recheck = time.Second // the agent's check interval while its engine fails
		bound   = 2 * recheck
	)
	rl := startRelayLogger(t, zerolog.New(io.Discard))
	down := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "down"})
	for name, url := range map[string]string{"down": down.URL(), "up": relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "up"}).URL()} {
		cfg := relaytest.AgentConfig(name, itToken, url, rl.Addr())
		cfg.RefreshInterval = time.Hour
		relaytest.RunAgent(t, cfg)
	}
	waitAgents(t, rl, "down", "up")

	down.Down()
	c := newClient(t, rl.URL)
	// Requests go on until one has met the dead engine (the scheduler may
	// send the first few to the other agent): each is served by up.
	var firstFailure time.Time
	for i := 0; firstFailure.IsZero(); i++ {
		if i == 40 {
			t.Fatal("40 requests and none was tried on the agent of the dead engine")
		}
		status, served := c.chat("m1", fmt.Sprintf("s%d", i))
		if status != http.StatusOK || served != "up" {
			t.Fatalf("request %d with an engine down: status %d from %q, want 200 from up", i, status, served)
		}
		for _, e := range rl.Relay.Scheduler().Snapshot() {
			if e.ID == "down" && e.Failures > 0 {
				firstFailure = time.Now()
			}
		}
	}
	draining := func() bool {
		for _, a := range rl.Relay.Registry().Agents() {
			if a.Name == "down" {
				return a.Draining || a.Health.Draining
			}
		}
		return false
	}
	// Polled past the bound, so that a failure says how long it took.
	waitFor(t, "the agent of the dead engine to drain", draining)
	if took := time.Since(firstFailure); took > bound {
		t.Errorf("agent draining %v after the first request failed on it, want within %v (two engine checks %v apart, the first at that request)", took.Round(time.Millisecond), bound, recheck)
	} else {
		t.Logf("agent draining %v after the first request failed on it", took.Round(time.Millisecond))
	}

	down.Up(t)
	back := time.Now()
	waitAgents(t, rl, "down")
	if took := time.Since(back); took > bound {
		t.Errorf("agent routable again %v after its engine came back, want within %v (the next engine check, %v apart)", took.Round(time.Millisecond), bound, recheck)
	} else {
		t.Logf("agent routable again %v after its engine came back", took.Round(time.Millisecond))
	}
}
