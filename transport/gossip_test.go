package transport

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"
)

// gossipNode is one member of a test cluster.
type gossipNode struct {
	h    host.Host
	g    *Gossip
	meta atomic.Pointer[NodeMeta]
	rec  gossipRecorder
}

func (n *gossipNode) id() peer.ID { return n.h.ID() }

func (n *gossipNode) setMeta(m NodeMeta) {
	n.meta.Store(&m)
	n.g.UpdateMeta()
}

// stop shuts the member down without leaving and closes its host, as a crash
// or a lost link would look to the others.
func (n *gossipNode) stop() {
	n.h.Close()
	n.g.Shutdown()
}

type gossipRecorder struct {
	mu     sync.Mutex
	events []GossipEvent
}

func (r *gossipRecorder) on(ev GossipEvent) {
	r.mu.Lock()
	r.events = append(r.events, ev)
	r.mu.Unlock()
}

// first returns the first event of type typ about p.
func (r *gossipRecorder) first(typ GossipEventType, p peer.ID) (GossipEvent, bool) {
	return r.firstAfter(typ, p, time.Time{})
}

// firstAfter returns the first event of type typ about p recorded after since.
func (r *gossipRecorder) firstAfter(typ GossipEventType, p peer.ID, since time.Time) (GossipEvent, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ev := range r.events {
		if ev.Type == typ && ev.Peer == p && ev.At.After(since) {
			return ev, true
		}
	}
	return GossipEvent{}, false
}

type gossipClusterConfig struct {
	n      int
	preset string
	tune   func(*memberlist.Config)
	// admit, when set, builds node i's Admit from the cluster's peer IDs.
	admit func(i int, ids []peer.ID) func(peer.ID) bool
	meta  func(i int) NodeMeta
}

// newGossipHost starts a QUIC host on loopback.
func newGossipHost(t testing.TB) host.Host {
	t.Helper()
	h, err := NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// newGossipCluster starts cfg.n members (not joined yet). Addresses are found
// through the Resolve hook, not the peerstore.
func newGossipCluster(t testing.TB, cfg gossipClusterConfig) []*gossipNode {
	t.Helper()
	if cfg.preset == "" {
		cfg.preset = GossipPresetLocal
		if cfg.tune == nil {
			// The local preset retransmits each broadcast only twice in
			// total, so a small cluster often waits for a push/pull to
			// converge; the LAN value keeps the tests quick.
			cfg.tune = func(c *memberlist.Config) { c.RetransmitMult = 4 }
		}
	}
	nodes := make([]*gossipNode, cfg.n)
	ids := make([]peer.ID, cfg.n)
	addrs := make(map[peer.ID][]ma.Multiaddr)
	for i := range nodes {
		h := newGossipHost(t)
		nodes[i] = &gossipNode{h: h}
		ids[i] = h.ID()
		addrs[h.ID()] = h.Addrs()
	}
	resolve := func(p peer.ID) []ma.Multiaddr { return addrs[p] }
	for i, n := range nodes {
		m := NodeMeta{Role: NodeRoleAgent, Name: fmt.Sprintf("agent-%d", i), Models: []string{"m"}}
		if i == 0 {
			m = NodeMeta{Role: NodeRoleRelay}
		}
		if cfg.meta != nil {
			m = cfg.meta(i)
		}
		n.meta.Store(&m)
		admit := func(peer.ID) bool { return true }
		if cfg.admit != nil {
			admit = cfg.admit(i, ids)
		}
		g, err := NewGossip(GossipConfig{
			Host:       n.h,
			Logger:     zerolog.Nop(),
			Preset:     cfg.preset,
			Tune:       cfg.tune,
			Admit:      admit,
			Trusted:    ids,
			Resolve:    resolve,
			MetaSource: func() NodeMeta { return *n.meta.Load() },
			OnEvent:    n.rec.on,
		})
		if err != nil {
			t.Fatal(err)
		}
		n.g = g
	}
	t.Cleanup(func() {
		var wg sync.WaitGroup
		for _, n := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				n.g.Shutdown()
				n.h.Close()
			}()
		}
		wg.Wait()
		waitMemberlistStopped(t)
	})
	return nodes
}

// waitMemberlistStopped polls until no memberlist goroutine is left.
// Memberlist's Shutdown does not wait for a probe in progress, which keeps
// its goroutine up to a probe interval longer (goleak would report it).
func waitMemberlistStopped(t testing.TB) {
	t.Helper()
	buf := make([]byte, 1<<20)
	deadline := time.Now().Add(time.Minute)
	for {
		n := runtime.Stack(buf, true)
		if !bytes.Contains(buf[:n], []byte("hashicorp/memberlist.(*Memberlist)")) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("memberlist goroutines still running a minute after shutdown")
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// joinAll makes every member join the first one.
func joinAll(t testing.TB, nodes []*gossipNode) {
	t.Helper()
	for _, n := range nodes[1:] {
		if _, err := n.g.Join(nodes[0].id()); err != nil {
			t.Fatalf("join: %v", err)
		}
	}
}

// pollUntil polls cond every 10 ms until it holds or the deadline passes.
func pollUntil(t testing.TB, limit time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > limit {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(start)
}

func converged(nodes []*gossipNode) bool {
	for _, n := range nodes {
		if len(n.g.Members()) != len(nodes)-1 {
			return false
		}
	}
	return true
}

func TestGossipAddrDerived(t *testing.T) {
	a, b := newGossipHost(t), newGossipHost(t)
	defer a.Close()
	defer b.Close()
	ipA, portA := GossipAddr(a.ID())
	ipA2, portA2 := GossipAddr(a.ID())
	ipB, portB := GossipAddr(b.ID())
	if !ipA.Equal(ipA2) || portA != portA2 {
		t.Fatal("derived address not deterministic")
	}
	if ipA.Equal(ipB) && portA == portB {
		t.Fatal("two peers share a derived address")
	}
	_, ula, _ := net.ParseCIDR("fd00::/8")
	if !ula.Contains(ipA) || portA < 1024 || portA > 65535 {
		t.Fatalf("derived %s port %d outside fd00::/8, 1024..65535", ipA, portA)
	}
}

func TestGossipConvergesWithMeta(t *testing.T) {
	nodes := newGossipCluster(t, gossipClusterConfig{n: 5})
	joinAll(t, nodes)
	took := pollUntil(t, 30*time.Second, "5 members to converge", func() bool { return converged(nodes) })
	t.Logf("5 members converged in %v", took)
	for _, m := range nodes[1].g.Members() {
		want := "agent-" + fmt.Sprint(slices.IndexFunc(nodes, func(n *gossipNode) bool { return n.id() == m.Peer }))
		if m.Peer == nodes[0].id() {
			if m.Meta.Role != NodeRoleRelay {
				t.Errorf("relay's role is %v", m.Meta.Role)
			}
			continue
		}
		if m.MetaErr != nil || m.Meta.Name != want || m.Meta.Role != NodeRoleAgent || !slices.Equal(m.Meta.Models, []string{"m"}) {
			t.Errorf("member %s meta %+v err %v, want name %s", m.Peer, m.Meta, m.MetaErr, want)
		}
	}
	if st := nodes[0].g.Stats(); st.PacketsReceived == 0 || st.StreamsAccepted == 0 || st.Rejected != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestGossipDeadMemberDetected(t *testing.T) {
	nodes := newGossipCluster(t, gossipClusterConfig{n: 5})
	joinAll(t, nodes)
	pollUntil(t, 30*time.Second, "convergence", func() bool { return converged(nodes) })

	victim := nodes[4]
	start := time.Now()
	victim.stop()
	others := nodes[:4]
	took := pollUntil(t, 90*time.Second, "the stopped member to be declared dead everywhere", func() bool {
		for _, n := range others {
			if _, ok := n.rec.first(GossipDead, victim.id()); !ok {
				return false
			}
		}
		return true
	})
	suspected := 0
	for _, n := range others {
		if _, ok := n.rec.first(GossipLeft, victim.id()); ok {
			t.Error("a crashed member was reported as left")
		}
		if ev, ok := n.rec.first(GossipSuspect, victim.id()); ok {
			suspected++
			t.Logf("suspected after %v", ev.At.Sub(start))
		}
		if n.g.Known(victim.id()) {
			t.Error("dead member still listed")
		}
	}
	if suspected == 0 {
		t.Error("no member reported the victim suspect before dead")
	}
	t.Logf("dead everywhere after %v (preset local; %d of 4 saw it suspect first)", took, suspected)
}

func TestGossipLeaveSeenAtOnce(t *testing.T) {
	nodes := newGossipCluster(t, gossipClusterConfig{n: 4})
	joinAll(t, nodes)
	pollUntil(t, 30*time.Second, "convergence", func() bool { return converged(nodes) })
	leaver := nodes[3]
	if err := leaver.g.Leave(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	took := pollUntil(t, 30*time.Second, "the leave to be seen", func() bool {
		for _, n := range nodes[:3] {
			if _, ok := n.rec.first(GossipLeft, leaver.id()); !ok {
				return false
			}
		}
		return true
	})
	for _, n := range nodes[:3] {
		if _, ok := n.rec.first(GossipDead, leaver.id()); ok {
			t.Error("a graceful leave was reported as dead")
		}
	}
	t.Logf("leave seen by all in %v", took)
}

func TestGossipMetadataSpreads(t *testing.T) {
	nodes := newGossipCluster(t, gossipClusterConfig{n: 3})
	joinAll(t, nodes)
	pollUntil(t, 30*time.Second, "convergence", func() bool { return converged(nodes) })
	agent := nodes[2]
	agent.setMeta(NodeMeta{Role: NodeRoleAgent, Name: "agent-2", Models: []string{"m"}, Capacity: 8,
		InFlight: 6, Running: 4, Waiting: 7, KVCacheUsage: 0.83, Draining: true})
	pollUntil(t, 30*time.Second, "new metadata at the relay", func() bool {
		for _, m := range nodes[0].g.Members() {
			if m.Peer == agent.id() {
				return m.Meta.Draining && m.Meta.Waiting == 7 && m.Meta.Running == 4 && m.Meta.KVCacheUsage == 0.83 && m.Meta.Seq > 1
			}
		}
		return false
	})
	if _, ok := nodes[1].rec.first(GossipUpdated, agent.id()); !ok {
		pollUntil(t, 30*time.Second, "an updated event at another agent", func() bool {
			_, ok := nodes[1].rec.first(GossipUpdated, agent.id())
			return ok
		})
	}
}

func TestGossipManyModelsWithinLimit(t *testing.T) {
	var models []string
	for i := range 300 {
		models = append(models, fmt.Sprintf("hf.co/some-organisation/model-%03d-70B-Instruct-GGUF:Q4_K_M", i))
	}
	nodes := newGossipCluster(t, gossipClusterConfig{n: 2, meta: func(i int) NodeMeta {
		return NodeMeta{Role: NodeRoleAgent, Name: fmt.Sprint("agent-", i), Models: models, Capacity: 2}
	}})
	joinAll(t, nodes)
	pollUntil(t, 30*time.Second, "convergence", func() bool { return converged(nodes) })
	m := nodes[0].g.Members()[0]
	if m.MetaErr != nil || !m.Meta.ModelsTruncated || m.Meta.ModelCount != 300 || m.Meta.ModelsDigest != ModelsDigest(models) {
		t.Fatalf("meta %+v err %v", m.Meta, m.MetaErr)
	}
}

func TestGossipRejectsPeerNotAdmitted(t *testing.T) {
	// Members 0..2 admit each other; member 3 admits everyone but nobody admits it.
	nodes := newGossipCluster(t, gossipClusterConfig{n: 4, admit: func(i int, ids []peer.ID) func(peer.ID) bool {
		if i == 3 {
			return func(peer.ID) bool { return true }
		}
		return func(p peer.ID) bool { return p != ids[3] }
	}})
	joinAll(t, nodes[:3])
	pollUntil(t, 30*time.Second, "convergence of the admitted", func() bool { return converged(nodes[:3]) })

	outsider := nodes[3]
	if n, err := outsider.g.Join(nodes[0].id()); err == nil || n != 0 {
		t.Fatalf("outsider joined: n=%d err=%v", n, err)
	}
	// Inject packets too: a raw frame on the packet protocol from the outsider.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	outsider.h.Peerstore().AddAddrs(nodes[1].id(), nodes[1].h.Addrs(), time.Minute)
	if s, err := outsider.h.NewStream(ctx, nodes[1].id(), GossipPacketProtocol); err == nil {
		s.Write([]byte{0, 1, 0})
		s.Read(make([]byte, 1)) // returns once the reset arrives
		s.Reset()
	}
	pollUntil(t, 30*time.Second, "rejections counted", func() bool {
		return nodes[0].g.Stats().Rejected > 0 && nodes[1].g.Stats().Rejected > 0
	})
	for i, n := range nodes[:3] {
		if n.g.Known(outsider.id()) {
			t.Errorf("member %d lists the outsider", i)
		}
		if _, ok := n.rec.first(GossipAlive, outsider.id()); ok {
			t.Errorf("member %d saw the outsider alive", i)
		}
	}
	if len(outsider.g.Members()) != 0 {
		t.Errorf("outsider learned members: %v", outsider.g.Members())
	}
}
