package transport

import (
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"
)

// gossipTables returns the sizes of what g, its guard and its transport
// keep per peer.
func gossipTables(g *Gossip) map[string]int {
	g.mu.Lock()
	out := map[string]int{"members": len(g.members), "incarn": len(g.incarn), "leftSeen": len(g.leftSeen), "banned": len(g.banned)}
	g.mu.Unlock()
	g.guard.mu.Lock()
	out["guard.known"], out["guard.fwdAlive"], out["guard.fwdDead"] = len(g.guard.known), len(g.guard.fwdAlive), len(g.guard.fwdDead)
	g.guard.mu.Unlock()
	g.tr.mu.Lock()
	out["transport.byAddr"], out["transport.senders"] = len(g.tr.byAddr), len(g.tr.senders)
	g.tr.mu.Unlock()
	out["memberlist.broadcasts"] = broadcastQueue(g.ml).NumQueued()
	return out
}

// Members that join and leave one after another, each under a new peer ID,
// leave nothing behind in the gossip member they talked to: its tables, its
// guard's and its transport's hold what they held before the first came.
func TestGossipForgetsDepartedMembers(t *testing.T) {
	hub := newGossipHost(t)
	defer hub.Close()
	g, err := NewGossip(GossipConfig{Host: hub, Logger: zerolog.Nop(), Preset: GossipPresetLocal,
		Admit: func(peer.ID) bool { return true }})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Shutdown()
	if broadcastQueue(g.ml) == nil {
		t.Fatal("memberlist's broadcast queue is out of reach: this memberlist keeps it otherwise")
	}
	g.sweepEvery.Store(int64(time.Second))
	g.queueSlack.Store(0)
	before := gossipTables(g)
	const n = 12
	for i := range n {
		h := newGossipHost(t)
		m, err := NewGossip(GossipConfig{Host: h, Logger: zerolog.Nop(), Preset: GossipPresetLocal,
			Admit: func(p peer.ID) bool { return p == hub.ID() }, Trusted: []peer.ID{hub.ID()},
			MetaSource: func() NodeMeta { return NodeMeta{Role: NodeRoleAgent} }})
		if err != nil {
			t.Fatal(err)
		}
		connect(t, h, hub)
		if _, err := m.Join(hub.ID()); err != nil {
			t.Fatalf("member %d: %v", i, err)
		}
		waitFor(t, "the hub to know the member", func() bool { return g.Known(h.ID()) })
		_ = m.Leave(time.Second)
		_ = m.Shutdown()
		_ = h.Close()
		waitFor(t, "the hub to see the member go", func() bool { return !g.Known(h.ID()) })
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		now, grown := gossipTables(g), ""
		for k, v := range now {
			if v > before[k] {
				grown = k
			}
		}
		if grown == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s grew: tables before %v, after %d members came and went %v", grown, before, n, now)
		}
		time.Sleep(50 * time.Millisecond) // a pace; the loop checks the condition
	}
	t.Logf("tables before %v, after %d members came and went %v", before, n, gossipTables(g))
}
