package relay_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/p2p/net/swarm"
	circuitclient "github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/client"
	"github.com/libp2p/go-libp2p/p2p/protocol/identify"

	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/transport"
)

// outsiderHost is a libp2p peer with the circuit relay client and no token.
func outsiderHost(t *testing.T) host.Host {
	t.Helper()
	h, err := transport.NewHost(transport.HostConfig{
		ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Options:     []libp2p.Option{libp2p.EnableRelay()},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h
}

func dialCircuit(ctx context.Context, h host.Host, ri peer.AddrInfo, target peer.ID) error {
	h.Peerstore().ClearAddrs(target)
	if sw, ok := h.Network().(*swarm.Swarm); ok {
		sw.Backoff().Clear(target) // every attempt reaches the relay
	}
	return h.Connect(network.WithAllowLimitedConn(ctx, "test"), peer.AddrInfo{ID: target, Addrs: transport.CircuitAddrs(ri, target)})
}

// TestOutsidersGetNoCircuits: peers without the token get no reservation
// and no circuit, at once after connecting and on every reconnect, and the
// relay carries 0 bytes for them; joined peers reach each other.
func TestOutsidersGetNoCircuits(t *testing.T) {
	t.Parallel() // waits on reconnects, in its own relay and agents
	gr := startGRelay(t, gFastTune, transport.GossipPresetLocal)
	v := relaytest.RunAgent(t, gAgentConfig(t, "victim", relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "victim", VLLMMetrics: true}), filepath.Join(t.TempDir(), "victim.key"), gFastTune, transport.GossipPresetLocal, gr.Addr()))
	relaytest.Within(t, 30*time.Second, "the joined agent's reservation", func() bool {
		n := v.Agent.NAT()
		return n != nil && n.Stats().Reservations == 1
	})
	ri := gr.Info()
	before := gr.Relay.CircuitStats()
	o1, o2 := outsiderHost(t), outsiderHost(t)
	for round := range 3 {
		for _, o := range []host.Host{o1, o2} {
			_ = o.Network().ClosePeer(ri.ID)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		for _, o := range []host.Host{o1, o2} {
			if err := o.Connect(ctx, ri); err != nil {
				t.Fatal(err)
			}
			// At once after connecting: no grace.
			if _, err := circuitclient.Reserve(ctx, o, ri); err == nil {
				t.Errorf("round %d: an outsider got a reservation", round)
			}
		}
		if err := dialCircuit(ctx, o1, ri, v.Agent.ID()); err == nil {
			t.Errorf("round %d: an outsider opened a circuit to a joined agent", round)
		}
		if err := dialCircuit(ctx, o1, ri, o2.ID()); err == nil {
			t.Errorf("round %d: outsiders opened a circuit between them", round)
		}
		cancel()
	}
	mid := gr.Relay.CircuitStats()

	// A token holder reaches the joined agent through the relay, and the
	// agent answers it (the joined peer is a gossip member), but not an
	// outsider, which holds no reservation.
	ml := newMallory(t, gr)
	relaytest.Within(t, 30*time.Second, "the agent to know the joined peer", func() bool { return v.Agent.Gossip().Known(ml.h.ID()) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := dialCircuit(ctx, ml.h, ri, v.Agent.ID()); err != nil {
		t.Errorf("a joined peer could not reach a joined agent through the relay: %v", err)
	}
	if err := dialCircuit(ctx, ml.h, ri, o2.ID()); err == nil {
		t.Error("a joined peer opened a circuit to an outsider")
	}
	after := gr.Relay.CircuitStats()
	t.Logf("outsiders, 3 rounds of reconnects: reservations granted %d refused %d, circuits opened %d refused %d, bytes relayed %d; then a joined peer: circuits opened %d, bytes %d",
		mid.ReservationsGranted-before.ReservationsGranted, mid.ReservationsRefused-before.ReservationsRefused,
		mid.CircuitsOpened-before.CircuitsOpened, mid.CircuitsRefused-before.CircuitsRefused, mid.Bytes-before.Bytes,
		after.CircuitsOpened-mid.CircuitsOpened, after.Bytes-mid.Bytes)
	if mid.ReservationsGranted != before.ReservationsGranted || mid.CircuitsOpened != before.CircuitsOpened || mid.Bytes != before.Bytes {
		t.Errorf("the relay served outsiders: before %+v, after %+v", before, mid)
	}
	// The relay counts a refusal after answering it, so the last one may
	// not be counted yet: the refusals show the requests reached it.
	if mid.ReservationsRefused == before.ReservationsRefused || mid.CircuitsRefused == before.CircuitsRefused {
		t.Errorf("refusals not counted: before %+v, after %+v", before, mid)
	}
	if after.CircuitsOpened == mid.CircuitsOpened || after.Bytes == mid.Bytes {
		t.Errorf("the joined peer's circuit was not counted: %+v -> %+v", mid, after)
	}
}

// TestAgentTellsStrangersNothing: a stranger that dials an agent's own
// address gets no connection, so no identify; the relay and joined peers
// get only addresses they could use (no loopback or LAN ones).
func TestAgentTellsStrangersNothing(t *testing.T) {
	gr := startGRelay(t, gFastTune, transport.GossipPresetLocal)
	v := relaytest.RunAgent(t, gAgentConfig(t, "victim", relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "victim", VLLMMetrics: true}), filepath.Join(t.TempDir(), "victim.key"), gFastTune, transport.GossipPresetLocal, gr.Addr()))
	relaytest.Within(t, 30*time.Second, "the agent joined", func() bool { return gr.Relay.Registry().IsJoined(v.Agent.ID()) })
	h := v.Agent.Host()
	listen := h.Network().ListenAddresses()
	o := outsiderHost(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// QUIC completes the handshake on the dialer's side before the agent
	// checks the peer and closes the connection: what counts is that it
	// does not stay and that identify never answers.
	_ = o.Connect(ctx, peer.AddrInfo{ID: v.Agent.ID(), Addrs: listen})
	relaytest.Within(t, 5*time.Second, "the agent to drop the stranger's connection", func() bool {
		return o.Network().Connectedness(v.Agent.ID()) != network.Connected
	})
	if _, err := o.Network().NewStream(network.WithNoDial(ctx, "test"), v.Agent.ID()); err == nil {
		t.Error("a stranger holds a connection to the agent")
	}
	if protos, _ := o.Peerstore().GetProtocols(v.Agent.ID()); len(protos) != 0 {
		t.Errorf("a stranger learned the agent's protocols: %v", protos)
	}
	if addrs := o.Peerstore().Addrs(v.Agent.ID()); len(addrs) > len(listen) {
		t.Errorf("a stranger learned addresses: %v", addrs)
	}
	// What the relay learned through identify.
	relaytest.Within(t, 10*time.Second, "identify with the relay", func() bool {
		_, err := gr.Relay.Host().Peerstore().SupportsProtocols(v.Agent.ID(), identify.ID)
		return err == nil
	})
	announced := h.Addrs()
	for _, a := range announced {
		if !transport.IsPublicAddr(a, nil) {
			if _, err := a.ValueForProtocol(0x0122); err != nil { // p2p-circuit
				t.Errorf("agent announces a non-public address %s", a)
			}
		}
	}
	t.Logf("agent listens on %v, announces %v; a stranger's direct dial was refused", listen, announced)
}
