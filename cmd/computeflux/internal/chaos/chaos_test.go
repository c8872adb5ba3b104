package chaos

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// binary is the computeflux executable TestMain built, or "" when the
// slow tests do not run.
var binary string

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	flag.Parse()
	dir, err := os.MkdirTemp("", "computeflux-chaos-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if slow.Enabled() {
		binary = filepath.Join(dir, "computeflux")
		cmd := exec.Command("go", "build", "-o", binary, "github.com/computeflux/computeflux/cmd/computeflux")
		cmd.Stderr = os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building computeflux:", err)
			return 1
		}
	}
	return m.Run()
}

// The cluster runs as real processes: a relay, three sim engines and
// their agents. Under steady sessions (half streamed) one agent is
// SIGKILLed, another SIGSTOPped for 6 s and woken, and the killed one is
// started again. No non-streamed request may fail, no stream may fail
// before its first byte, every stream cut by a fault must end with an
// OpenAI error event, no stream may carry two completions, nothing may
// hang. The restarted agent must be back: "ok" in the relay's routing
// table, given new sessions, and serving every request sent while the
// others are drained. No process may panic (recovered or not).
func TestChaosRealProcesses(t *testing.T) {
	slow.Gate(t, "runs the computeflux binary as processes")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	res, err := Run(ctx, Config{Binary: binary, Progress: testWriter{t}})
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	res.Write(&sb)
	for _, l := range strings.Split(strings.TrimSpace(sb.String()), "\n") {
		t.Log(l)
	}
	defer func() {
		if t.Failed() {
			for _, e := range res.Events {
				t.Log("relay: " + e)
			}
		}
	}()
	// Only the killed and the frozen agent may cut a stream; a stream on
	// an agent no fault touched must end with [DONE].
	faulted := map[string]bool{agentName(0): true, agentName(1): true}
	served := 0
	for _, q := range res.Requests {
		switch {
		case q.Cause == "ok":
			served++
		case q.Cause == "error_event" && q.Stream && faulted[q.Agent]:
			// A stream cut by the fault after its first event.
		default:
			t.Errorf("request at %v (stream=%v, agent %q) ended %s after %v: %s",
				q.Start.Round(time.Millisecond), q.Stream, q.Agent, q.Cause, q.Took.Round(time.Millisecond), q.Detail)
		}
	}
	if served < 50 {
		t.Fatalf("only %d requests served: the load did not run", served)
	}
	for _, p := range res.Panics {
		t.Errorf("panic: %s", p)
	}
	if res.KillDetect == 0 || res.FreezeDetect == 0 {
		t.Errorf("the relay did not notice a fault: kill %v, freeze %v", res.KillDetect, res.FreezeDetect)
	}
	for _, f := range []struct {
		fault string
		took  time.Duration
	}{{"SIGKILL", res.KillDetect}, {"SIGSTOP", res.FreezeDetect}} {
		if f.took > detectBound {
			t.Errorf("the relay took the agent out of routing %v after its %s, want within %v (the request path's silence bound for a busy agent, %v, and four probe intervals of %v)",
				f.took.Round(time.Millisecond), f.fault, detectBound, busySilentAfter, busyProbeInterval)
		}
	}
	if res.BackAfterCont == 0 {
		t.Error("the frozen agent was not routable again after SIGCONT")
	}
	if res.RestartedBack == 0 {
		t.Errorf("the restarted agent is %q in the relay's routing table, not ok, long after its join", res.RestartedState)
	}
	if res.RestartedBack != 0 && (len(res.Checks) == 0 || res.FreshSent == 0) {
		t.Error("no request was sent to the restarted agent")
	}
	// The restarted agent holds no session and nothing in flight: the
	// scheduler, unforced, gives it some of the new sessions.
	if res.FreshSent > 0 && res.RestartedFresh == 0 {
		t.Errorf("none of %d new sessions went to the restarted agent", res.FreshSent)
	}
	for _, q := range res.Checks {
		if q.Cause != "ok" {
			t.Errorf("with the others drained, a request (stream=%v) to the restarted agent ended %s: %s", q.Stream, q.Cause, q.Detail)
		}
	}
}

// The relay's request-path liveness timings for an agent with requests in
// flight (package relay/liveness: ProbeInterval, SilentAfter). Under the load
// every agent has some, so a killed or frozen one is suspect within the
// silence bound of its last echo (an unacknowledged request finds it
// sooner); four probe intervals more are room for processes on a loaded
// machine and the relay's log line that times it. Gossip (the home
// preset) would take about 11 s.
const (
	busyProbeInterval = 250 * time.Millisecond
	busySilentAfter   = 1500 * time.Millisecond
	detectBound       = busySilentAfter + 4*busyProbeInterval
)

// TestSoak runs the soak (soak.go) when COMPUTEFLUX_SOAK is set: one relay,
// four agents, sim engines at real time with 256 batch slots, 1,000
// clients for 10 minutes (COMPUTEFLUX_SOAK_CLIENTS and
// COMPUTEFLUX_SOAK_DURATION change them), one agent restarted midway,
// then a round-robin run. It fails on any broken answer or failed
// request, any panic in any process, heap or goroutines of the relay or of
// the agents together moving more than 10% after the warm-up, the relay's CPU per
// request growing, or a cache hit ratio no better than round-robin's.
//
//	COMPUTEFLUX_SOAK=1 go test -run TestSoak -timeout 40m -v ./cmd/computeflux/internal/chaos/
func TestSoak(t *testing.T) {
	if os.Getenv("COMPUTEFLUX_SOAK") == "" {
		t.Skip("set COMPUTEFLUX_SOAK=1 to run the soak (minutes of load through real processes)")
	}
	if testing.Short() {
		t.Skip("runs the computeflux binary as processes")
	}
	cfg := SoakConfig{Binary: binary, Progress: testWriter{t}}
	if v := os.Getenv("COMPUTEFLUX_SOAK_CLIENTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("COMPUTEFLUX_SOAK_CLIENTS: %v", err)
		}
		cfg.Clients = n
	}
	if v := os.Getenv("COMPUTEFLUX_SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("COMPUTEFLUX_SOAK_DURATION: %v", err)
		}
		cfg.Duration = d
		if d < 4*DefaultSoakWarmup {
			cfg.Warmup = d / 4
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*max(cfg.Duration, DefaultSoakDuration)+5*time.Minute)
	defer cancel()
	rep, err := Soak(ctx, cfg)
	if rep != nil {
		var sb strings.Builder
		rep.Write(&sb)
		for _, l := range strings.Split(strings.TrimSpace(sb.String()), "\n") {
			t.Log(l)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range rep.Failures() {
		t.Error(f)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}
