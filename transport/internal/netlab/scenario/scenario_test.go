package scenario

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/transport/internal/netlab"
)

func TestMain(m *testing.M) {
	MaybeRunRole()
	code := m.Run()
	netlab.CloseAll()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	if code == 0 {
		if err := goleak.Find(
			goleak.IgnoreAnyFunction("os/signal.signal_recv"),
			goleak.IgnoreAnyFunction("github.com/computeflux/computeflux/transport/internal/netlab.watchSignals.func1"),
		); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

// runs is how many fresh labs each pairing gets: CF_NATLAB_RUNS, default 3
// (scripts/natlab.sh asks for 20).
func runs(t *testing.T) int {
	if s := os.Getenv("CF_NATLAB_RUNS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 200 {
			t.Fatalf("CF_NATLAB_RUNS=%q: want 1..200", s)
		}
		return n
	}
	return 3
}

// TestHolePunch proves DCUtR through real NATs: between two
// endpoint-independent NATs the relayed connection becomes direct and new
// streams take it; with a symmetric NAT on either side the punch fails and
// streams still flow over the relayed, limited connection.
func TestHolePunch(t *testing.T) {
	slow.Gate(t, "network namespaces, fresh labs per run")
	if err := netlab.Available(); err != nil {
		t.Skipf("skipping NAT lab: %v", err)
	}
	eim, sym := netlab.EndpointIndependent, netlab.Symmetric
	for _, tc := range []struct {
		a, b       netlab.NATKind
		wantDirect bool
		// parallel is how many labs run at once. The direct pairing runs one
		// at a time so its timings are not skewed; the failing pairings spend
		// their time waiting for punch timeouts and run side by side.
		parallel int
	}{
		{eim, eim, true, 1},
		{eim, sym, false, 4},
		{sym, eim, false, 4},
		{sym, sym, false, 4},
	} {
		name := "holepunch-" + tc.a.String() + "-" + tc.b.String()
		t.Run(name, func(t *testing.T) {
			if tc.parallel > 1 {
				t.Parallel()
			}
			n := runs(t)
			var (
				mu  sync.Mutex // guards sum and ok
				sum = Summary{Name: name}
				ok  = true
			)
			check := func(i int, r HolePunchRun, err error) {
				mu.Lock()
				defer mu.Unlock()
				sum.Add(r, err)
				fail := func(format string, args ...any) {
					ok = false
					t.Errorf("run %d: "+format, append([]any{i}, args...)...)
				}
				switch {
				case err != nil:
					fail("%v", err)
				case r.Direct != tc.wantDirect:
					fail("path %s, want direct=%v (%+v)", r.A2B.Path, tc.wantDirect, r.A2B)
				case !r.A2B.StreamOK:
					fail("echo stream failed over %s", r.A2B.StreamPath)
				case tc.wantDirect && r.A2B.StreamPath != "direct":
					fail("stream took %s after the upgrade", r.A2B.StreamPath)
				case !tc.wantDirect && r.A2B.StreamPath != "relayed":
					fail("stream took %s, want relayed", r.A2B.StreamPath)
				case !tc.wantDirect && r.BStats.Stats.HolePunches == 0:
					fail("no punch was attempted (%+v)", r.BStats.Stats)
				}
				t.Logf("run %d: build=%v direct=%v relayed_ms=%.1f to_direct_ms=%.1f upgrade_ms=%.1f gave_up_ms=%.0f rtt_relayed=%.3fms rtt_direct=%.3fms stream=%s punches=%d/%d",
					i, r.Build.Round(time.Millisecond), r.Direct, r.A2B.RelayedMS, r.A2B.DirectMS, r.A2B.UpgradeMS, r.A2B.GaveUpMS,
					r.A2B.RTTRelayedMS, r.A2B.RTTDirectMS, r.A2B.StreamPath, r.BStats.Stats.HolePunchSuccesses, r.BStats.Stats.HolePunches)
			}
			sem := make(chan struct{}, tc.parallel)
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				sem <- struct{}{}
				wg.Add(1)
				go func() {
					defer func() { <-sem; wg.Done() }()
					ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
					defer cancel()
					r, err := RunHolePunch(ctx, HolePunchConfig{
						A: tc.a, B: tc.b, Prefix: os.Getenv("CF_NATLAB_PREFIX"), Stderr: os.Stderr,
						// The wait ends earlier once three punches failed.
						WaitDirect: 30 * time.Second,
					})
					check(i, r, err)
				}()
			}
			wg.Wait()
			// One line per scenario for scripts/natlab.sh.
			fmt.Println(sum.Line(ok))
		})
	}
}
