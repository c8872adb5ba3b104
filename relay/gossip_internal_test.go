package relay

import (
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// gossipTestRelay is a relay without libp2p whose registry is fed by hand.
func gossipTestRelay(t *testing.T) *Relay {
	t.Helper()
	r, err := New(Config{NoP2P: true, NoAuth: true, Transport: http.DefaultTransport, Policy: scheduler.PolicyRoundRobin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func agentMeta(name string, models ...string) transport.NodeMeta {
	return transport.NodeMeta{Role: transport.NodeRoleAgent, Name: name, Models: models,
		ModelsDigest: transport.ModelsDigest(models), ModelCount: len(models)}
}

// status returns the scheduler's view of endpoint id.
func status(r *Relay, id string) (scheduler.EndpointStatus, bool) {
	for _, s := range r.sched.Snapshot() {
		if s.ID == id {
			return s, true
		}
	}
	return scheduler.EndpointStatus{}, false
}

// picks returns the endpoints n successive requests for m1 land on.
func picks(t *testing.T, r *Relay, n int) []string {
	t.Helper()
	var out []string
	for range n {
		a := r.sched.Begin(scheduler.Request{Model: "m1"})
		c, err := a.Pick()
		if err != nil {
			t.Fatalf("pick: %v", err)
		}
		out = append(out, c.EndpointID)
		a.Report(c, scheduler.Outcome{Status: 200, Latency: time.Millisecond})
	}
	return out
}

// TestGossipReconciliation walks the table in gossip.go: what the routing
// table does for each combination of join registration and gossip state.
func TestGossipReconciliation(t *testing.T) {
	r := gossipTestRelay(t)
	pa, pb, pc := peer.ID("peer-a"), peer.ID("peer-b"), peer.ID("peer-c")
	for p, name := range map[peer.ID]string{pa: "a", pb: "b"} {
		if err := r.reg.Joined(p, transport.JoinInfo{Name: name, Models: []string{"m1"}}); err != nil {
			t.Fatal(err)
		}
	}
	ev := func(typ transport.GossipEventType, p peer.ID, m transport.NodeMeta) {
		r.reg.gossipEvent(transport.GossipEvent{Type: typ, Peer: p, Meta: m, At: time.Now()})
	}

	// Joined, never seen in gossip: routable.
	if got := picks(t, r, 4); !slices.Contains(got, "a") || !slices.Contains(got, "b") {
		t.Fatalf("picks before gossip %v", got)
	}

	// Alive with load: health follows the metadata.
	m := agentMeta("a", "m1")
	m.Running, m.Waiting, m.KVCacheUsage, m.InFlight = 2, 5, 0.5, 4
	ev(transport.GossipAlive, pa, m)
	if s, _ := status(r, "a"); s.Health.Running != 4 || s.Health.Waiting != 5 || s.Health.KVCacheUsage != 0.5 || s.Health.Suspect {
		t.Errorf("health after alive: %+v", s.Health)
	}

	// Suspect: avoided while another agent can serve, used when alone.
	ev(transport.GossipSuspect, pa, m)
	if s, _ := status(r, "a"); !s.Health.Suspect {
		t.Error("suspect not recorded")
	}
	if got := picks(t, r, 6); slices.Contains(got, "a") {
		t.Errorf("a suspect agent was picked while another was fine: %v", got)
	}
	ev(transport.GossipAlive, pa, m)
	if got := picks(t, r, 4); !slices.Contains(got, "a") {
		t.Errorf("an agent alive again was not picked: %v", got)
	}

	// Dead while the join stream is open: out of routing, name kept, back
	// when gossip sees it alive.
	ev(transport.GossipDead, pa, m)
	if _, ok := status(r, "a"); ok {
		t.Error("a dead agent is still in the scheduler")
	}
	if got := picks(t, r, 4); slices.Contains(got, "a") {
		t.Errorf("a dead agent was picked: %v", got)
	}
	if p, ok := r.reg.Peer("a"); !ok || p != pa {
		t.Error("the dead agent lost its name while its join stream is open")
	}
	ev(transport.GossipAlive, pa, m)
	if _, ok := status(r, "a"); !ok {
		t.Error("an agent that refuted its death is not routable again")
	}

	// Left: out at once, draining.
	ev(transport.GossipLeft, pb, agentMeta("b", "m1"))
	if _, ok := status(r, "b"); ok {
		t.Error("an agent that left is still in the scheduler")
	}

	// A dead verdict older than the current join is stale.
	r.reg.Left(pb)
	if err := r.reg.Joined(pb, transport.JoinInfo{Name: "b", Models: []string{"m1"}}); err != nil {
		t.Fatal(err)
	}
	r.reg.gossipEvent(transport.GossipEvent{Type: transport.GossipDead, Peer: pb, At: time.Now().Add(-time.Minute)})
	if _, ok := status(r, "b"); !ok {
		t.Error("a stale dead verdict removed a freshly joined agent")
	}

	// Alive in gossip without a join registration: not routable, counted.
	ev(transport.GossipAlive, pc, agentMeta("c", "m1"))
	if _, ok := status(r, "c"); ok {
		t.Error("an agent without a registration became routable")
	}
	if _, _, unreg := r.reg.gossipCounts(); unreg != 1 {
		t.Errorf("unregistered agents %d, want 1", unreg)
	}

	// Join stream ended: removed whatever gossip says.
	r.reg.Left(pa)
	ev(transport.GossipUpdated, pa, m)
	if _, ok := status(r, "a"); ok {
		t.Error("gossip brought back an agent whose registration ended")
	}
}

// TestGossipModels: a model list or capacity that changes in gossip reaches
// the scheduler; a truncated list that differs keeps the registration's.
func TestGossipModels(t *testing.T) {
	r := gossipTestRelay(t)
	p := peer.ID("peer-a")
	if err := r.reg.Joined(p, transport.JoinInfo{Name: "a", Models: []string{"m1"}, Capacity: 4}); err != nil {
		t.Fatal(err)
	}
	ev := func(typ transport.GossipEventType, m transport.NodeMeta) {
		r.reg.gossipEvent(transport.GossipEvent{Type: typ, Peer: p, Meta: m, At: time.Now()})
	}
	m := agentMeta("a", "m1")
	m.Capacity = 4
	ev(transport.GossipAlive, m)
	if s, _ := status(r, "a"); !slices.Equal(s.Models, []string{"m1"}) || s.Capacity != 4 {
		t.Fatalf("agreeing gossip changed the endpoint: %+v", s)
	}

	m = agentMeta("a", "m1", "m2")
	m.Capacity = 8
	ev(transport.GossipUpdated, m)
	if s, _ := status(r, "a"); !slices.Equal(s.Models, []string{"m1", "m2"}) || s.Capacity != 8 {
		t.Errorf("models or capacity from gossip not applied: %+v", s)
	}

	trunc := transport.NodeMeta{Role: transport.NodeRoleAgent, Name: "a", ModelsTruncated: true, ModelCount: 300,
		ModelsDigest: [8]byte{1, 2, 3}, Capacity: 8}
	ev(transport.GossipUpdated, trunc)
	if s, _ := status(r, "a"); !slices.Equal(s.Models, []string{"m1", "m2"}) {
		t.Errorf("a truncated list replaced the registration's: %v", s.Models)
	}
}

// TestAdmittedMidJoin: a connected peer gets nothing before its join
// completes (no reservation grace) and is overdue after AdmitGrace; only
// joined peers are admitted.
func TestAdmittedMidJoin(t *testing.T) {
	r := gossipTestRelay(t)
	p, q := peer.ID("peer-p"), peer.ID("peer-q")
	if r.reg.Admitted(p) {
		t.Fatal("an unknown peer is admitted")
	}
	now := time.Now()
	r.reg.connected(p, now)
	if r.reg.Admitted(p) {
		t.Error("a peer in the middle of its join is admitted to circuits")
	}
	if r.reg.IsJoined(p) {
		t.Error("a connected peer counts as joined")
	}
	r.reg.connected(q, now.Add(-AdmitGrace))
	if r.reg.Admitted(q) {
		t.Error("a peer connected for longer than the grace without joining is admitted")
	}
	if got := r.reg.overdue(now); !slices.Equal(got, []peer.ID{q}) {
		t.Errorf("overdue %v, want [q]", got)
	}
	if err := r.reg.Joined(p, transport.JoinInfo{Name: "p", Models: []string{"m1"}}); err != nil {
		t.Fatal(err)
	}
	if got := r.reg.overdue(now.Add(time.Hour)); len(got) != 0 {
		t.Errorf("a joined peer is overdue: %v", got)
	}
	if !r.reg.Admitted(p) || !r.reg.IsJoined(p) || !r.reg.GossipAdmitted(p) {
		t.Error("a joined peer is not admitted")
	}
	// After its registration ends, a peer stays admitted to gossip for a
	// moment (its leave may trail the end of the join stream), not longer.
	r.reg.Left(p)
	if r.reg.IsJoined(p) || !r.reg.GossipAdmitted(p) {
		t.Error("a peer that just left is not admitted to gossip for its leave")
	}
	r.reg.sweep(time.Now().Add(leaveGrace))
	if r.reg.GossipAdmitted(p) {
		t.Error("a peer that left long ago is still admitted to gossip")
	}
	if r.reg.GossipAdmitted(q) {
		t.Error("a peer that never joined is admitted to gossip")
	}
}
