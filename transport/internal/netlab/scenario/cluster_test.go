package scenario

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/transport/internal/netlab"
)

// binary returns the computeflux binary to run: CF_NATLAB_BIN, else one built
// into a temporary directory. It skips the test when labs cannot be built
// here or there is no go command to build with.
func binary(t *testing.T) string {
	t.Helper()
	if err := netlab.Available(); err != nil {
		t.Skipf("skipping NAT lab: %v", err)
	}
	if bin := os.Getenv("CF_NATLAB_BIN"); bin != "" {
		return bin
	}
	binOnce.Do(func() {
		goBin, err := exec.LookPath("go")
		if err != nil {
			binErr = fmt.Errorf("no go command to build computeflux with (set CF_NATLAB_BIN): %w", err)
			return
		}
		dir, err := os.MkdirTemp("", "natlab-bin")
		if err != nil {
			binErr = err
			return
		}
		binDir = dir
		binPath = filepath.Join(dir, "computeflux")
		out, err := exec.Command(goBin, "build", "-o", binPath, "github.com/computeflux/computeflux/cmd/computeflux").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("building computeflux: %w: %s", err, out)
		}
	})
	if binErr != nil {
		if strings.Contains(binErr.Error(), "no go command") {
			t.Skip(binErr)
		}
		t.Fatal(binErr)
	}
	return binPath
}

var (
	binOnce         sync.Once
	binPath, binDir string // binDir is removed by TestMain
	binErr          error
)

// newCluster starts a cluster for t, closed when t ends; on failure the
// processes' logs are kept and their directory named.
func newCluster(t *testing.T, homes ...netlab.NATKind) testCluster {
	t.Helper()
	binary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := newClusterCtx(t, ctx, homes...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.close)
	return c
}

// testCluster is a cluster with its test's clean-up.
type testCluster struct {
	*Cluster
	close func()
}

// newClusterCtx starts a cluster; the caller calls close, which keeps the
// logs if the test failed. Call binary(t) first, from the test goroutine.
func newClusterCtx(t *testing.T, ctx context.Context, homes ...netlab.NATKind) (testCluster, error) {
	bin := binPath
	if b := os.Getenv("CF_NATLAB_BIN"); b != "" {
		bin = b
	}
	dir, err := os.MkdirTemp("", "natlab-cluster")
	if err != nil {
		return testCluster{}, err
	}
	c, err := NewCluster(ctx, ClusterConfig{
		Bin: bin, Dir: dir, Homes: homes, Prefix: os.Getenv("CF_NATLAB_PREFIX"),
		Logf: func(string, ...any) {},
		Env:  strings.Fields(os.Getenv("CF_NATLAB_ENV")),
	})
	if err != nil {
		return testCluster{}, fmt.Errorf("cluster (logs in %s): %w", dir, err)
	}
	t.Logf("cluster: %d homes, logs in %s, features %+v", len(homes), dir, c.Features)
	return testCluster{c, func() {
		c.Close()
		if t.Failed() || os.Getenv("CF_NATLAB_KEEP_LOGS") != "" {
			t.Logf("logs kept in %s", dir)
			return
		}
		_ = os.RemoveAll(dir)
	}}, nil
}

// Known product issues, found by these scenarios and reported to the owners
// of relay/ and agent/. They fail the test like any other error. An issue
// that truly cannot be fixed (it lies in a dependency, or in the NAT
// itself) may be accepted by naming it in CF_NATLAB_ACCEPT (comma
// separated; scripts/natlab.sh passes NATLAB_ACCEPT): it is then logged
// with a KNOWN prefix and the scenario line says KNOWN, not PASS. Neither
// issue below is accepted by default: both were seen fixed (README, "Through
// real NATs"), and an entry goes once its scenario has passed for good.
const (
	// knownRelayCrash: after a relay crash, agents behind endpoint-independent
	// NATs noticed only when QUIC's idle timeout fired (30 to 45 s): their
	// keep-alive PINGs are smaller than quic-go's minimum for answering with
	// a stateless reset, and nothing else was sent to the relay.
	knownRelayCrash = "relay-crash-detection"
	// knownDirectGossip: two agents behind endpoint-independent NATs may
	// keep gossiping through the relay: gossip packet streams opened on the
	// circuit before a punch succeeded stayed on it after the upgrade (seen
	// in CI under load). Agents join the gossip only once hole punching is
	// ready (AgentNAT.WaitReady), and a sender whose stream rides a circuit
	// moves to the direct connection once one exists
	// (TestGossipPacketsLeaveTheCircuitForADirectPath).
	knownDirectGossip = "direct-gossip"
)

// knownHit records on t that an accepted known issue showed.
var knownHit sync.Map // testing.TB -> bool

// accepted reports whether CF_NATLAB_ACCEPT names issue.
func accepted(issue string) bool {
	for _, a := range strings.Split(os.Getenv("CF_NATLAB_ACCEPT"), ",") {
		if strings.TrimSpace(a) == issue {
			return true
		}
	}
	return false
}

// known fails t, unless issue is accepted (CF_NATLAB_ACCEPT): then it logs
// the issue and marks t.
func known(t testing.TB, issue, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if !accepted(issue) {
		t.Errorf("%s [known issue %s; CF_NATLAB_ACCEPT=%s accepts it]", msg, issue, issue)
		return
	}
	knownHit.Store(t, true)
	t.Logf("KNOWN (%s, accepted by CF_NATLAB_ACCEPT): %s", issue, msg)
}

// TestKnownIssuesFailUnlessAccepted: a known issue fails its test like any
// other error; CF_NATLAB_ACCEPT naming it makes it a logged KNOWN instead.
func TestKnownIssuesFailUnlessAccepted(t *testing.T) {
	for _, c := range []struct {
		accept string
		fails  bool
	}{
		{"", true},
		{knownDirectGossip, true},
		{knownDirectGossip + ", " + knownRelayCrash, false},
		{knownRelayCrash, false},
	} {
		t.Setenv("CF_NATLAB_ACCEPT", c.accept)
		rec := &recordingTB{}
		known(rec, knownRelayCrash, "agents served again %v after a relay crash", 41*time.Second)
		_, marked := knownHit.Load(rec)
		if failed := len(rec.errors) > 0; failed != c.fails || marked == c.fails {
			t.Errorf("CF_NATLAB_ACCEPT=%q: failed %v (%q), marked KNOWN %v; want failed %v", c.accept, failed, rec.errors, marked, c.fails)
		}
	}
}

// recordingTB records what known reports.
type recordingTB struct {
	testing.TB
	errors, logs []string
}

func (r *recordingTB) Helper() {}
func (r *recordingTB) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}
func (r *recordingTB) Logf(format string, args ...any) {
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
}

// report prints the scenario's one line for scripts/natlab.sh.
func report(t *testing.T, name string, figures ...string) {
	verdict := "PASS"
	if _, ok := knownHit.Load(t); ok {
		verdict = "KNOWN"
	}
	if t.Failed() {
		verdict = "FAIL"
	}
	fmt.Println(strings.Join(append([]string{"SCENARIO", name, verdict}, figures...), " "))
}

func msStr(d time.Duration) string { return fmt.Sprintf("%.0f", float64(d)/float64(time.Millisecond)) }

// TestCluster runs the computeflux binary in a lab with three homes (two
// endpoint-independent NATs, one symmetric) and checks, in order: completions
// through the relay reach every home and stick to a session, a partitioned
// home leaves the rotation and comes back after the link heals, and agents
// serve again after the relay restarts.
func TestCluster(t *testing.T) {
	slow.Gate(t, "network namespaces and real processes")
	eim, sym := netlab.EndpointIndependent, netlab.Symmetric
	c := newCluster(t, eim, eim, sym).Cluster
	steps := []struct {
		name string
		run  func(*testing.T, *Cluster)
	}{
		{"completions-sticky", testCompletions},
		{"gossip-path-cluster", testGossipPaths},
		{"partition", testPartition},
		{"relay-restart", func(t *testing.T, c *Cluster) { testRelayRestart(t, c, false) }},
		{"relay-crash", func(t *testing.T, c *Cluster) { testRelayRestart(t, c, true) }},
	}
	for _, s := range steps {
		if !t.Run(s.name, func(t *testing.T) { s.run(t, c) }) && s.name == "completions-sticky" {
			// Later steps need the data path.
			break
		}
	}
}

// gossipWindow is how long a settled path is watched: three rounds of
// probes (every 2 s, each member in turn) in a cluster of four members.
const gossipWindow = 12 * time.Second

// gossipSettle bounds the wait for a path to settle after both agents
// joined the gossip: every member has probed every other by then, and a
// failing punch (three attempts of 3 s) has given up.
const gossipSettle = 15 * time.Second

// testGossipPaths: in a cluster with homes eim, eim, symmetric, the two
// endpoint-independent homes gossip directly, and each of them gossips with
// the symmetric home through the relay.
func testGossipPaths(t *testing.T, c *Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	pairs := []struct {
		a, b   int
		direct bool
	}{{0, 1, true}, {0, 2, false}, {1, 2, false}}
	figures := make([]string, len(pairs))
	var wg sync.WaitGroup
	for i, pair := range pairs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := c.ObserveGossipPath(ctx, pair.a, pair.b, 3, gossipSettle, gossipWindow)
			if err != nil {
				t.Errorf("h%d-h%d: %v", pair.a, pair.b, err)
				figures[i] = fmt.Sprintf("h%d-h%d=error", pair.a, pair.b)
				return
			}
			if err := r.Lossless(); err != nil {
				t.Errorf("h%d-h%d (%s-%s): %v", pair.a, pair.b, c.Lab.Homes[pair.a].Kind, c.Lab.Homes[pair.b].Kind, err)
			}
			if err := r.Check(pair.direct); err != nil {
				if pair.direct {
					known(t, knownDirectGossip, "h%d-h%d (%s-%s): %v", pair.a, pair.b, c.Lab.Homes[pair.a].Kind, c.Lab.Homes[pair.b].Kind, err)
				} else {
					t.Errorf("h%d-h%d (%s-%s): %v", pair.a, pair.b, c.Lab.Homes[pair.a].Kind, c.Lab.Homes[pair.b].Kind, err)
				}
			}
			t.Logf("h%d-h%d: %+v", pair.a, pair.b, r)
			figures[i] = fmt.Sprintf("h%d-h%d=%s,upgrade_ms=%.0f,punches=%d/%d,direct_data=%d/%d,probe_failures=%d",
				pair.a, pair.b, r.Path(), r.UpgradeMS, r.PunchesOK, r.Punches, r.DataAB, r.DataBA, r.ProbeFailures)
		}()
	}
	wg.Wait()
	report(t, "gossip-path-cluster", figures...)
}

// testCompletions: every home serves its own model, streamed and not, and
// every session sticks to one agent across its requests.
func testCompletions(t *testing.T, c *Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const sessions, perSession = 4, 8
	var lat []float64
	homesOK := 0
	for i := range c.Lab.Homes {
		ok := true
		for _, stream := range []bool{false, true} {
			r, err := c.Complete(ctx, HomeModel(i), "", stream)
			switch {
			case err != nil:
				t.Errorf("home %d model, stream=%v: %v", i, stream, err)
				ok = false
			case r.Agent != AgentName(i):
				t.Errorf("home %d model served by %q", i, r.Agent)
				ok = false
			case r.Content == "":
				t.Errorf("home %d model, stream=%v: empty answer", i, stream)
				ok = false
			case stream && r.Chunks == 0:
				t.Errorf("home %d: stream without content chunks", i)
				ok = false
			}
			lat = append(lat, float64(r.Latency.Microseconds())/1000)
		}
		if ok {
			homesOK++
		}
	}
	sticky, hits, requests := 0, 0, 0
	spread := map[string]int{}
	for s := 0; s < sessions; s++ {
		session := fmt.Sprintf("netlab-session-%d", s)
		first := ""
		same := true
		for n := 0; n < perSession; n++ {
			r, err := c.Complete(ctx, SharedModel, session, n%2 == 1)
			requests++
			if err != nil {
				t.Errorf("session %d request %d: %v", s, n, err)
				same = false
				continue
			}
			lat = append(lat, float64(r.Latency.Microseconds())/1000)
			if r.Affinity == "hit" {
				hits++
			}
			if first == "" {
				first = r.Agent
				spread[first]++
			} else if r.Agent != first {
				t.Errorf("session %d request %d served by %s, first by %s (affinity %s)", s, n, r.Agent, first, r.Affinity)
				same = false
			}
		}
		if same {
			sticky++
		}
	}
	keys := make([]string, 0, len(spread))
	for k, v := range spread {
		keys = append(keys, fmt.Sprintf("%s:%d", k, v))
	}
	sort.Strings(keys)
	report(t, "completions-sticky",
		fmt.Sprintf("homes_ok=%d/%d", homesOK, len(c.Lab.Homes)),
		fmt.Sprintf("sticky_sessions=%d/%d", sticky, sessions),
		fmt.Sprintf("affinity_hits=%d/%d", hits, requests-sessions),
		"sessions_per_agent="+strings.Join(keys, ","),
		fmt.Sprintf("latency_ms_p50=%.1f", Median(lat)))
}

// sample is one request of the background load during a partition.
type sample struct {
	at      time.Time
	latency time.Duration
	agent   string
	err     error
}

// load sends a request on the shared model every interval, rotating over
// sessions (some mapped to the home about to be cut), until stop is closed,
// and returns every outcome.
func load(c *Cluster, sessions []string, interval time.Duration, stop <-chan struct{}) []sample {
	if len(sessions) == 0 {
		sessions = []string{"netlab-load"}
	}
	var (
		mu  sync.Mutex // guards out
		out []sample
		wg  sync.WaitGroup
	)
	t := time.NewTicker(interval)
	defer t.Stop()
	for n := 0; ; n++ {
		select {
		case <-stop:
			wg.Wait()
			return out
		case <-t.C:
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			at := time.Now()
			r, err := c.Complete(ctx, SharedModel, sessions[n%len(sessions)], false)
			mu.Lock()
			out = append(out, sample{at: at, latency: time.Since(at), agent: r.Agent, err: err})
			mu.Unlock()
		}()
	}
}

// hasModel reports whether the relay lists model m (it lists the models of
// routable agents only).
func hasModel(ctx context.Context, c *Cluster, m string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ms, err := c.Models(ctx)
	if err != nil {
		return false, nil // the relay may be busy or restarting: keep polling
	}
	return slices.Contains(ms, m), nil
}

// serves reports whether a request for home i's own model is served by it.
func serves(ctx context.Context, c *Cluster, i int) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	r, err := c.Complete(ctx, HomeModel(i), "", false)
	return err == nil && r.Agent == AgentName(i)
}

// testPartition cuts home 1's WAN link, waits for the relay to drop its agent
// (its own model leaves the relay's list), checks that requests keep being
// served by the others, heals the link and waits for the same agent process
// to serve again.
func testPartition(t *testing.T, c *Cluster) {
	const home = 1
	agent := c.Agents[home]
	pid := agent.PID()
	// Sessions for the load: two stuck to the home about to be cut (when
	// the scheduler puts any there), the others elsewhere.
	var onHome, others []string
	{
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		for k := 0; k < 40 && (len(onHome) < 2 || len(others) < 4); k++ {
			key := fmt.Sprintf("netlab-load-%d", k)
			r, err := c.Complete(ctx, SharedModel, key, false)
			switch {
			case err != nil:
			case r.Agent == AgentName(home) && len(onHome) < 2:
				onHome = append(onHome, key)
			case r.Agent != AgentName(home) && len(others) < 4:
				others = append(others, key)
			}
		}
		cancel()
	}
	stop := make(chan struct{})
	samples := make(chan []sample, 1)
	go func() { samples <- load(c, append(slices.Clone(onHome), others...), 250*time.Millisecond, stop) }()
	stopped := false
	defer func() {
		if !stopped {
			close(stop)
			<-samples
		}
	}()

	relayLog := c.Relay.Log.Len()
	tCut := time.Now()
	if err := c.Lab.Cut(home); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	var removal time.Duration
	if err := Poll(ctx, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		has, err := hasModel(ctx, c, HomeModel(home))
		return !has, err
	}); err != nil {
		t.Errorf("relay still routes to the cut home after %v: %v", time.Since(tCut).Round(time.Millisecond), err)
	} else {
		removal = time.Since(tCut)
		// The home preset's bound: a probe round and its timeout to notice
		// (2 s + 1 s), then at most the longest suspicion (4 x 8 s), plus
		// the relay's poll.
		if bound := 40 * time.Second; c.Features.Gossip && removal > bound {
			t.Errorf("relay stopped routing to the cut home after %v, over the gossip bound %v", removal.Round(time.Millisecond), bound)
		}
	}
	// What told the relay: its log lines about the agent since the cut.
	var why []string
	for _, l := range c.Relay.Log.Lines(relayLog, func(l Line) bool { return l.Str("agent") == AgentName(home) }) {
		what := strings.ReplaceAll(l.Message(), " ", "_")
		if g := l.Str("gossip"); g != "" {
			what = "gossip_" + g
		}
		why = append(why, fmt.Sprintf("%s@%s", what, msStr(l.At.Sub(tCut))))
	}
	// Requests after the removal go to the others and succeed.
	tRemoved := time.Now()
	after := 0
	if err := Poll(ctx, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		r, err := c.Complete(ctx, SharedModel, "netlab-after-cut", false)
		if err != nil {
			return false, fmt.Errorf("request during the partition: %w", err)
		}
		if r.Agent == AgentName(home) {
			return false, fmt.Errorf("request during the partition served by the cut home")
		}
		after++
		return after >= 10, nil
	}); err != nil {
		t.Error(err)
	}

	tHeal := time.Now()
	if err := c.Lab.Heal(home); err != nil {
		t.Fatal(err)
	}
	var back time.Duration
	if err := Poll(ctx, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		return serves(ctx, c, home), nil
	}); err != nil {
		t.Errorf("healed home not back in rotation after %v: %v", time.Since(tHeal).Round(time.Millisecond), err)
	} else {
		back = time.Since(tHeal)
	}
	if !agent.Running() || agent.PID() != pid {
		t.Errorf("the agent of the cut home restarted or exited")
	}
	close(stop)
	stopped = true
	all := <-samples

	// The background load: every request issued once the relay had dropped
	// the home must succeed; before that, report how many failed or waited.
	var okN, failBefore, failAfter int
	var maxLat time.Duration
	for _, s := range all {
		maxLat = max(maxLat, s.latency)
		switch {
		case s.err == nil:
			okN++
		case s.at.Before(tRemoved):
			failBefore++
		default:
			failAfter++
			t.Errorf("load request at +%v failed after the removal: %v", s.at.Sub(tCut).Round(time.Millisecond), s.err)
		}
	}
	t.Logf("partition: removal %v, back %v, relay saw %v, load ok %d/%d", removal, back, why, okN, len(all))
	report(t, "partition",
		"removal_ms="+msStr(removal), "return_ms="+msStr(back),
		fmt.Sprintf("load_sessions_on_cut_home=%d", len(onHome)),
		fmt.Sprintf("load_ok=%d/%d", okN, len(all)),
		fmt.Sprintf("load_failed_before_removal=%d", failBefore),
		fmt.Sprintf("load_failed_after_removal=%d", failAfter),
		"load_max_latency_ms="+msStr(maxLat),
		"relay_saw="+strings.Join(append(why, "-")[:max(1, len(why))], ","))
}

// testRelayRestart stops the relay (cleanly, or with SIGKILL as in a
// crash), starts it again with the same identity, and measures how long
// until every agent has joined the new relay and until each serves its own
// model through it.
func testRelayRestart(t *testing.T, c *Cluster, crash bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	marks := make([]int, len(c.Agents))
	for i, a := range c.Agents {
		marks[i] = a.Log.Len()
	}
	tStop := time.Now()
	name := "relay-restart"
	if crash {
		name = "relay-crash"
		c.KillRelay()
	} else {
		c.StopRelay()
	}
	tDown := time.Now()
	if err := c.StartRelay(ctx); err != nil {
		t.Fatal(err)
	}
	tUp := time.Now()
	var rejoin time.Duration
	for i, a := range c.Agents {
		l, err := a.Log.WaitFrom(ctx, marks[i], Msg("joined relay"))
		if err != nil {
			t.Fatalf("agent %d did not rejoin: %v\n%s", i, err, a.Log.Tail(10))
		}
		rejoin = max(rejoin, l.At.Sub(tUp))
	}
	var serve time.Duration
	for i := range c.Agents {
		if err := Poll(ctx, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
			return serves(ctx, c, i), nil
		}); err != nil {
			t.Fatalf("agent %d does not serve after the restart: %v", i, err)
		}
		serve = max(serve, time.Since(tUp))
	}
	// The issue's bound (see knownRelayCrash for crashes).
	within := serve <= 30*time.Second
	switch {
	case within:
	case crash:
		known(t, knownRelayCrash, "agents served again %v after a relay crash, want within 30s", serve.Round(time.Millisecond))
	default:
		t.Errorf("agents served again %v after the relay came back, want within 30s", serve.Round(time.Millisecond))
	}
	report(t, name,
		"stop_ms="+msStr(tDown.Sub(tStop)), "start_ms="+msStr(tUp.Sub(tDown)),
		"rejoin_ms="+msStr(rejoin), "serve_ms="+msStr(serve),
		"total_ms="+msStr(tUp.Sub(tStop)+serve),
		fmt.Sprintf("within_30s=%v", within))
}

// TestGossipPath runs CF_NATLAB_RUNS fresh clusters of two homes per NAT
// pairing (default 1; scripts/natlab.sh asks for 20) and checks which path
// the agents' gossip takes: direct between endpoint-independent NATs,
// through the relay's circuit with a symmetric NAT on one side.
func TestGossipPath(t *testing.T) {
	slow.Gate(t, "network namespaces and real processes")
	binary(t)
	if os.Getenv("CF_NATLAB_RUNS") == "" {
		t.Skip("TestCluster covers each pairing once; set CF_NATLAB_RUNS for repeated runs (scripts/natlab.sh)")
	}
	n := runs(t)
	eim, sym := netlab.EndpointIndependent, netlab.Symmetric
	for _, tc := range []struct {
		a, b       netlab.NATKind
		wantDirect bool
		// parallel is how many clusters run at once: one for the direct
		// pairing, whose timings matter; the relayed one mostly waits.
		parallel int
	}{{eim, eim, true, 1}, {eim, sym, false, 4}} {
		name := "gossip-path-" + tc.a.String() + "-" + tc.b.String()
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var (
				mu                    sync.Mutex // guards the following
				ok                    = true
				direct, pathOK        int
				upgrade, joinToDirect []float64
				punches, punchesOK    int
				dataAB, dataBA, errs  int
				failures              int
			)
			record := func(i int, r GossipPath, err error) {
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					ok = false
					errs++
					t.Errorf("run %d: %v", i, err)
					return
				}
				if err := r.Lossless(); err != nil {
					ok = false
					t.Errorf("run %d: %v (%+v)", i, err, r)
				}
				if err := r.Check(tc.wantDirect); err != nil {
					if tc.wantDirect {
						known(t, knownDirectGossip, "run %d: %v (%+v)", i, err, r)
					} else {
						ok = false
						t.Errorf("run %d: %v (%+v)", i, err, r)
					}
				} else {
					pathOK++
				}
				t.Logf("run %d: %+v", i, r)
				if r.Direct {
					direct++
					upgrade = append(upgrade, r.UpgradeMS)
					joinToDirect = append(joinToDirect, float64(r.JoinToDirect.Microseconds())/1000)
				}
				punches += r.Punches
				punchesOK += r.PunchesOK
				if r.DataAB > 0 {
					dataAB++
				}
				if r.DataBA > 0 {
					dataBA++
				}
				failures += r.ProbeFailures
			}
			sem := make(chan struct{}, tc.parallel)
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				sem <- struct{}{}
				wg.Add(1)
				go func() {
					defer func() { <-sem; wg.Done() }()
					ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
					defer cancel()
					c, err := newClusterCtx(t, ctx, tc.a, tc.b)
					if err != nil {
						record(i, GossipPath{}, err)
						return
					}
					r, err := c.ObserveGossipPath(ctx, 0, 1, 3, gossipSettle, gossipWindow)
					record(i, r, err)
					c.close()
				}()
			}
			wg.Wait()
			verdict := "FAIL"
			if _, hit := knownHit.Load(t); ok && !t.Failed() {
				verdict = "PASS"
				if hit {
					verdict = "KNOWN"
				}
			}
			fmt.Println(strings.Join([]string{"SCENARIO", name, verdict,
				fmt.Sprintf("runs=%d", n),
				fmt.Sprintf("path_ok=%d/%d", pathOK, n),
				fmt.Sprintf("direct=%d/%d", direct, n),
				fmt.Sprintf("upgrade_ms_p50=%.1f", Median(upgrade)),
				fmt.Sprintf("upgrade_ms_range=%s", minMax(upgrade)),
				fmt.Sprintf("gossip_join_to_direct_ms_p50=%.1f", Median(joinToDirect)),
				fmt.Sprintf("punches_ok=%d/%d", punchesOK, punches),
				fmt.Sprintf("runs_with_direct_gossip_ab=%d/%d", dataAB, n),
				fmt.Sprintf("runs_with_direct_gossip_ba=%d/%d", dataBA, n),
				fmt.Sprintf("probe_failures=%d", failures),
				fmt.Sprintf("errors=%d", errs),
			}, " "))
		})
	}
}

func minMax(xs []float64) string {
	if len(xs) == 0 {
		return "-"
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	return fmt.Sprintf("%.0f..%.0f", s[0], s[len(s)-1])
}
