package transport

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/peer"
)

// TestGossipPacketResentAfterPeerReset: a peer that did not admit us yet
// resets our packet stream (a member that joined through the relay gossips
// with others before they have heard of it). Once it admits us, the next
// packet must arrive: the sender notices the dead stream on that write and
// resends the packet on a new stream instead of dropping it.
func TestGossipPacketResentAfterPeerReset(t *testing.T) {
	ha, hb := newGossipHost(t), newGossipHost(t)
	defer ha.Close()
	defer hb.Close()
	var admitted atomic.Bool
	tb, err := NewGossipTransport(GossipTransportConfig{Host: hb, Admit: func(p peer.ID) bool { return p == ha.ID() && admitted.Load() }})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Shutdown()
	ta, err := NewGossipTransport(GossipTransportConfig{Host: ha, Admit: func(peer.ID) bool { return true }})
	if err != nil {
		t.Fatal(err)
	}
	defer ta.Shutdown()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ha.Connect(ctx, peer.AddrInfo{ID: hb.ID(), Addrs: hb.Addrs()}); err != nil {
		t.Fatal(err)
	}
	to := memberlist.Address{Name: hb.ID().String()}

	// The first packet opens a stream that b resets.
	if _, err := ta.WriteToAddress([]byte("before"), to); err != nil {
		t.Fatal(err)
	}
	pollUntil(t, 10*time.Second, "b rejects a's stream", func() bool { return tb.Stats().Rejected > 0 })
	// Let the reset cross loopback, so that a's next write meets it.
	time.Sleep(500 * time.Millisecond)

	admitted.Store(true)
	want := []byte("after")
	if _, err := ta.WriteToAddress(want, to); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-tb.PacketCh():
		if !bytes.Equal(p.Buf, want) {
			t.Fatalf("b got %q, want %q", p.Buf, want)
		}
	case <-ctx.Done():
		t.Fatalf("packet lost after the peer reset the stream; a's stats %+v", ta.Stats())
	}
	if s := ta.Stats(); s.PacketsDropped != 0 || s.StreamsOpened != 2 {
		t.Errorf("a's stats %+v, want no drop and two streams opened", s)
	}
}
