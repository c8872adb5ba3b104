package relay_test

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// restartableEngine is an itEngine whose HTTP server can go down and come
// back on the same address.
type restartableEngine struct {
	*itEngine
	addr string
}

func newRestartableEngine(t *testing.T, name string) *restartableEngine {
	e := newITEngine(t, name, "m1")
	return &restartableEngine{itEngine: e, addr: e.srv.Listener.Addr().String()}
}

func (e *restartableEngine) down() { e.srv.Close() }

func (e *restartableEngine) up(t *testing.T) {
	ln, err := net.Listen("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	e.srv = httptest.NewUnstartedServer(http.HandlerFunc(e.serve))
	e.srv.Listener.Close()
	e.srv.Listener = ln
	e.srv.Start()
	t.Cleanup(e.srv.Close)
}

// Engine down, agent up: requests that meet the refused connection are
// retried on another agent at once, and the agent drains (out of routing)
// until its engine answers again.
func TestEngineDownAgentUp(t *testing.T) {
	rl := startRelayLogger(t, zerolog.New(io.Discard))
	down := newRestartableEngine(t, "down")
	startRealAgent(t, rl, "down", down.itEngine)
	startRealAgent(t, rl, "up", newITEngine(t, "up", "m1"))
	waitAgents(t, rl, "down", "up")

	down.down()
	stopped := time.Now()
	c := newClient(t, rl.url)
	for i := range 8 {
		status, agent := c.chat("m1", "s"+string(rune('a'+i)))
		if status != http.StatusOK || agent != "up" {
			t.Fatalf("request %d with an engine down: status %d from %q, want 200 from up", i, status, agent)
		}
	}
	draining := func() bool {
		for _, a := range rl.r.Registry().Agents() {
			if a.Name == "down" {
				return a.Draining || a.Health.Draining
			}
		}
		return false
	}
	waitFor(t, "the agent of the dead engine to drain", draining)
	t.Logf("agent draining %v after its engine stopped", time.Since(stopped).Round(time.Millisecond))

	down.up(t)
	back := time.Now()
	waitAgents(t, rl, "down")
	t.Logf("agent routable again %v after its engine came back", time.Since(back).Round(time.Millisecond))
}
