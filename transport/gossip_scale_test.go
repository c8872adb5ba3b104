package transport

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"
)

// TestGossipScale measures convergence, gossip bytes per second per node and
// the detection time of a killed member, in one process over loopback QUIC.
// It runs only with COMPUTEFLUX_GOSSIP_SCALE=1; knobs:
//
//	COMPUTEFLUX_GOSSIP_SIZES   cluster sizes, default "5,50"
//	COMPUTEFLUX_GOSSIP_PRESET  memberlist preset, default "home"
//	COMPUTEFLUX_GOSSIP_KILLS   killed members per size (median taken), default 3
//	COMPUTEFLUX_GOSSIP_WINDOW  steady-state window for bytes/s, default 10s
//	COMPUTEFLUX_GOSSIP_MESH    1 = connect every pair of hosts before joining, so that
//	                           convergence excludes QUIC handshakes (n*(n-1)/2 of them
//	                           share this machine's cores in one process)
//
// Example: COMPUTEFLUX_GOSSIP_SCALE=1 go test -run TestGossipScale -v -timeout 20m ./transport/
func TestGossipScale(t *testing.T) {
	if os.Getenv("COMPUTEFLUX_GOSSIP_SCALE") != "1" {
		t.Skip("set COMPUTEFLUX_GOSSIP_SCALE=1 to measure gossip at scale")
	}
	sizes := []int{5, 50}
	if s := os.Getenv("COMPUTEFLUX_GOSSIP_SIZES"); s != "" {
		sizes = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 3 || n > 200 {
				t.Fatalf("bad size %q (3..200)", f)
			}
			sizes = append(sizes, n)
		}
	}
	preset := envOr("COMPUTEFLUX_GOSSIP_PRESET", GossipPresetHome)
	kills, _ := strconv.Atoi(envOr("COMPUTEFLUX_GOSSIP_KILLS", "3"))
	kills = min(max(kills, 1), 10)
	window, err := time.ParseDuration(envOr("COMPUTEFLUX_GOSSIP_WINDOW", "10s"))
	if err != nil || window <= 0 || window > 5*time.Minute {
		t.Fatalf("bad window %q", os.Getenv("COMPUTEFLUX_GOSSIP_WINDOW"))
	}
	for _, n := range sizes {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			measureGossip(t, n, preset, min(kills, n-2), window)
		})
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func measureGossip(t *testing.T, n int, preset string, kills int, window time.Duration) {
	nodes := newGossipCluster(t, gossipClusterConfig{n: n, preset: preset, tune: nil})
	c := nodes[0].g.MemberlistConfig()
	t.Logf("preset %s: ProbeInterval %v ProbeTimeout %v SuspicionMult %d SuspicionMaxTimeoutMult %d GossipInterval %v GossipNodes %d RetransmitMult %d PushPullInterval %v",
		preset, c.ProbeInterval, c.ProbeTimeout, c.SuspicionMult, c.SuspicionMaxTimeoutMult, c.GossipInterval, c.GossipNodes, c.RetransmitMult, c.PushPullInterval)

	if os.Getenv("COMPUTEFLUX_GOSSIP_MESH") == "1" {
		meshStart := time.Now()
		for i, a := range nodes {
			for _, b := range nodes[i+1:] {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				err := a.h.Connect(ctx, peer.AddrInfo{ID: b.id(), Addrs: b.h.Addrs()})
				cancel()
				if err != nil {
					t.Fatalf("mesh: %v", err)
				}
			}
		}
		t.Logf("n=%d: full mesh of %d connections in %v", n, n*(n-1)/2, time.Since(meshStart))
	}
	start := time.Now()
	for _, nd := range nodes[1:] {
		// A loaded machine can take longer than the stream timeout to dial;
		// an agent retries its join too.
		var err error
		for try := 0; try < 5; try++ {
			if _, err = nd.g.Join(nodes[0].id()); err == nil {
				break
			}
			t.Logf("join retry: %v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	joined := time.Since(start)
	conv := pollUntil(t, 5*time.Minute, "convergence", func() bool { return converged(nodes) })
	t.Logf("n=%d: joins took %v, converged %v after the last join (%v from the first)", n, joined, conv, joined+conv)

	// Steady state: bytes on packets and streams, sent plus received, per node.
	before := make([]GossipStats, n)
	for i, nd := range nodes {
		before[i] = nd.g.Stats()
	}
	ctx, cancel := context.WithTimeout(context.Background(), window)
	<-ctx.Done()
	cancel()
	var sent, recv, pkts, dropped uint64
	for i, nd := range nodes {
		s := nd.g.Stats()
		sent += s.BytesSent - before[i].BytesSent
		recv += s.BytesReceived - before[i].BytesReceived
		pkts += s.PacketsSent - before[i].PacketsSent
		dropped += s.PacketsDropped - before[i].PacketsDropped
	}
	secs := window.Seconds() * float64(n)
	t.Logf("n=%d: per node %.0f B/s sent, %.0f B/s received, %.1f packets/s sent, %d packets dropped in all (window %v)",
		n, float64(sent)/secs, float64(recv)/secs, float64(pkts)/secs, dropped, window)

	// Detection: kill members one at a time (never the seed), without leaving.
	var firstSuspect, firstDead, allDead []time.Duration
	alive := slices.Clone(nodes)
	for k := range kills {
		victim := alive[len(alive)-1]
		alive = alive[:len(alive)-1]
		at := time.Now()
		victim.stop()
		all := pollUntil(t, 5*time.Minute, "detection", func() bool {
			for _, nd := range alive {
				if nd.g.Known(victim.id()) {
					return false
				}
			}
			return true
		})
		fs, fd := earliest(alive, GossipSuspect, victim.id(), at), earliest(alive, GossipDead, victim.id(), at)
		t.Logf("n=%d kill %d: first suspect %v, first dead %v, dead everywhere %v", n, k+1, fs, fd, all)
		firstSuspect, firstDead, allDead = append(firstSuspect, fs), append(firstDead, fd), append(allDead, all)
	}
	t.Logf("n=%d SUMMARY preset=%s converge=%v bytes/s/node=%.0f median: suspect %v, first dead %v, dead everywhere %v (%d kills)",
		n, preset, joined+conv, float64(sent+recv)/secs, median(firstSuspect), median(firstDead), median(allDead), kills)
}

func earliest(nodes []*gossipNode, typ GossipEventType, p peer.ID, since time.Time) time.Duration {
	best := time.Duration(-1)
	for _, nd := range nodes {
		if ev, ok := nd.rec.firstAfter(typ, p, since); ok {
			if d := ev.At.Sub(since); best < 0 || d < best {
				best = d
			}
		}
	}
	return best
}

func median(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkGossipPacket compares the two packet framings: one long-lived
// stream per peer with length-prefixed frames (what the transport does)
// against one short stream per packet. Each op sends a 300-byte packet and
// waits for it to arrive.
func BenchmarkGossipPacket(b *testing.B) {
	for _, mode := range []struct {
		name      string
		perPacket bool
	}{{"long-lived", false}, {"stream-per-packet", true}} {
		b.Run(mode.name, func(b *testing.B) {
			ha, hb := newGossipHost(b), newGossipHost(b)
			defer ha.Close()
			defer hb.Close()
			ha.Peerstore().AddAddrs(hb.ID(), hb.Addrs(), time.Hour)
			all := func(peer.ID) bool { return true }
			ta, err := NewGossipTransport(GossipTransportConfig{Host: ha, Admit: all, Logger: zerolog.Nop(), streamPerPacket: mode.perPacket})
			if err != nil {
				b.Fatal(err)
			}
			defer ta.Shutdown()
			tb, err := NewGossipTransport(GossipTransportConfig{Host: hb, Admit: all, Logger: zerolog.Nop()})
			if err != nil {
				b.Fatal(err)
			}
			defer tb.Shutdown()
			pkt := make([]byte, 300)
			to := addrOf(hb.ID())
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := ta.WriteToAddress(pkt, to); err != nil {
					b.Fatal(err)
				}
				select {
				case <-tb.PacketCh():
				case <-time.After(10 * time.Second):
					b.Fatal("packet lost")
				}
			}
			b.StopTimer()
			st := ta.Stats()
			b.ReportMetric(float64(st.StreamsOpened)/float64(b.N), "streams/op")
		})
	}
}

func addrOf(p peer.ID) memberlist.Address {
	return memberlist.Address{Name: p.String(), Addr: gossipAddrString(p)}
}
