package relay_test

import (
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/ports"

	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/transport"
)

// TestBudgetAcrossRelays gives one client a daily token budget behind two
// relays that name each other (--peer-relay) and spreads its requests over
// both: together they stop it once the budget is used, overshooting by at
// most what the fleet served in about one exchange interval. Without the
// exchange each relay would let it use the whole budget.
func TestBudgetAcrossRelays(t *testing.T) {
	t.Parallel() // paced load on its own relays and agents
	dir := t.TempDir()
	const (
		key    = "sk-budget-across-relays-0123456789"
		budget = 20000
	)
	cf, err := relay.ParseClientsFile([]byte(fmt.Sprintf("clients:\n  - name: alice\n    keys: [%s]\n    budget: {tokens_per_day: %d}\n", key, budget)), nil)
	if err != nil {
		t.Fatal(err)
	}
	type node struct {
		listen, identity string
		id               peer.ID
		led              *ledger.Ledger
		r                *relaytest.Relay
	}
	nodes := make([]*node, 2)
	for i := range nodes {
		n := &node{listen: ports.QUIC(t), identity: filepath.Join(dir, fmt.Sprintf("relay-%d.key", i))}
		k, err := transport.LoadOrCreateIdentity(n.identity)
		if err != nil {
			t.Fatal(err)
		}
		if n.id, err = peer.IDFromPrivateKey(k); err != nil {
			t.Fatal(err)
		}
		if n.led, err = ledger.Open(ledger.Config{Path: filepath.Join(dir, fmt.Sprintf("ledger-%d.db", i))}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.led.Close() })
		nodes[i] = n
	}
	var addrs []string
	for i, n := range nodes {
		other := nodes[1-i]
		oa, err := ma.NewMultiaddr(other.listen)
		if err != nil {
			t.Fatal(err)
		}
		n.r = relaytest.ServeRelay(t, relay.Config{
			P2PListen:    []string{n.listen},
			IdentityFile: n.identity,
			Token:        []byte(gToken),
			Clients:      cf,
			Ledger:       n.led,
			Logger:       gTestLogger(t, fmt.Sprintf("relay-%d", i)),
			Gossip:       relay.GossipConfig{Tune: gFastTune, LeaveTimeout: time.Second},
			Peers:        relay.PeersConfig{Relays: []peer.AddrInfo{{ID: other.id, Addrs: []ma.Multiaddr{oa}}}},
		})
		addrs = append(addrs, n.listen+"/p2p/"+n.id.String())
	}
	for i := range 2 {
		name := fmt.Sprintf("agent-%d", i)
		relaytest.RunAgent(t, gAgentConfig(t, name, relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: name, VLLMMetrics: true}), filepath.Join(dir, name+".key"), gFastTune, "", addrs...))
	}
	relaytest.Within(t, 60*time.Second, "the relays to share with each other and route to both agents", func() bool {
		for _, n := range nodes {
			if len(n.r.Relay.PeerRelays()) != 1 || !routable(n.r, "agent-0") || !routable(n.r, "agent-1") {
				return false
			}
		}
		return true
	})

	used := func() int64 {
		now := time.Now()
		return nodes[0].led.Spent("alice", now).DayTokens + nodes[1].led.Spent("alice", now).DayTokens
	}
	// What the fleet served, sampled, to find how much one exchange
	// interval carried when the budget ran out.
	type sample struct {
		at   time.Time
		used int64
	}
	var (
		samplesMu sync.Mutex
		samples   []sample
	)
	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tk := time.NewTicker(20 * time.Millisecond)
		defer tk.Stop()
		for {
			samplesMu.Lock()
			samples = append(samples, sample{time.Now(), used()})
			samplesMu.Unlock()
			select {
			case <-stopSampling:
				return
			case <-tk.C:
			}
		}
	}()

	// Four clients of alice, each request to either relay, paced, until
	// both relays have refused each client (or a bound in count and time).
	hc := &http.Client{Timeout: 20 * time.Second}
	defer hc.CloseIdleConnections()
	var served, refused, other atomic.Int64
	var errMu sync.Mutex
	var errs []string
	deadline := time.Now().Add(90 * time.Second)
	var wg sync.WaitGroup
	for c := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			refusedBy := [2]bool{}
			for n := 0; n < 5000 && time.Now().Before(deadline) && !(refusedBy[0] && refusedBy[1]); n++ {
				via := (c + n) % 2
				req, _ := http.NewRequest(http.MethodPost, nodes[via].r.URL+"/v1/chat/completions",
					strings.NewReader(`{"model":"m1","messages":[{"role":"user","content":"count my tokens, please"}]}`))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Authorization", "Bearer "+key)
				resp, err := hc.Do(req)
				if err != nil {
					errMu.Lock()
					errs = append(errs, err.Error())
					errMu.Unlock()
					other.Add(1)
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case resp.StatusCode == http.StatusOK:
					served.Add(1)
				case resp.StatusCode == http.StatusTooManyRequests && strings.Contains(string(b), `"insufficient_quota"`):
					refused.Add(1)
					refusedBy[via] = true
				default:
					other.Add(1)
					errMu.Lock()
					errs = append(errs, fmt.Sprintf("%d %s", resp.StatusCode, b))
					errMu.Unlock()
				}
				time.Sleep(40 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	// The last answers' usage is recorded as they finish.
	time.Sleep(100 * time.Millisecond)
	close(stopSampling)
	<-sampled
	total := used()

	// The interval's traffic when the budget ran out: what the fleet
	// served in the exchange interval before the total first reached it.
	interval := relay.DefaultPeerSpentInterval
	var crossed, before sample
	for i, s := range samples {
		if s.used >= budget {
			crossed = s
			for j := i; j >= 0; j-- {
				before = samples[j]
				if crossed.at.Sub(samples[j].at) >= interval {
					break
				}
			}
			break
		}
	}
	window := crossed.used - before.used
	perRequest := total / max(served.Load(), 1)
	overshoot := total - budget
	t.Logf("alice's budget %d tokens behind 2 relays: served %d requests, %d tokens in all (%d a request), overshoot %d; the fleet served %d tokens in the %v before the budget ran out; refused %d, other answers %d",
		budget, served.Load(), total, perRequest, overshoot, window, crossed.at.Sub(before.at).Round(time.Millisecond), refused.Load(), other.Load())
	if other.Load() > 0 {
		t.Errorf("%d answers neither served nor refused for the budget: %v", other.Load(), errs[:min(len(errs), 5)])
	}
	if crossed.at.IsZero() {
		t.Fatalf("the fleet served %d tokens, never reaching the budget of %d", total, budget)
	}
	if refused.Load() == 0 {
		t.Fatal("no request was refused for the budget")
	}
	// One interval's traffic, plus the requests in flight on the four
	// clients when the relays saw the budget used.
	if limit := window + 4*perRequest; overshoot > limit {
		t.Errorf("overshoot %d tokens, want at most %d (one exchange interval's %d tokens and 4 requests in flight): the relays did not share alice's use", overshoot, limit, window)
	}
}
