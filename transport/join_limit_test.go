package transport

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
)

// TestJoinWrongProofsBackOff sends 1,000 wrong proofs from one peer over
// real QUIC, spread over about 5 s (one every 5 ms) so that the steady rate
// shows: after the free handful they are answered at no more than a few per
// second, and another peer from the same address joins meanwhile.
func TestJoinWrongProofsBackOff(t *testing.T) {
	relay, attacker, honest := newTestHost(t), newTestHost(t), newTestHost(t)
	rec := &recorder{}
	js := serveJoin(t, relay, rec)
	connect(t, attacker, relay)
	connect(t, honest, relay)

	const attempts = 1000
	var answered, refused int
	var answeredAt []time.Duration
	start := time.Now()
	for i := range attempts {
		_, err := Join(joinCtx(t), attacker, relay.ID(), []byte("wrong token"), JoinInfo{Name: "mallory"})
		var rej *RejectedError
		if !errors.As(err, &rej) {
			t.Fatalf("attempt %d: %v, want a rejection", i, err)
		}
		switch {
		case strings.Contains(rej.Reason, "invalid join proof"):
			answered++
			answeredAt = append(answeredAt, time.Since(start))
		case strings.Contains(rej.Reason, "too many failed joins"):
			refused++
		default:
			t.Fatalf("attempt %d: reason %q", i, rej.Reason)
		}
		time.Sleep(5 * time.Millisecond)
		if i == attempts/2 {
			// Someone else, from the same address, mid-attack.
			m, err := Join(joinCtx(t), honest, relay.ID(), testToken, JoinInfo{Name: "gpu1"})
			if err != nil {
				t.Fatalf("an honest peer could not join during the attack: %v", err)
			}
			defer m.Close()
		}
	}
	elapsed := time.Since(start)
	after := answered - joinFreeFailures
	var span time.Duration
	if answered > joinFreeFailures {
		span = answeredAt[len(answeredAt)-1] - answeredAt[joinFreeFailures-1]
	}
	rate := float64(after) / elapsed.Seconds()
	t.Logf("%d wrong proofs in %v: %d answered (first %d free, then %d over %v: %.2f/s over the attack), %d refused in back-off; relay counted %d failed, %d refused",
		attempts, elapsed.Round(time.Millisecond), answered, joinFreeFailures, after, span.Round(time.Millisecond), rate, refused, js.Failed(), js.Refused())
	if answered < joinFreeFailures {
		t.Errorf("only %d proofs checked, want the first %d", answered, joinFreeFailures)
	}
	if rate > 3 {
		t.Errorf("%.2f wrong proofs per second answered after the first %d, want at most 3", rate, joinFreeFailures)
	}
	if !rec.has("joined gpu1") {
		t.Errorf("the honest peer's join was not seen: %v", rec.list())
	}
	// Counted before each answer is written: exact.
	if js.Failed() != uint64(answered) || js.Refused() != uint64(refused) {
		t.Errorf("relay counted %d failed and %d refused, the attacker saw %d and %d", js.Failed(), js.Refused(), answered, refused)
	}
}

func TestJoinLimiter(t *testing.T) {
	l := newJoinLimiter()
	now := time.Unix(1000, 0)
	ip := netip.MustParseAddr("198.18.0.7")
	p := peer.ID("p")
	for i := range joinFreeFailures {
		if ok, _ := l.allow(p, ip, now); !ok {
			t.Fatalf("failure %d refused within the free ones", i)
		}
		l.failed(p, ip, now)
	}
	if ok, _ := l.allow(p, ip, now); !ok {
		t.Fatal("refused after exactly the free failures")
	}
	l.failed(p, ip, now)
	ok, wait := l.allow(p, ip, now)
	if ok || wait != joinBackoffBase {
		t.Fatalf("after one failure beyond the free ones: ok %v wait %v", ok, wait)
	}
	if ok, _ := l.allow(p, ip, now.Add(joinBackoffBase)); !ok {
		t.Fatal("still refused after the back-off")
	}
	for range 10 {
		now = now.Add(time.Minute)
		l.failed(p, ip, now)
	}
	if _, wait := l.allow(p, ip, now); wait != joinBackoffMax {
		t.Errorf("back-off %v, want the cap %v", wait, joinBackoffMax)
	}
	// The address: one peer counts its free failures only; fresh peer IDs
	// from one address are refused after joinAddrFreeFailures.
	other := peer.ID("q")
	if ok, _ := l.allow(other, ip, now); !ok {
		t.Fatal("another peer from the address is refused after one peer's failures")
	}
	for i := range joinAddrFreeFailures {
		l.failed(peer.ID(rune('a'+i)), ip, now)
	}
	if ok, _ := l.allow(other, ip, now); ok {
		t.Error("a fresh peer from an address with many failing peers is not refused")
	}
	if ok, _ := l.allow(other, netip.MustParseAddr("198.18.0.8"), now); !ok {
		t.Error("a peer from another address is refused")
	}
	l.succeeded(other, ip)
	if ok, _ := l.allow(other, ip, now); !ok {
		t.Error("refused after a success from the address")
	}
	// Stale history is forgotten.
	later := now.Add(joinForgetAfter + time.Second)
	l.failed(p, ip, later)
	if ok, _ := l.allow(p, ip, later); !ok {
		t.Error("a failure after a long quiet counts beyond the free ones")
	}
}

func TestJoinBackoffCapped(t *testing.T) {
	for k, want := range map[int]time.Duration{1: 500 * time.Millisecond, 2: time.Second, 3: 2 * time.Second, 4: 4 * time.Second, 5: 5 * time.Second, 100: 5 * time.Second} {
		if got := joinBackoff(k); got != want {
			t.Errorf("joinBackoff(%d) = %v, want %v", k, got, want)
		}
	}
}

func TestJoinLimiterSweepKeepsRecentNews(t *testing.T) {
	now := time.Unix(1e6, 0)
	m := map[int]*joinFailures{}
	const max = 64
	for i := 0; i < max; i++ {
		m[i] = &joinFailures{n: 1, last: now.Add(time.Duration(i) * time.Second)}
	}
	m[0].last = now.Add(-2 * joinForgetAfter) // stale
	sweepTo(m, now.Add(time.Minute), max)
	if len(m) != max-max/16 {
		t.Fatalf("%d entries left, want %d", len(m), max-max/16)
	}
	// The stale entry and the oldest fresh ones went; the newest stayed.
	for i := 0; i < max/16; i++ {
		if _, ok := m[i]; ok {
			t.Fatalf("entry %d (among the oldest) kept", i)
		}
	}
	for i := max / 16; i < max; i++ {
		if _, ok := m[i]; !ok {
			t.Fatalf("entry %d (recent) dropped", i)
		}
	}
	// Below the bound nothing is walked or dropped.
	sweepTo(m, now.Add(time.Hour), max)
	if len(m) != max-max/16 {
		t.Fatalf("sweep below the bound dropped entries: %d left", len(m))
	}
}

// BenchmarkJoinLimiterFlood times a failed handshake from a new peer ID
// while the table is full of fresh entries (a peer cycling through IDs).
func BenchmarkJoinLimiterFlood(b *testing.B) {
	l := newJoinLimiter()
	now := time.Unix(1e6, 0)
	ids := make([]peer.ID, joinMaxTracked+b.N)
	for i := range ids {
		ids[i] = peer.ID(fmt.Sprintf("peer-%d", i))
	}
	for i := 0; i < joinMaxTracked; i++ {
		l.failed(ids[i], netip.Addr{}, now)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		l.failed(ids[joinMaxTracked+i], netip.Addr{}, now.Add(time.Duration(i)*time.Microsecond))
	}
}
