package relay

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Memory bounds: the relay's state per session (the scheduler's affinity
// table) is bounded by Scheduler.MaxSessions, and per-request state does not
// outlive the request. Requests go straight to the handler with an
// in-process transport, so the figures are the relay's own.

// instantTransport answers every request at once with a small chat
// completion, without a network.
type instantTransport struct{}

const instantBody = `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}`

func (instantTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
	}
	return &http.Response{
		StatusCode:    200,
		Header:        http.Header{"Content-Type": {"application/json"}},
		Body:          io.NopCloser(strings.NewReader(instantBody)),
		ContentLength: int64(len(instantBody)),
		Request:       req,
	}, nil
}

// memRelay builds a relay with agents agents serving "m1".
func memRelay(t testing.TB, agents, maxSessions int) *Relay {
	t.Helper()
	cfg := Config{NoP2P: true, NoAuth: true, Transport: instantTransport{}, Logger: zerolog.Nop()}
	cfg.Scheduler = scheduler.Config{MaxSessions: maxSessions, Seed: 1}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	for i := 0; i < agents; i++ {
		name := fmt.Sprintf("agent-%04d", i)
		if err := r.Registry().Joined(peer.ID("peer-"+name), transport.JoinInfo{Name: name, Models: []string{"m1"}}); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// sendSessions sends n requests with session keys prefix0..prefix(n-1).
func sendSessions(t testing.TB, r *Relay, prefix string, n int) {
	t.Helper()
	h := r.Handler()
	for i := 0; i < n; i++ {
		req := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(chatBody))
		req.Header.Set("X-Session-ID", prefix+strconv.Itoa(i))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != 200 {
			t.Fatalf("request %d: %d %s", i, rec.Code, rec.Body.String())
		}
	}
}

// heapAfterGC returns the live heap in bytes.
func heapAfterGC() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// rssBytes returns the process's resident set (0 if unknown).
func rssBytes() uint64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func mib(b uint64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// TestSessionFloodIsBounded floods a relay whose session table holds 1,000
// with 20,000 unique session keys: the table never exceeds its bound, and
// the heap after the flood is within a small bound of the heap after the
// table first filled.
func TestSessionFloodIsBounded(t *testing.T) {
	const bound = 1000
	r := memRelay(t, 50, bound)
	sendSessions(t, r, "warm-", bound)
	if n := r.Scheduler().Sessions(); n != bound {
		t.Fatalf("%d sessions after %d unique keys, want %d", n, bound, bound)
	}
	before := heapAfterGC()
	for round := 0; round < 4; round++ {
		sendSessions(t, r, fmt.Sprintf("flood%d-", round), 5000)
		if n := r.Scheduler().Sessions(); n > bound {
			t.Fatalf("session table grew to %d, bound %d", n, bound)
		}
	}
	after := heapAfterGC()
	growth := int64(after) - int64(before)
	t.Logf("flood of 20,000 unique sessions, table bound %d: heap %s before, %s after (%+d bytes)", bound, mib(before), mib(after), growth)
	// Allocator noise, pooled buffers and metric label growth stay well
	// under this; a table or per-request state that leaks would not
	// (20,000 sessions of ~100 bytes each is ~2 MB).
	if growth > 1<<20 {
		t.Errorf("heap grew by %d bytes over the flood", growth)
	}
	for _, s := range r.Scheduler().Snapshot() {
		if s.InFlight != 0 {
			t.Fatalf("agent %s has %d requests in flight after the flood", s.ID, s.InFlight)
		}
	}
}

// TestMemoryAtScale measures a relay with 1,000 agents and 100,000 live
// sessions, then floods of 300,000 more unique keys with the table bounded
// at 100,000. It takes a while (and much longer under the race detector),
// so it runs only with COMPUTEFLUX_MEMORY=1.
func TestMemoryAtScale(t *testing.T) {
	if os.Getenv("COMPUTEFLUX_MEMORY") != "1" {
		t.Skip("set COMPUTEFLUX_MEMORY=1 to measure the relay at 1,000 agents and 100,000 sessions")
	}
	const agents, sessions = 1000, 100_000
	base, baseRSS := heapAfterGC(), rssBytes()
	r := memRelay(t, agents, sessions)
	withAgents := heapAfterGC()
	sendSessions(t, r, "live-", sessions)
	live, liveRSS := heapAfterGC(), rssBytes()
	if n := r.Scheduler().Sessions(); n != sessions {
		t.Fatalf("%d sessions, want %d", n, sessions)
	}
	// Three floods of 100,000 new keys each. The first grows the table's
	// hash map past its evictions once (map slack); after that the heap
	// must stay flat.
	var first, flooded, floodRSS uint64
	for round := 0; round < 3; round++ {
		sendSessions(t, r, fmt.Sprintf("flood%d-", round), sessions)
		if n := r.Scheduler().Sessions(); n > sessions {
			t.Fatalf("session table grew to %d, bound %d", n, sessions)
		}
		flooded, floodRSS = heapAfterGC(), rssBytes()
		if round == 0 {
			first = flooded
		}
		t.Logf("flood round %d: heap %s, RSS %s", round, mib(flooded), mib(floodRSS))
	}
	t.Logf("1,000 agents: heap +%s", mib(withAgents-base))
	t.Logf("100,000 live sessions: heap %s (+%s, %d bytes per session), RSS %s (at start %s)",
		mib(live), mib(live-withAgents), (live-withAgents)/sessions, mib(liveRSS), mib(baseRSS))
	t.Logf("after 300,000 more unique keys (bound 100,000): heap %s, RSS %s", mib(flooded), mib(floodRSS))
	if flooded > first+first/20 || flooded > 2*live {
		t.Errorf("heap grew from %s (live) and %s (first flood) to %s under a bounded flood", mib(live), mib(first), mib(flooded))
	}
}
