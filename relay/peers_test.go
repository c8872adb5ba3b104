package relay_test

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/ports"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// These tests run several real relays and real agents (package agent),
// every agent joined to every relay, over QUIC on loopback. The relays are
// started independently, with the same secret and nothing else in common:
// they find each other through the agents' join info.

// startPeerRelay starts a sticky relay with gossip on listen (a fixed
// port and identity, so that it can be restarted as itself).
func startPeerRelay(t testing.TB, listen, identity, who string, edits ...func(*relay.Config)) *relaytest.Relay {
	t.Helper()
	cfg := relay.Config{
		P2PListen:    []string{listen},
		IdentityFile: identity,
		Token:        []byte(gToken),
		NoAuth:       true,
		Logger:       gTestLogger(t, who),
		Gossip:       relay.GossipConfig{Tune: gFastTune, LeaveTimeout: time.Second},
	}
	for _, edit := range edits {
		edit(&cfg)
	}
	return relaytest.ServeRelay(t, cfg)
}

type multiCluster struct {
	relays  []*relaytest.Relay
	listen  []string
	ids     []string
	addrs   []string
	agents  []*relaytest.Agent
	engines []*relaytest.FakeEngine
}

// startMulti starts nr relays and na agents joined to all of them, and
// waits until every relay shares sessions with every other and routes to
// every agent.
func startMulti(t *testing.T, nr, na int) *multiCluster {
	t.Helper()
	dir := t.TempDir()
	mc := &multiCluster{}
	for i := range nr {
		mc.listen = append(mc.listen, ports.QUIC(t))
		mc.ids = append(mc.ids, filepath.Join(dir, fmt.Sprintf("relay-%d.key", i)))
		r := startPeerRelay(t, mc.listen[i], mc.ids[i], fmt.Sprintf("relay-%d", i))
		mc.relays = append(mc.relays, r)
		mc.addrs = append(mc.addrs, mc.listen[i]+"/p2p/"+r.Relay.Host().ID().String())
	}
	for i := range na {
		name := fmt.Sprintf("agent-%d", i)
		e := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: name, VLLMMetrics: true})
		mc.engines = append(mc.engines, e)
		mc.agents = append(mc.agents, relaytest.RunAgent(t, gAgentConfig(t, name, e, filepath.Join(dir, name+".key"), gFastTune, "", mc.addrs...)))
	}
	relaytest.Within(t, 60*time.Second, "relays to find each other through the agents", func() bool {
		for _, r := range mc.relays {
			if len(r.Relay.PeerRelays()) != nr-1 {
				return false
			}
		}
		return true
	})
	for i, r := range mc.relays {
		relaytest.Within(t, 60*time.Second, fmt.Sprintf("relay %d to route to every agent", i), func() bool {
			n := 0
			for _, ga := range mc.agents {
				if routable(r, ga.Name) {
					n++
				}
			}
			return n == na
		})
	}
	return mc
}

// chat sends one non-streamed chat turn of session to r and returns the
// agent that served it and the affinity header.
func chat(hc *http.Client, r *relaytest.Relay, session string) (agentName, affinity string, err error) {
	req, _ := http.NewRequest(http.MethodPost, r.URL+"/v1/chat/completions",
		strings.NewReader(`{"model":"m1","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := hc.Do(req)
	if err != nil {
		return "", "", err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("status %d", resp.StatusCode)
	}
	return resp.Header.Get(relay.HeaderAgent), resp.Header.Get(relay.HeaderAffinity), nil
}

// bindSessions sends the first turn of n sessions named prefix-i to r and
// returns the agent each is bound to.
func bindSessions(t *testing.T, hc *http.Client, r *relaytest.Relay, prefix string, n int) map[string]string {
	t.Helper()
	bound := make(map[string]string, n)
	for i := range n {
		s := fmt.Sprintf("%s-%d", prefix, i)
		a, _, err := chat(hc, r, s)
		if err != nil {
			t.Fatal(err)
		}
		bound[s] = a
	}
	return bound
}

func boundTo(r *relaytest.Relay, session string) string {
	id, _, _ := r.Relay.Scheduler().Binding(session)
	return id
}

// TestPeerRelaysFollowUpOnAnotherRelay binds sessions on one relay and
// sends their follow-ups to another: they reach the same agent.
func TestPeerRelaysFollowUpOnAnotherRelay(t *testing.T) {
	t.Parallel() // waits on relays meeting, in its own relays and agents
	mc := startMulti(t, 3, 3)
	hc := &http.Client{Timeout: 30 * time.Second}
	defer hc.CloseIdleConnections()
	const sessions = 150
	var lags []time.Duration
	hits, sameAgent := 0, 0
	served := map[string]int{}
	for i := range sessions {
		s := fmt.Sprintf("conv-%d", i)
		first, second := mc.relays[i%3], mc.relays[(i+1)%3]
		a1, _, err := chat(hc, first, s)
		if err != nil {
			t.Fatal(err)
		}
		served[a1]++
		// How long until the other relay knows the binding (not asserted:
		// timing belongs to benchmarks; logged for the record).
		start := time.Now()
		for boundTo(second, s) != a1 && time.Since(start) < 2*time.Second {
			time.Sleep(time.Millisecond)
		}
		lags = append(lags, time.Since(start))
		a2, aff, err := chat(hc, second, s)
		if err != nil {
			t.Fatal(err)
		}
		if a2 == a1 {
			sameAgent++
		}
		if aff == "hit" {
			hits++
		}
	}
	slices.Sort(lags)
	t.Logf("follow-up on another relay: same agent %d/%d, affinity hit %d/%d; binding known at the other relay after p50 %v, p99 %v, max %v; first turns served %v",
		sameAgent, sessions, hits, sessions, lags[len(lags)/2], lags[len(lags)*99/100], lags[len(lags)-1], served)
	if sameAgent*100 < sessions*99 || hits*100 < sessions*99 {
		t.Errorf("same agent %d/%d, hits %d/%d: want >= 99%%", sameAgent, sessions, hits, sessions)
	}
	if len(served) < 2 {
		t.Errorf("first turns all on one agent (%v): the test would prove nothing", served)
	}
	for i, r := range mc.relays {
		st := r.Relay.PeerStats()
		t.Logf("relay %d: %+v", i, st)
		if st.BindingsReceived == 0 {
			t.Errorf("relay %d received no bindings", i)
		}
	}
}

// TestPeerRelaysConflictingBindings sends the first turn of each session
// to two relays at once: afterwards both relays send the session to one
// agent, the same on both.
func TestPeerRelaysConflictingBindings(t *testing.T) {
	t.Parallel() // waits on relays meeting, in its own relays and agents
	mc := startMulti(t, 2, 3)
	hc := &http.Client{Timeout: 30 * time.Second}
	defer hc.CloseIdleConnections()
	const sessions = 60
	conflicts := 0
	for i := range sessions {
		s := fmt.Sprintf("race-%d", i)
		var wg sync.WaitGroup
		got := make([]string, 2)
		for j := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a, _, err := chat(hc, mc.relays[j], s)
				if err != nil {
					t.Error(err)
				}
				got[j] = a
			}()
		}
		wg.Wait()
		if got[0] != got[1] {
			conflicts++
		}
		relaytest.Within(t, 5*time.Second, "both relays to agree on "+s, func() bool {
			b0 := boundTo(mc.relays[0], s)
			return b0 != "" && b0 == boundTo(mc.relays[1], s)
		})
		agree := map[string]bool{}
		for j := range 4 {
			a, _, err := chat(hc, mc.relays[j%2], s)
			if err != nil {
				t.Fatal(err)
			}
			agree[a] = true
		}
		if len(agree) != 1 {
			t.Errorf("%s: follow-ups went to %v", s, agree)
		}
	}
	t.Logf("%d of %d sessions were bound to different agents by the two relays at first", conflicts, sessions)
}

// TestPeerRelayRestartRebuildsBindings restarts one relay as itself: once
// the agents are back, it has the bindings from its peer and routes the
// sessions to the agents that hold them.
func TestPeerRelayRestartRebuildsBindings(t *testing.T) {
	t.Parallel() // waits on relays meeting, in its own relays and agents
	mc := startMulti(t, 2, 3)
	hc := &http.Client{Timeout: 30 * time.Second}
	defer hc.CloseIdleConnections()
	const sessions = 60
	want := bindSessions(t, hc, mc.relays[0], "keep", sessions)
	relaytest.Within(t, 5*time.Second, "relay 1 to hold every binding", func() bool {
		for s, a := range want {
			if boundTo(mc.relays[1], s) != a {
				return false
			}
		}
		return true
	})
	mc.relays[1].Stop()
	start := time.Now()
	r1 := startPeerRelay(t, mc.listen[1], mc.ids[1], "relay-1-again")
	mc.relays[1] = r1
	relaytest.Within(t, 60*time.Second, "the restarted relay to route to every agent", func() bool {
		for _, ga := range mc.agents {
			if !routable(r1, ga.Name) {
				return false
			}
		}
		return true
	})
	agentsBack := time.Since(start)
	relaytest.Within(t, 10*time.Second, "the restarted relay to learn the bindings", func() bool {
		return r1.Relay.PeerStats().Sessions >= sessions
	})
	rebuilt := time.Since(start)
	hits := 0
	var wrong []string
	for s, a := range want {
		got, aff, err := chat(hc, r1, s)
		if err != nil {
			t.Fatal(err)
		}
		if got == a && aff == "hit" {
			hits++
		} else {
			wrong = append(wrong, s)
		}
	}
	sort.Strings(wrong)
	t.Logf("restart: agents routable %v after the start, bindings rebuilt after %v; %d/%d sessions hit their agent", agentsBack, rebuilt, hits, sessions)
	if hits != sessions {
		t.Errorf("%d/%d sessions hit after the restart; missed %v", hits, sessions, wrong)
	}
}

// TestPeerRelaySeedAndSecret seeds a relay with --peer-relay addresses:
// the peer with the same secret shares sessions, the one with another
// secret is refused on both sides.
func TestPeerRelaySeedAndSecret(t *testing.T) {
	a := startPeerRelay(t, "/ip4/127.0.0.1/udp/0/quic-v1", "", "relay-a")
	other := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Token:     []byte("another secret"),
		NoAuth:    true,
		Logger:    gTestLogger(t, "relay-other"),
		Gossip:    relay.GossipConfig{Tune: gFastTune, LeaveTimeout: time.Second},
	})
	b := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Token:     []byte(gToken),
		NoAuth:    true,
		Logger:    gTestLogger(t, "relay-b"),
		Gossip:    relay.GossipConfig{Tune: gFastTune, LeaveTimeout: time.Second},
		Peers:     relay.PeersConfig{Relays: []peer.AddrInfo{a.Info(), other.Info()}},
	})
	relaytest.Within(t, 30*time.Second, "the seeded peer relays to share sessions", func() bool {
		return len(a.Relay.PeerRelays()) == 1 && len(b.Relay.PeerRelays()) == 1
	})
	relaytest.Within(t, 30*time.Second, "the relay with another secret to refuse", func() bool {
		return other.Relay.PeerStats().Refused > 0
	})
	if got := b.Relay.PeerRelays(); got[0] != a.Relay.Host().ID() {
		t.Errorf("b shares with %v", got)
	}
	if n := len(other.Relay.PeerRelays()); n != 0 {
		t.Errorf("the relay with another secret shares with %d relays", n)
	}
	// The seeded pair gossips as one cluster.
	relaytest.Within(t, 30*time.Second, "a and b in one gossip cluster", func() bool {
		return a.Relay.Gossip().Known(b.Relay.Host().ID()) && b.Relay.Gossip().Known(a.Relay.Host().ID())
	})
}

// TestPeerRelayRestartWaitsForBindings restarts one relay while its peer
// is slow to send its table: follow-ups that reach the restarted relay
// before the table wait for it instead of going to an agent that holds
// nothing of the conversation.
func TestPeerRelayRestartWaitsForBindings(t *testing.T) {
	slow.Gate(t, "restarts a relay and waits on its peers")
	t.Parallel() // waits on relays meeting, in its own relays and agents
	mc := startMulti(t, 2, 3)
	hc := &http.Client{Timeout: 30 * time.Second}
	defer hc.CloseIdleConnections()
	const sessions = 30
	want := bindSessions(t, hc, mc.relays[0], "wait", sessions)
	// The table is held back well within the wait, so that the follow-ups
	// surely arrive before it however slowly the agents rejoin (the
	// relay's own wait is 2 s; here 8 s, for a loaded machine).
	const delay = 4 * time.Second
	relay.DelayPeerSnapshots(mc.relays[0].Relay, delay)
	mc.relays[1].Stop()
	r1 := startPeerRelay(t, mc.listen[1], mc.ids[1], "relay-1-again", func(c *relay.Config) { relay.WithPeerSyncWait(c, 2*delay) })
	mc.relays[1] = r1
	// Unkeyed requests do not wait: the first one served means an agent
	// has rejoined, and the table is still on its way.
	relaytest.Within(t, 60*time.Second, "the restarted relay to serve", func() bool {
		_, _, err := chat(hc, r1, "")
		return err == nil
	})
	// Every agent back, so that a follow-up placed once the table is in
	// finds its bound agent: one still rejoining would send it elsewhere.
	relaytest.Within(t, 60*time.Second, "every agent to rejoin the restarted relay", func() bool {
		return len(r1.Relay.Registry().Agents()) == 3
	})
	if n := r1.Relay.PeerStats().Sessions; n != 0 {
		t.Fatalf("the restarted relay holds %d bindings before its peer sent its table: the test does not reach the wait", n)
	}
	start := time.Now()
	var (
		mu    sync.Mutex
		wrong []string
		wg    sync.WaitGroup
	)
	for s, a := range want {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, _, err := chat(hc, r1, s)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				wrong = append(wrong, s+": "+err.Error())
			} else if got != a {
				wrong = append(wrong, s+" on "+got+", bound to "+a)
			}
		}()
	}
	wg.Wait()
	sort.Strings(wrong)
	t.Logf("%d follow-ups sent to the restarted relay before its peer's table (held back %v) answered after %v; %d went elsewhere than their agent",
		sessions, delay, time.Since(start), len(wrong))
	if len(wrong) > 0 {
		t.Errorf("%d of %d follow-ups did not reach their agent: %v", len(wrong), sessions, wrong)
	}
}

// TestPeerRelayResyncsRestartedPeer silences a peer relay the way a killed
// process or a lost machine does (no QUIC close reaches anyone) and
// starts it again under the same identity: the surviving relay, whose
// stream to the old one still looks alive, sends it every binding at once
// instead of after the QUIC idle timeout (30 s).
func TestPeerRelayResyncsRestartedPeer(t *testing.T) {
	t.Parallel() // waits on relays meeting, in its own relays
	dir := t.TempDir()
	idB := filepath.Join(dir, "b.key")
	quiet := relay.GossipConfig{Disabled: true} // the sessions protocol alone
	b := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, IdentityFile: idB,
		Token: []byte(gToken), NoAuth: true, Gossip: quiet, Logger: gTestLogger(t, "relay-b"),
	})
	var bUDP *net.UDPAddr
	for _, a := range b.Relay.Host().Addrs() {
		ip, err1 := a.ValueForProtocol(ma.P_IP4)
		port, err2 := a.ValueForProtocol(ma.P_UDP)
		if err1 == nil && err2 == nil {
			bUDP, _ = net.ResolveUDPAddr("udp4", net.JoinHostPort(ip, port))
		}
	}
	if bUDP == nil {
		t.Fatalf("relay b listens on no UDP address: %v", b.Relay.Host().Addrs())
	}
	cut := newUDPCut(t, bUDP)
	viaCut, err := ma.NewMultiaddr(fmt.Sprintf("/ip4/127.0.0.1/udp/%d/quic-v1", cut.port()))
	if err != nil {
		t.Fatal(err)
	}
	a := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Token:     []byte(gToken), NoAuth: true, Gossip: quiet, Logger: gTestLogger(t, "relay-a"),
		Peers: relay.PeersConfig{Relays: []peer.AddrInfo{{ID: b.Relay.Host().ID(), Addrs: []ma.Multiaddr{viaCut}}}},
	})
	relaytest.Within(t, 30*time.Second, "the relays to share sessions through the cut", func() bool {
		return len(a.Relay.PeerRelays()) == 1 && len(b.Relay.PeerRelays()) == 1
	})
	const sessions = 50
	for i := range sessions {
		relay.ShareBinding(a.Relay, fmt.Sprintf("s-%d", i), "agent-x")
	}
	relaytest.Within(t, 10*time.Second, "relay b to hold relay a's bindings", func() bool {
		return b.Relay.PeerStats().Sessions == sessions
	})
	cut.cut.Store(true)
	b.Stop() // its goodbye is dropped: to relay a, relay b went silent
	start := time.Now()
	b2 := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, IdentityFile: idB,
		Token: []byte(gToken), NoAuth: true, Gossip: quiet, Logger: gTestLogger(t, "relay-b-again"),
		Peers: relay.PeersConfig{Relays: []peer.AddrInfo{a.Info()}},
	})
	relaytest.Within(t, 10*time.Second, "the restarted relay b to get relay a's bindings (without a resync: after the QUIC idle timeout, 30 s)", func() bool {
		return b2.Relay.PeerStats().Sessions == sessions
	})
	t.Logf("the restarted relay held relay a's %d bindings %v after its start; relay a resynced %d times",
		sessions, time.Since(start).Round(time.Millisecond), a.Relay.PeerStats().Resyncs)
	if n := a.Relay.PeerStats().Resyncs; n == 0 {
		t.Error("relay a counted no resync")
	}
}
