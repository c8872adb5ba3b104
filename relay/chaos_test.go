package relay_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/liveness"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/scheduler"
)

// Chaos under load: a steady load of concurrent sessions, streamed and not,
// runs through a relay and three agents (package agent) over QUIC while
// agents are killed (every packet of their host dropped: no goodbye) and
// restarted one at a time, and the relay restarts once.
//
// What must hold:
//   - A non-streamed request never fails while two agents are alive: the
//     relay retries an attempt that died with its agent elsewhere, and a
//     non-streamed answer is checked whole before the client sees it, so
//     even one cut mid-body is retried. The only excusable failures are
//     requests whose lifetime overlaps the relay's own restart (its HTTP
//     server is down: nobody could have served them), widened by a short
//     grace for clients reconnecting.
//   - A stream ends by itself within its deadline: complete ([DONE]) or,
//     when its agent died after the first event, with an OpenAI-style error
//     event. Hangs fail the test; so do streams cut without an error event
//     outside the restart window.
//   - Every agent, each killed and restarted once, is back: routed as
//     normal, and it answers a request sent while the others are drained
//     (the admin action), streamed and not.
//   - Afterwards no goroutine is left (goleak) and no file descriptor
//     (/proc/self/fd, with a small tolerance for descriptors the runtime and
//     the resolver open lazily on first use and keep).

// chaosDetectBound bounds the time from a kill to the relay routing around
// the agent: under load an agent has requests in flight, so its liveness
// probe runs every busy probe interval and a silent agent is suspect after
// the busy silence bound (an unacknowledged request finds it sooner); two
// probe intervals more are room for a probe in flight and a loaded machine.
// Gossip alone would take seconds more.
// An agent that happens to have nothing in flight when it is killed (the
// sessions went elsewhere) is probed at the idle pace: its bound is
// chaosIdleDetectBound.
const (
	chaosDetectBound     = liveness.SilentAfter + 2*liveness.ProbeInterval
	chaosIdleDetectBound = liveness.IdleSilentAfter + 2*liveness.IdleProbeInterval
)

// inFlight returns the requests the scheduler has in flight to endpoint id.
func inFlight(s *scheduler.Scheduler, id string) int {
	for _, st := range s.Snapshot() {
		if st.ID == id {
			return st.InFlight
		}
	}
	return 0
}

const (
	chaosWorkers     = 6                // concurrent sessions: half streamed
	chaosReqTimeout  = 30 * time.Second // a request still running then is a hang
	chaosGrace       = time.Second      // after the relay restart, for clients reconnecting
	chaosFDTolerance = 8
)

// chaosResult is one request's fate.
type chaosResult struct {
	stream     bool
	start, end time.Time
	cause      string // "ok", "error_event", "status_NNN", "conn", "truncated", "hang"
	agent      string // the agent that answered (X-ComputeFlux-Agent), if any
}

// routedNormally reports whether the scheduler routes to endpoint id as normal:
// known, neither suspect nor draining.
func routedNormally(s *scheduler.Scheduler, id string) bool {
	for _, st := range s.Snapshot() {
		if st.ID == id {
			return !st.Health.Suspect && !st.Health.Draining
		}
	}
	return false
}

func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	return len(ents)
}

// chaosRequest sends one request and classifies how it ended.
func chaosRequest(c *http.Client, url, key, session string, stream bool) chaosResult {
	res := chaosResult{stream: stream, start: time.Now()}
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"session %s says hello"}],"max_tokens":8,"stream":%v}`,
		simengine.DefaultModel, session, stream)
	ctx, cancel := context.WithTimeout(context.Background(), chaosReqTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := c.Do(req)
	if err != nil {
		res.cause = "conn"
		if errors.Is(err, context.DeadlineExceeded) {
			res.cause = "hang"
		}
		res.end = time.Now()
		return res
	}
	defer resp.Body.Close()
	res.agent = resp.Header.Get("X-ComputeFlux-Agent")
	if resp.StatusCode != 200 {
		_, _ = io.Copy(io.Discard, resp.Body)
		res.cause = fmt.Sprintf("status_%d", resp.StatusCode)
		res.end = time.Now()
		return res
	}
	if !stream {
		b, err := io.ReadAll(resp.Body)
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			res.cause = "hang"
		case err != nil || !json.Valid(b):
			res.cause = "truncated"
		default:
			res.cause = "ok"
		}
		res.end = time.Now()
		return res
	}
	res.cause = "truncated"
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		d, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if d == "[DONE]" {
			res.cause = "ok"
			break
		}
		if strings.HasPrefix(d, `{"error":`) {
			res.cause = "error_event"
			break
		}
	}
	if errors.Is(sc.Err(), context.DeadlineExceeded) {
		res.cause = "hang"
	}
	res.end = time.Now()
	return res
}

func TestChaosUnderLoad(t *testing.T) {
	slow.Gate(t, "faults under load for its duration")
	fdBefore := countFDs(t)
	ignore := goleak.IgnoreCurrent()

	ctx := context.Background()
	cl, err := relaytest.Start(ctx, relaytest.Config{
		Engines: 3,
		Engine:  simengine.Config{TimeScale: 4},
	})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			cl.Close()
		}
	}()
	tr := &http.Transport{MaxIdleConnsPerHost: chaosWorkers}
	client := &http.Client{Transport: tr}

	var (
		mu      sync.Mutex
		results []chaosResult
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < chaosWorkers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				// Each worker keeps a few conversations going.
				session := fmt.Sprintf("w%d-s%d", w, i%4)
				r := chaosRequest(client, cl.URL(), cl.APIKey(), session, w%2 == 1)
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
				if r.cause != "ok" && r.cause != "error_event" {
					// Clients back off a little after a failure (the
					// OpenAI SDKs wait longer still).
					select {
					case <-stop:
					case <-time.After(20 * time.Millisecond):
					}
				}
			}
		}()
	}
	// pause lets the load run for d; it waits for no condition.
	pause := func(d time.Duration) { <-time.After(d) }
	pause(time.Second) // warm up

	stormStart := time.Now()
	var restartFrom, restartTo time.Time
	var detect []time.Duration // kill to the relay routing around the agent
	var busy []bool            // the agent had requests in flight when killed
	for round := 0; round < 3; round++ {
		i := round % 3
		name := cl.Engine(i).Name
		busy = append(busy, inFlight(cl.Relay().Scheduler(), name) > 0)
		killedAt := time.Now()
		if err := cl.KillAgent(i); err != nil {
			t.Errorf("kill agent %d: %v", i, err)
		}
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
			if !routedNormally(cl.Relay().Scheduler(), name) {
				detect = append(detect, time.Since(killedAt))
				break
			}
			pause(5 * time.Millisecond)
		}
		pause(700 * time.Millisecond)
		if err := cl.RestartAgent(ctx, i); err != nil {
			t.Fatalf("restart agent %d: %v", i, err)
		}
		pause(500 * time.Millisecond)
		if round == 1 {
			restartFrom = time.Now()
			if err := cl.RestartRelay(ctx); err != nil {
				t.Fatalf("restart relay: %v", err)
			}
			restartTo = time.Now()
			pause(500 * time.Millisecond)
		}
	}
	stormEnd := time.Now()
	close(stop)
	wg.Wait()

	// Tally.
	excused := func(r chaosResult) bool {
		return r.end.After(restartFrom) && r.start.Before(restartTo.Add(chaosGrace))
	}
	byCause := map[string]int{}
	var lat []time.Duration
	var sent, okN, streamsErr int
	var cutMax time.Duration // longest stream that ended with an error event
	for _, r := range results {
		sent++
		key := r.cause
		if r.stream {
			key = "stream/" + key
		}
		if r.cause != "ok" && excused(r) {
			key += " (relay restart)"
		}
		byCause[key]++
		if r.cause == "ok" {
			okN++
		}
		if r.stream && r.cause == "error_event" {
			streamsErr++
			cutMax = max(cutMax, r.end.Sub(r.start))
		}
		if !r.stream && r.cause == "ok" && !r.start.Before(stormStart) && !r.end.After(stormEnd) {
			lat = append(lat, r.end.Sub(r.start))
		}
		switch {
		case r.cause == "hang":
			t.Errorf("a request hung for %v (stream=%v)", r.end.Sub(r.start), r.stream)
		case r.cause == "ok" || excused(r):
		case !r.stream:
			t.Errorf("non-streamed request failed (%s) while two agents were alive, at %v into the storm",
				r.cause, r.start.Sub(stormStart).Round(time.Millisecond))
		case r.cause != "error_event":
			t.Errorf("stream ended without an error event (%s) at %v into the storm",
				r.cause, r.start.Sub(stormStart).Round(time.Millisecond))
		}
	}
	slices.Sort(lat)
	pct := func(p float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return lat[min(len(lat)-1, int(p*float64(len(lat))))]
	}
	causes := make([]string, 0, len(byCause))
	for k, v := range byCause {
		causes = append(causes, fmt.Sprintf("%s=%d", k, v))
	}
	slices.Sort(causes)
	t.Logf("chaos: sent %d, succeeded %d, streams ended by an error event %d; by cause: %s",
		sent, okN, streamsErr, strings.Join(causes, " "))
	t.Logf("chaos: non-streamed latency during the storm (%d requests): p50 %v p99 %v max %v",
		len(lat), pct(0.5).Round(time.Millisecond), pct(0.99).Round(time.Millisecond), pct(1).Round(time.Millisecond))
	t.Logf("chaos: relay routed around a killed agent after %v (busy at the kill: %v; bound %v, idle %v); relay restart took %v; longest stream ended by an error event: %v",
		detect, busy, chaosDetectBound, chaosIdleDetectBound, restartTo.Sub(restartFrom).Round(time.Millisecond), cutMax.Round(time.Millisecond))
	if len(detect) != 3 {
		t.Errorf("the relay noticed %d of 3 kills within 20 s", len(detect))
	}
	busyKills := 0
	for i, d := range detect {
		bound, pace := chaosDetectBound, "busy"
		if i < len(busy) && busy[i] {
			busyKills++
		} else {
			bound, pace = chaosIdleDetectBound, "idle"
		}
		if d > bound {
			t.Errorf("kill %d (%s): the relay routed around the killed agent after %v, want within %v (silence bound + 2 probe intervals)",
				i, pace, d.Round(time.Millisecond), bound)
		}
	}
	if busyKills == 0 {
		t.Error("no agent had requests in flight when it was killed: the busy detection went unchecked")
	}
	if okN == 0 {
		t.Fatal("no request succeeded")
	}
	checkRestartedAgentsServe(t, cl, client)

	// Leaks: everything stops once the cluster and the client are closed.
	closed = true
	if err := cl.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
	tr.CloseIdleConnections()
	// QUIC connections close on timers: give them a generous while.
	for deadline := time.Now().Add(20 * time.Second); ; {
		err := goleak.Find(ignore)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("goroutines left after the storm: %v", err)
			break
		}
		pause(50 * time.Millisecond)
	}
	var fdAfter int
	for deadline := time.Now().Add(20 * time.Second); ; {
		fdAfter = countFDs(t)
		if fdAfter <= fdBefore+chaosFDTolerance || time.Now().After(deadline) {
			break
		}
		pause(20 * time.Millisecond)
	}
	t.Logf("chaos: descriptors before %d, after %d (tolerance %d)", fdBefore, fdAfter, chaosFDTolerance)
	if fdAfter > fdBefore+chaosFDTolerance {
		t.Errorf("descriptors grew from %d to %d", fdBefore, fdAfter)
	}
}

// checkRestartedAgentsServe checks, after the storm, that every agent of
// cl is back in the relay's routing and answers: each in turn alone
// undrained, a plain request and a stream must reach it and succeed.
func checkRestartedAgentsServe(t *testing.T, cl *relaytest.Cluster, client *http.Client) {
	t.Helper()
	r := cl.Relay()
	engines := cl.Engines()
	for _, e := range engines {
		// Bounded, not timed: a loaded machine may take a while.
		deadline := time.Now().Add(20 * time.Second)
		for !routedNormally(r.Scheduler(), e.Name) && time.Now().Before(deadline) {
			<-time.After(10 * time.Millisecond)
		}
		if !routedNormally(r.Scheduler(), e.Name) {
			t.Errorf("agent %s is not routed normally 20 s after the storm", e.Name)
		}
	}
	setOthers := func(name, action string) {
		for _, o := range engines {
			if o.Name != name {
				if err := r.SetAdmin(o.Name, action, 0); err != nil {
					t.Fatalf("%s %s: %v", action, o.Name, err)
				}
			}
		}
	}
	for i, e := range engines {
		setOthers(e.Name, "drain")
		for _, stream := range []bool{false, true} {
			res := chaosRequest(client, cl.URL(), cl.APIKey(), fmt.Sprintf("after-%d", i), stream)
			if res.cause != "ok" || res.agent != e.Name {
				t.Errorf("with the others drained, a request (stream=%v) for agent %s ended %s, served by %q", stream, e.Name, res.cause, res.agent)
			}
		}
		setOthers(e.Name, "undrain")
	}
}

// TestDisconnectCancelsEngineOverQUIC: through the real path (client,
// relay, QUIC, agent, simulated engine at real-time speed, a decode step
// every 10 ms), a client that leaves a stream has the engine's request
// cancelled, not finished, within a few decode steps: the engine's
// generated tokens are counted from the client's leaving to the cancel.
// A relay or agent that let the request run would have it generate its
// 2,000 tokens (20 s). The time it takes is BenchmarkDisconnectCancelOverQUIC's.
func TestDisconnectCancelsEngineOverQUIC(t *testing.T) {
	// Decode steps after the client left: typically one (the cancel takes
	// about 1.5 ms), the median at most two, none more than ten (a
	// race-instrumented, loaded machine).
	const medianSteps, maxSteps = 2, 10
	ctx := context.Background()
	cl, tr := oneEngineCluster(t)
	var steps []uint64
	for i := range 5 {
		n, err := disconnectOnce(ctx, cl, tr, i)
		if err != nil {
			t.Fatal(err)
		}
		steps = append(steps, n)
	}
	t.Logf("tokens generated between the client leaving and the engine's cancel: %v (5 runs)", steps)
	sorted := slices.Clone(steps)
	slices.Sort(sorted)
	if sorted[len(sorted)/2] > medianSteps || sorted[len(sorted)-1] > maxSteps {
		t.Errorf("the engine generated %v tokens after the client left, want a median of at most %d and none over %d (decode steps)", steps, medianSteps, maxSteps)
	}
}

// BenchmarkDisconnectCancelOverQUIC measures, through the real path, the
// time from a client leaving a stream to the engine cancelling its
// request, reported as ns/cancel (ns/op is a whole request's).
func BenchmarkDisconnectCancelOverQUIC(b *testing.B) {
	ctx := context.Background()
	cl, tr := oneEngineCluster(b)
	var total time.Duration
	i := 0
	for b.Loop() {
		d, err := disconnect(ctx, cl, tr, i, func() {})
		if err != nil {
			b.Fatal(err)
		}
		total += d
		i++
	}
	b.ReportMetric(float64(total.Nanoseconds())/float64(i), "ns/cancel")
}

// oneEngineCluster starts a cluster of one engine at real-time speed and a
// client transport, both closed when tb ends.
func oneEngineCluster(tb testing.TB) (*relaytest.Cluster, *http.Transport) {
	tb.Helper()
	cl, err := relaytest.Start(context.Background(), relaytest.Config{Engines: 1})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cl.Close() })
	tr := &http.Transport{}
	tb.Cleanup(tr.CloseIdleConnections)
	return cl, tr
}

// disconnectOnce starts a long stream, leaves it after its first event and
// waits for the engine to end the request; it returns the tokens the
// engine generated from the leaving on. The request must end cancelled.
func disconnectOnce(ctx context.Context, cl *relaytest.Cluster, tr *http.Transport, i int) (uint64, error) {
	eng := cl.Engine(0).Server
	var before simengine.Stats
	_, err := disconnect(ctx, cl, tr, i, func() { before = eng.Stats() })
	if err != nil {
		return 0, err
	}
	after := eng.Stats()
	if after.Finished != before.Finished {
		return 0, fmt.Errorf("request %d finished instead of being cancelled", i)
	}
	return after.GenerationTokens - before.GenerationTokens, nil
}

// disconnect starts a 2,000-token stream through cl, reads its first
// event, calls atLeave, leaves, and waits (up to 30 s) for the engine to
// end the request; it returns the time from the leaving to that end.
func disconnect(ctx context.Context, cl *relaytest.Cluster, tr *http.Transport, i int, atLeave func()) (time.Duration, error) {
	eng := cl.Engine(0).Server
	before := eng.Stats()
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"long story %d"}],"max_tokens":2000,"stream":true}`, simengine.DefaultModel, i)
	req, _ := http.NewRequestWithContext(rctx, "POST", cl.URL()+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+cl.APIKey())
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return 0, err
	}
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		resp.Body.Close()
		return 0, fmt.Errorf("first event %q: %v", line, err)
	}
	atLeave()
	left := time.Now()
	cancel()
	resp.Body.Close()
	for deadline := left.Add(30 * time.Second); ; {
		s := eng.Stats()
		if s.Cancelled != before.Cancelled || s.Finished != before.Finished {
			return time.Since(left), nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("the engine's request %d neither cancelled nor finished 30 s after the client left", i)
		}
		<-time.After(time.Millisecond)
	}
}
