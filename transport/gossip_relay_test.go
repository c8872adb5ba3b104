package transport

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/client"
	relayv2 "github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/relay"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"
)

// TestGossipOverCircuit runs two agents that reach each other only through
// the relay's circuit (limited connections): they still probe each other.
func TestGossipOverCircuit(t *testing.T) {
	newHost := func() host.Host {
		h, err := libp2p.New(libp2p.ListenAddrStrings("/ip4/127.0.0.1/udp/0/quic-v1"), libp2p.EnableRelay())
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	rh, ah, bh := newHost(), newHost(), newHost()
	// The default limits mark relayed connections limited, so this also
	// proves the transport opens streams over limited connections.
	r, err := relayv2.New(rh)
	if err != nil {
		t.Fatal(err)
	}
	relayInfo := peer.AddrInfo{ID: rh.ID(), Addrs: rh.Addrs()}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, h := range []host.Host{ah, bh} {
		if err := h.Connect(ctx, relayInfo); err != nil {
			t.Fatal(err)
		}
		if _, err := client.Reserve(ctx, h, relayInfo); err != nil {
			t.Fatalf("reserve: %v", err)
		}
	}

	circuit := func(target peer.ID) []ma.Multiaddr {
		a, err := ma.NewMultiaddr(rh.Addrs()[0].String() + "/p2p/" + rh.ID().String() + "/p2p-circuit")
		if err != nil {
			t.Error(err)
			return nil
		}
		return []ma.Multiaddr{a}
	}
	var recs [3]gossipRecorder
	var gs []*Gossip
	for i, h := range []host.Host{rh, ah, bh} {
		cfg := GossipConfig{
			Host: h, Logger: zerolog.Nop(), Preset: GossipPresetLocal,
			Admit:   func(peer.ID) bool { return true },
			OnEvent: recs[i].on,
		}
		if i > 0 {
			cfg.Admit = func(p peer.ID) bool { return p == rh.ID() }
			cfg.AdmitMembers = true
			cfg.Resolve = circuit
			cfg.Trusted = []peer.ID{rh.ID()}
		}
		g, err := NewGossip(cfg)
		if err != nil {
			t.Fatal(err)
		}
		gs = append(gs, g)
	}
	t.Cleanup(func() {
		for _, g := range gs {
			g.Shutdown()
		}
		r.Close()
		for _, h := range []host.Host{rh, ah, bh} {
			h.Close()
		}
		waitMemberlistStopped(t)
	})
	for _, g := range gs[1:] {
		if _, err := g.Join(rh.ID()); err != nil {
			t.Fatal(err)
		}
	}
	// a and b learn of each other from the relay, then exchange packets
	// over a relayed (limited) connection.
	pollUntil(t, 30*time.Second, "a gossip packet stream between the agents over the circuit", func() bool {
		for _, c := range ah.Network().ConnsToPeer(bh.ID()) {
			if !strings.Contains(c.RemoteMultiaddr().String(), "/p2p-circuit") || !c.Stat().Limited {
				t.Fatalf("agents connected other than by a limited circuit: %s", c.RemoteMultiaddr())
			}
			for _, s := range c.GetStreams() {
				if s.Protocol() == GossipPacketProtocol && s.Stat().Direction == network.DirOutbound {
					return true
				}
			}
		}
		return false
	})
	if !gs[1].Known(bh.ID()) || !gs[2].Known(ah.ID()) {
		t.Fatal("agents do not list each other")
	}
	if _, ok := recs[1].first(GossipSuspect, bh.ID()); ok {
		t.Error("agent suspected its peer over the circuit")
	}
}

// TestGossipPacketsLeaveTheCircuitForADirectPath: a's packet stream to b was
// opened on the relay's circuit; once a direct connection appears (here a
// dial, in the field a hole punch), a's next packets reach b on the direct
// one, and the circuit carries no more gossip.
func TestGossipPacketsLeaveTheCircuitForADirectPath(t *testing.T) {
	newHost := func() host.Host {
		h, err := libp2p.New(libp2p.ListenAddrStrings("/ip4/127.0.0.1/udp/0/quic-v1"), libp2p.EnableRelay())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		return h
	}
	rh, ah, bh := newHost(), newHost(), newHost()
	r, err := relayv2.New(rh)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	relayInfo := peer.AddrInfo{ID: rh.ID(), Addrs: rh.Addrs()}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, h := range []host.Host{ah, bh} {
		if err := h.Connect(ctx, relayInfo); err != nil {
			t.Fatal(err)
		}
		if _, err := client.Reserve(ctx, h, relayInfo); err != nil {
			t.Fatalf("reserve: %v", err)
		}
	}
	circuit, err := ma.NewMultiaddr(rh.Addrs()[0].String() + "/p2p/" + rh.ID().String() + "/p2p-circuit")
	if err != nil {
		t.Fatal(err)
	}
	all := func(peer.ID) bool { return true }
	tb, err := NewGossipTransport(GossipTransportConfig{Host: bh, Admit: all})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Shutdown()
	ta, err := NewGossipTransport(GossipTransportConfig{Host: ah, Admit: all,
		Resolve: func(peer.ID) []ma.Multiaddr { return []ma.Multiaddr{circuit} }})
	if err != nil {
		t.Fatal(err)
	}
	defer ta.Shutdown()

	to := memberlist.Address{Name: bh.ID().String()}
	// send writes one packet and returns the connection b read it on.
	send := func(msg string) network.Conn {
		t.Helper()
		if _, err := ta.WriteToAddress([]byte(msg), to); err != nil {
			t.Fatal(err)
		}
		select {
		case p := <-tb.PacketCh():
			if string(p.Buf) != msg {
				t.Fatalf("b got %q, want %q", p.Buf, msg)
			}
		case <-ctx.Done():
			t.Fatalf("packet %q lost; a's stats %+v", msg, ta.Stats())
		}
		for _, c := range ah.Network().ConnsToPeer(bh.ID()) {
			for _, s := range c.GetStreams() {
				if s.Protocol() == GossipPacketProtocol && s.Stat().Direction == network.DirOutbound {
					return c
				}
			}
		}
		t.Fatal("a holds no outbound gossip packet stream to b")
		return nil
	}
	if c := send("over the circuit"); !IsRelayedConn(c) {
		t.Fatalf("first packet went over %s, want the circuit", c.RemoteMultiaddr())
	}
	direct := network.WithForceDirectDial(ctx, "test")
	if err := ah.Connect(direct, peer.AddrInfo{ID: bh.ID(), Addrs: bh.Addrs()}); err != nil {
		t.Fatal(err)
	}
	if PathTo(ah, bh.ID()) != PathDirect {
		t.Fatal("no direct connection after the dial")
	}
	for i := range 3 {
		if c := send(fmt.Sprintf("direct %d", i)); IsRelayedConn(c) {
			t.Fatalf("packet %d after the direct connection went over %s", i, c.RemoteMultiaddr())
		}
	}
	if s := ta.Stats(); s.PacketsDropped != 0 || s.StreamsOpened != 2 {
		t.Errorf("a's stats %+v, want no drop and two streams opened (circuit, then direct)", s)
	}
}
