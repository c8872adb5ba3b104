package transport

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/control"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"
)

// An agent whose probes of another agent went unanswered for a moment (a
// loaded box, a lossy path) suspects it in its own view only: the relay
// never doubted either. Once they can talk again the suspect hears of it and
// refutes it, so the suspicion ends before its timeout and neither agent
// ever declares the other dead, though their metadata never changes.
func TestGossipAgentRefutesAnotherAgentsSuspicion(t *testing.T) {
	const suspicion = 6 * time.Second
	tune := func(c *memberlist.Config) {
		c.ProbeInterval = 200 * time.Millisecond
		c.ProbeTimeout = 100 * time.Millisecond
		c.IndirectChecks = 0 // the relay would vouch for the other; this doubt is private
		c.SuspicionMult = int(suspicion / c.ProbeInterval)
		c.SuspicionMaxTimeoutMult = 1
		c.GossipInterval = 50 * time.Millisecond
		c.PushPullInterval = time.Second
	}
	hub := newGossipHost(t)
	defer hub.Close()
	rg, err := NewGossip(GossipConfig{Host: hub, Logger: zerolog.Nop(), Preset: GossipPresetLocal, Tune: tune,
		Admit: func(peer.ID) bool { return true }})
	if err != nil {
		t.Fatal(err)
	}
	defer rg.Shutdown()
	var split atomic.Bool
	var ids [2]peer.ID
	var hosts [2]host.Host
	for i := range hosts {
		h, err := libp2p.New(libp2p.ListenAddrStrings("/ip4/127.0.0.1/udp/0/quic-v1"),
			libp2p.ConnectionGater(splitGater{split: &split, ids: &ids}))
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		hosts[i], ids[i] = h, h.ID()
	}
	var recs [2]gossipRecorder
	var gs [2]*Gossip
	for i := range gs {
		g, err := NewGossip(GossipConfig{Host: hosts[i], Logger: zerolog.Nop(), Preset: GossipPresetLocal, Tune: tune,
			Trusted: []peer.ID{hub.ID()}, Admit: func(peer.ID) bool { return true }, OnEvent: recs[i].on,
			MetaSource: func() NodeMeta { return NodeMeta{Role: NodeRoleAgent} }})
		if err != nil {
			t.Fatal(err)
		}
		defer g.Shutdown()
		gs[i] = g
		connect(t, hosts[i], hub)
		connect(t, hosts[i], hosts[1-i])
		if _, err := g.Join(hub.ID()); err != nil {
			t.Fatal(err)
		}
	}
	pollUntil(t, 30*time.Second, "the agents to list each other", func() bool {
		return gs[0].Known(ids[1]) && gs[1].Known(ids[0])
	})
	// Their packets to each other go unanswered, as on a lost path, until
	// one suspects the other.
	split.Store(true)
	_ = hosts[0].Network().ClosePeer(ids[1])
	start := time.Now()
	suspected := func(i int) bool { _, ok := recs[i].firstAfter(GossipSuspect, ids[1-i], start); return ok }
	pollUntil(t, 30*time.Second, "an agent to suspect the other", func() bool { return suspected(0) || suspected(1) })
	split.Store(false)
	healed := time.Now()
	// Past the suspicion's timeout, with room for a loaded machine.
	time.Sleep(suspicion + 3*time.Second)
	for i := range gs {
		if ev, ok := recs[i].firstAfter(GossipDead, ids[1-i], start); ok {
			t.Errorf("agent %d declared agent %d dead %v after the path came back", i, 1-i, ev.At.Sub(healed))
		}
		if !gs[i].Known(ids[1-i]) {
			t.Errorf("agent %d does not list agent %d", i, 1-i)
		}
		if ev, ok := recs[i].firstAfter(GossipAlive, ids[1-i], healed); ok && suspected(i) {
			t.Logf("agent %d saw agent %d refute %v after the path came back", i, 1-i, ev.At.Sub(healed))
		}
	}
	if !rg.Known(ids[0]) || !rg.Known(ids[1]) {
		t.Error("the relay lost an agent: the doubt was not private")
	}
}

// splitGater refuses connections between the two peers of ids while split
// is set.
type splitGater struct {
	split *atomic.Bool
	ids   *[2]peer.ID
}

func (g splitGater) cut(p peer.ID) bool {
	return g.split.Load() && (p == g.ids[0] || p == g.ids[1])
}
func (g splitGater) InterceptPeerDial(p peer.ID) bool                 { return !g.cut(p) }
func (g splitGater) InterceptAddrDial(p peer.ID, _ ma.Multiaddr) bool { return !g.cut(p) }
func (g splitGater) InterceptAccept(network.ConnMultiaddrs) bool      { return true }
func (g splitGater) InterceptSecured(_ network.Direction, p peer.ID, _ network.ConnMultiaddrs) bool {
	return !g.cut(p)
}
func (g splitGater) InterceptUpgraded(network.Conn) (bool, control.DisconnectReason) { return true, 0 }
