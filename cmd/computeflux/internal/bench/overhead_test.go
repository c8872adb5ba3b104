package bench

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

func TestProcCPUReadsOwnProcess(t *testing.T) {
	// Burn a little CPU so that the figure is above one clock tick.
	deadline := time.Now().Add(50 * time.Millisecond)
	for x := 0; time.Now().Before(deadline); x++ {
		_ = x * x
	}
	if d := procCPU(os.Getpid()); d <= 0 {
		t.Fatalf("procCPU(self) = %v, want > 0", d)
	}
	if d := procCPU(1 << 30); d != -1 {
		t.Fatalf("procCPU(no such pid) = %v, want -1", d)
	}
}

func TestSummarizeOverheadAgainstDirectPerRound(t *testing.T) {
	ms := time.Millisecond
	direct := &target{name: "direct", rounds: []OverheadRound{
		{SmallP50: 1 * ms, StreamP50: 1 * ms, RPS: 100},
		{SmallP50: 2 * ms, StreamP50: 2 * ms, RPS: 50},
		{SmallP50: 1 * ms, StreamP50: 1 * ms, RPS: 100},
	}}
	path := &target{name: "p", rounds: []OverheadRound{
		{SmallP50: 2 * ms, StreamP50: 4 * ms, RPS: 50, CPUPerRequest: map[string]time.Duration{"relay": 10 * time.Microsecond}},
		{SmallP50: 2500 * time.Microsecond, StreamP50: 3 * ms, RPS: 40, CPUPerRequest: map[string]time.Duration{"relay": 30 * time.Microsecond}},
		{SmallP50: 1500 * time.Microsecond, StreamP50: 2 * ms, RPS: 80, CPUPerRequest: map[string]time.Duration{"relay": 20 * time.Microsecond}},
	}}
	p := summarizeOverhead(path, direct)
	// Added small p50 per round: 1, 0.5, 0.5 ms: median 0.5 ms.
	if p.AddedSmallP50 != 500*time.Microsecond {
		t.Errorf("added small p50 = %v, want 500µs", p.AddedSmallP50)
	}
	// Stream: 3, 1, 1 ms.
	if p.AddedStreamP50 != 1*ms {
		t.Errorf("added stream p50 = %v, want 1ms", p.AddedStreamP50)
	}
	// Ratios 0.5, 0.8, 0.8.
	if p.RPSRatio != 0.8 {
		t.Errorf("ratio = %v, want 0.8", p.RPSRatio)
	}
	if p.CPUPerRequest["relay"] != 20*time.Microsecond {
		t.Errorf("cpu = %v, want 20µs", p.CPUPerRequest["relay"])
	}
}

func TestStubEngineAnswers(t *testing.T) {
	eng, err := startStubEngine()
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	tg := &target{name: "direct", url: eng.url, client: &http.Client{Transport: tr}}
	for _, stream := range []bool{false, true} {
		if _, err := tg.do(context.Background(), stream); err != nil {
			t.Fatalf("stream=%v: %v", stream, err)
		}
	}
	lat, _, errs := tg.load(context.Background(), 4, 40, 0)
	if errs != 0 || len(lat) != 40 {
		t.Fatalf("load: %d answers, %d errors", len(lat), errs)
	}
}

// TestRunOverheadEndToEnd builds the binary and runs a tiny overhead
// benchmark through real processes: Go's reverse proxy, the stock floor's
// two sides, and a relay and an agent.
func TestRunOverheadEndToEnd(t *testing.T) {
	slow.Gate(t, "builds the binary and measures the relay path")
	bin := filepath.Join(t.TempDir(), "computeflux")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/computeflux/computeflux/cmd/computeflux").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	t.Setenv(EnvFRPS, "") // frp is timed by hand, not in tests
	t.Setenv(EnvFRPC, "")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := RunOverhead(ctx, OverheadConfig{Binary: bin, Sequential: 20, Concurrent: 100, Clients: 4, Rounds: 1, LogLevel: "warn"})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Paths) != 4 || rep.Paths[1].Name != "go-reverse-proxy" || rep.Paths[2].Name != "stock-floor" || rep.Paths[3].Name != "computeflux" {
		t.Fatalf("paths %+v", rep.Paths)
	}
	if gp := rep.Paths[1]; gp.Errors != 0 || gp.RPS <= 0 || !gp.NoStream || len(gp.CPUPerRequest) != 1 {
		t.Fatalf("go-reverse-proxy path: %+v", gp)
	}
	// The stock floor serves every request, streams included (timed to
	// their first byte), and its CPU is split by process as the product's.
	fl := rep.Paths[2]
	if fl.Errors != 0 || fl.RPS <= 0 || fl.NoStream || len(fl.Rounds) != 1 || fl.Rounds[0].StreamP50 <= 0 || fl.Rounds[0].SmallP50 <= 0 {
		t.Fatalf("stock-floor path: %+v", fl)
	}
	if _, ok := fl.CPUPerRequest["relay"]; !ok || len(fl.CPUPerRequest) != 2 {
		t.Fatalf("stock-floor CPU per request %v, want relay and agent", fl.CPUPerRequest)
	}
	if _, ok := fl.CPUPerRequest["agent"]; !ok {
		t.Fatalf("stock-floor CPU per request %v, want relay and agent", fl.CPUPerRequest)
	}
	cf := rep.Paths[3]
	if cf.Errors != 0 || cf.RPS <= 0 || len(cf.CPUPerRequest) != 2 {
		t.Fatalf("computeflux path: %+v", cf)
	}
	var b bytes.Buffer
	if err := rep.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	for _, row := range []string{"| computeflux |", "| go-reverse-proxy |", "| stock-floor |"} {
		if !strings.Contains(b.String(), row) {
			t.Fatalf("no row %q in the table:\n%s", row, b.String())
		}
	}
}

// The overhead's per-round percentiles and the bench tables' quantiles
// follow one rule, nearest rank.
func TestPercentileNearestRank(t *testing.T) {
	var v []time.Duration
	for i := 50; i >= 1; i-- {
		v = append(v, time.Duration(i)*time.Millisecond)
	}
	for _, c := range []struct {
		p    float64
		want time.Duration
	}{{.50, 25 * time.Millisecond}, {.95, 48 * time.Millisecond}, {.99, 50 * time.Millisecond}, {0, time.Millisecond}} {
		if got := percentile(slices.Clone(v), c.p); got != c.want {
			t.Errorf("p%v of 1..50 ms = %v, want %v", 100*c.p, got, c.want)
		}
	}
	q := quantiles(v)
	if q.P50 != 25 || q.P95 != 48 || q.P99 != 50 {
		t.Errorf("quantiles %+v, want 25, 48, 50 ms", q)
	}
	if got := median([]int{4, 1, 3, 2}); got != 2 {
		t.Errorf("median of 1..4 = %d, want 2 (the lower middle)", got)
	}
	if got := percentile([]time.Duration(nil), .5); got != 0 {
		t.Errorf("percentile of none = %v", got)
	}
}

func TestWarmUpCountsAThirdPartysFailures(t *testing.T) {
	var n atomic.Int64
	var failAll atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1)%50 == 0 || failAll.Load() { // one request in 50 fails, as frp's http proxy's now and then
			http.Error(w, "dropped", http.StatusBadGateway)
			return
		}
		w.Write([]byte(`{"ok":true}`))
	}))
	defer srv.Close()
	ctx := context.Background()

	ours := &target{name: "computeflux", url: srv.URL, client: srv.Client()}
	if err := ours.warm(ctx, 100); err == nil {
		t.Fatal("warm-up of our own path passed with failed requests")
	}
	frp := &target{name: "frp-http", url: srv.URL, client: srv.Client(), foreign: true}
	if err := frp.warm(ctx, 100); err != nil {
		t.Fatalf("warm-up of a third party's path: %v", err)
	}
	if frp.warmErrs == 0 {
		t.Fatal("the failed warm-up requests were not counted")
	}
	dead := &target{name: "frp-http", url: srv.URL, client: srv.Client(), foreign: true}
	failAll.Store(true)
	if err := dead.warm(ctx, 20); err == nil {
		t.Fatal("warm-up of a third party's path that fails every request passed")
	}
}

// A child inherits no COMPUTEFLUX_* variable: not the bench's own pprof
// address (every child would try to listen on it), nor one that would set a
// flag of the relay or agent measured. One given to it explicitly is kept.
func TestChildEnvDropsInheritedPprof(t *testing.T) {
	got := childEnv([]string{"HOME=/h", EnvPprof + "=127.0.0.1:6060", "COMPUTEFLUX_LOG_LEVEL=debug", "PATH=/bin"}, []string{EnvPprof + "=127.0.0.1:7000"})
	if want := []string{"HOME=/h", "PATH=/bin", EnvPprof + "=127.0.0.1:7000"}; !slices.Equal(got, want) {
		t.Fatalf("childEnv: %q, want %q", got, want)
	}
	if got := childEnv([]string{EnvPprof + "=127.0.0.1:6060", "A=1"}, nil); !slices.Equal(got, []string{"A=1"}) {
		t.Fatalf("childEnv without extra: %q", got)
	}
}
