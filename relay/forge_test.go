package relay_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/transport"
)

// These tests attack a relay and a real agent (package agent) from a token
// holder: a peer that joined with the secret, runs a real gossip member, and
// also writes memberlist messages of its own making on the gossip packet
// protocol, to the relay and (through the relay's circuit) to the victim.

// attackWindow is how long the repeated attacks last: short by default,
// COMPUTEFLUX_ATTACK_WINDOW (a Go duration, e.g. 60s) for the full run.
func attackWindow(t *testing.T) time.Duration {
	if s := os.Getenv("COMPUTEFLUX_ATTACK_WINDOW"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("COMPUTEFLUX_ATTACK_WINDOW: %v", err)
		}
		return d
	}
	return 5 * time.Second
}

// memberlist message types and wire shapes (memberlist v0.7.0 net.go).
const (
	mlSuspect  = 3
	mlAlive    = 4
	mlDead     = 5
	mlCompound = 7
)

type mlAliveMsg struct {
	Incarnation uint32
	Node        string
	Addr        []byte
	Port        uint16
	Meta        []byte
	Vsn         []uint8
}

type mlClaimMsg struct {
	Incarnation uint32
	Node        string
	From        string
}

func mlEncode(t testing.TB, typ byte, v any) []byte {
	var buf bytes.Buffer
	buf.WriteByte(typ)
	if err := codec.NewEncoder(&buf, &codec.MsgpackHandle{}).Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// mallory is a token holder that forges gossip.
type mallory struct {
	h  host.Host
	m  *transport.Membership
	g  *transport.Gossip
	mu sync.Mutex
	st map[peer.ID]network.Stream
}

func newMallory(t *testing.T, gr *relaytest.Relay) *mallory {
	t.Helper()
	h := newHost(t)
	ri := gr.Info()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.Connect(ctx, ri); err != nil {
		t.Fatal(err)
	}
	m, err := transport.Join(ctx, h, ri.ID, []byte(gToken), transport.JoinInfo{Name: "mallory", Models: []string{"m-other"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	g, err := transport.NewGossip(transport.GossipConfig{
		Host: h, Logger: zerolog.Nop(), Preset: transport.GossipPresetLocal, Tune: gFastTune,
		Admit: func(p peer.ID) bool { return p == ri.ID }, AdmitMembers: true, Trusted: []peer.ID{ri.ID},
		Resolve:    func(p peer.ID) []ma.Multiaddr { return transport.CircuitAddrs(ri, p) },
		MetaSource: func() transport.NodeMeta { return transport.NodeMeta{Role: transport.NodeRoleAgent, Name: "mallory"} },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Shutdown() })
	if _, err := g.Join(ri.ID); err != nil {
		t.Fatal(err)
	}
	return &mallory{h: h, m: m, g: g, st: make(map[peer.ID]network.Stream)}
}

// send writes one memberlist packet to p on a packet stream of its own.
func (ml *mallory) send(p peer.ID, addrs func() []ma.Multiaddr, msg []byte) error {
	ml.mu.Lock()
	defer ml.mu.Unlock()
	st := ml.st[p]
	if st == nil {
		ctx, cancel := context.WithTimeout(network.WithAllowLimitedConn(context.Background(), "attack"), 5*time.Second)
		defer cancel()
		if addrs != nil && ml.h.Network().Connectedness(p) != network.Connected && ml.h.Network().Connectedness(p) != network.Limited {
			if err := ml.h.Connect(ctx, peer.AddrInfo{ID: p, Addrs: addrs()}); err != nil {
				return err
			}
		}
		var err error
		if st, err = ml.h.NewStream(ctx, p, transport.GossipPacketProtocol); err != nil {
			return err
		}
		ml.st[p] = st
	}
	frame := binary.BigEndian.AppendUint16(nil, uint16(len(msg)))
	_ = st.SetWriteDeadline(time.Now().Add(2 * time.Second))
	if _, err := st.Write(append(frame, msg...)); err != nil {
		st.Reset()
		delete(ml.st, p)
		return err
	}
	return nil
}

// forgery is one attack message about the victim.
type forgery struct {
	name string
	inc  uint32
	msg  func(t testing.TB, victim, attacker peer.ID, inc uint32) []byte
}

func forgedAlive(t testing.TB, victim, _ peer.ID, inc uint32) []byte {
	meta, err := transport.EncodeMeta(transport.NodeMeta{Role: transport.NodeRoleAgent, Name: "victim", Models: []string{"m-other"}, Draining: true, Unavailable: true, Seq: 1 << 30}, transport.MetaMaxSize)
	if err != nil {
		t.Fatal(err)
	}
	ip, port := transport.GossipAddr(victim)
	return mlEncode(t, mlAlive, mlAliveMsg{Incarnation: inc, Node: victim.String(), Addr: ip, Port: uint16(port), Meta: meta, Vsn: []uint8{1, 5, 2, 0, 0, 0}})
}

func forgedDead(t testing.TB, victim, attacker peer.ID, inc uint32) []byte {
	return mlEncode(t, mlDead, mlClaimMsg{Incarnation: inc, Node: victim.String(), From: attacker.String()})
}

func forgedLeave(t testing.TB, victim, _ peer.ID, inc uint32) []byte {
	return mlEncode(t, mlDead, mlClaimMsg{Incarnation: inc, Node: victim.String(), From: victim.String()})
}

func forgedSuspect(t testing.TB, victim, attacker peer.ID, inc uint32) []byte {
	return mlEncode(t, mlSuspect, mlClaimMsg{Incarnation: inc, Node: victim.String(), From: attacker.String()})
}

// forgedCompound hides a forged alive and leave among a real-looking
// compound message.
func forgedCompound(t testing.TB, victim, attacker peer.ID, inc uint32) []byte {
	parts := [][]byte{forgedAlive(t, victim, attacker, inc), forgedLeave(t, victim, attacker, inc)}
	out := []byte{mlCompound, byte(len(parts))}
	for _, p := range parts {
		out = binary.BigEndian.AppendUint16(out, uint16(len(p)))
	}
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// attackLoad sends chat requests for the victim's model until stop closes
// and counts them; with each request it also samples whether the relay's
// gossip still holds the victim alive with its own metadata (healthy).
func attackLoad(gr *relaytest.Relay, victim peer.ID, stop <-chan struct{}) (ok, total, healthy *atomic.Int64, done <-chan struct{}) {
	ok, total, healthy = new(atomic.Int64), new(atomic.Int64), new(atomic.Int64)
	d := make(chan struct{})
	go func() {
		defer close(d)
		hc := &http.Client{Timeout: 5 * time.Second}
		defer hc.CloseIdleConnections()
		for i := 0; i < 100000; i++ {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			total.Add(1)
			if victimHealthy(gr, victim) {
				healthy.Add(1)
			}
			resp, err := hc.Post(gr.URL+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"m1","messages":[{"role":"user","content":"hi"}]}`))
			if err != nil {
				continue
			}
			resp.Body.Close()
			if resp.StatusCode == 200 && resp.Header.Get(relay.HeaderAgent) == "victim" {
				ok.Add(1)
			}
		}
	}()
	return ok, total, healthy, d
}

// victimHealthy reports whether the relay routes to the victim and its
// gossip lists it alive with its own metadata.
func victimHealthy(gr *relaytest.Relay, victim peer.ID) bool {
	if !routable(gr, "victim") {
		return false
	}
	for _, m := range gr.Relay.Gossip().Members() {
		if m.Peer == victim {
			return !m.Suspect && m.Meta.Name == "victim" && !m.Meta.Draining && !m.Meta.Unavailable
		}
	}
	return false
}

func TestForgedGossipAboutAnotherAgent(t *testing.T) {
	slow.Gate(t, "waits on gossip rounds over QUIC")
	t.Parallel() // waits on gossip timers, in its own relay and agents
	gr := startGRelay(t, gFastTune, transport.GossipPresetLocal)
	dir := t.TempDir()
	v := relaytest.RunAgent(t, gAgentConfig(t, "victim", relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "victim", VLLMMetrics: true}), filepath.Join(dir, "victim.key"), gFastTune, transport.GossipPresetLocal, gr.Addr()))
	relaytest.Within(t, 30*time.Second, "the victim alive in the relay's gossip", func() bool { return victimHealthy(gr, v.Agent.ID()) })
	probe := gr.Relay.Gossip().MemberlistConfig().ProbeInterval
	window := attackWindow(t)
	ri := gr.Info()
	victimAddrs := func() []ma.Multiaddr { return transport.CircuitAddrs(ri, v.Agent.ID()) }

	// Below the forgery bar: believed by nobody, but not proof of forgery
	// either (an honest member may pass on a claim it heard), so the
	// attacker keeps going for the whole window.
	low := []forgery{
		{"alive with other metadata", 0, forgedAlive},
		{"dead", 0, forgedDead},
		{"leave", 0, forgedLeave},
		{"suspect", 0, forgedSuspect},
		{"compound alive and leave", 0, forgedCompound},
	}
	for _, f := range low {
		// From the start, and from far above any incarnation the victim
		// reached (yet below the forgery bar), each send newer than the
		// victim's refutation of the previous one.
		for _, inc := range []uint32{1, 1 << 20} {
			t.Run(fmt.Sprintf("%s at %d every 500ms", f.name, inc), func(t *testing.T) {
				ml := newMallory(t, gr)
				relaytest.Within(t, 30*time.Second, "the victim to know the attacker", func() bool { return v.Agent.Gossip().Known(ml.h.ID()) })
				stop := make(chan struct{})
				ok, total, healthy, loadDone := attackLoad(gr, v.Agent.ID(), stop)
				start := time.Now()
				sent, toVictim := 0, 0
				for time.Since(start) < window {
					msg := f.msg(t, v.Agent.ID(), ml.h.ID(), inc+uint32(2*sent))
					if err := ml.send(ri.ID, nil, msg); err != nil {
						t.Fatalf("send to relay: %v", err)
					}
					sent++
					if err := ml.send(v.Agent.ID(), victimAddrs, msg); err == nil {
						toVictim++
					}
					time.Sleep(500 * time.Millisecond)
				}
				stopped := time.Now()
				back := relaytest.Within(t, 30*time.Second, "the victim healthy after the attack", func() bool { return victimHealthy(gr, v.Agent.ID()) })
				close(stop)
				<-loadDone
				rate := float64(ok.Load()) / float64(max(total.Load(), 1))
				hrate := float64(healthy.Load()) / float64(max(total.Load(), 1))
				t.Logf("%s at incarnation %d: %d packets to the relay, %d to the victim over %v; victim served %d/%d (%.2f%%), healthy in the relay's gossip in %.2f%% of samples; healthy %v after the attack stopped (probe period %v); relay filtered %d",
					f.name, inc, sent, toVictim, stopped.Sub(start).Round(time.Millisecond), ok.Load(), total.Load(), 100*rate, 100*hrate, back.Round(time.Millisecond), probe, gr.Relay.Gossip().Stats().Filtered)
				if rate < 0.99 {
					t.Errorf("victim served %.2f%% of requests under attack, want >= 99%%", 100*rate)
				}
				if hrate < 0.99 {
					t.Errorf("victim healthy in the relay's gossip in %.2f%% of samples under attack, want >= 99%%", 100*hrate)
				}
				if back > probe {
					t.Errorf("victim healthy %v after the attack, want within one probe period (%v)", back, probe)
				}
				if toVictim == 0 {
					t.Errorf("no forged packet reached the victim: the attack did not run")
				}
			})
		}
	}

	// At the wrap: proof of forgery. The first packet gets the attacker
	// cut off: logged, registration gone, joins refused, gossip reset.
	for _, f := range []forgery{
		{"alive with other metadata", math.MaxUint32, forgedAlive},
		{"dead", math.MaxUint32, forgedDead},
		{"leave", math.MaxUint32, forgedLeave},
		{"suspect", math.MaxUint32, forgedSuspect},
		{"compound alive and leave", math.MaxUint32, forgedCompound},
	} {
		t.Run(f.name+" at 2^32-1 cuts the attacker off", func(t *testing.T) {
			ml := newMallory(t, gr)
			forgeries := metric(t, gr, "computeflux_gossip_forgeries_total")
			stop := make(chan struct{})
			ok, total, healthy, loadDone := attackLoad(gr, v.Agent.ID(), stop)
			start := time.Now()
			var sent int
			var sendErr error
			for time.Since(start) < window && sendErr == nil {
				if sendErr = ml.send(ri.ID, nil, f.msg(t, v.Agent.ID(), ml.h.ID(), f.inc)); sendErr == nil {
					sent++
				}
				time.Sleep(500 * time.Millisecond)
			}
			cut := relaytest.Within(t, 10*time.Second, "the attacker's registration to end", func() bool { return !gr.Relay.Registry().IsJoined(ml.h.ID()) })
			if sent == 0 {
				t.Fatalf("no forged packet was sent (%v): the cut-off proves nothing", sendErr)
			}
			if got := metric(t, gr, "computeflux_gossip_forgeries_total"); got <= forgeries {
				t.Errorf("forgeries counted %v, %v before the attack: the registration ended, but not for forgery", got, forgeries)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = ml.h.Connect(ctx, ri)
			_, err := transport.Join(ctx, ml.h, ri.ID, []byte(gToken), transport.JoinInfo{Name: "mallory-again"})
			var rej *transport.RejectedError
			if !errors.As(err, &rej) || !strings.Contains(rej.Reason, relay.ErrBanned.Error()) {
				t.Errorf("the cut-off attacker's join again: %v, want refused with %q", err, relay.ErrBanned)
			}
			back := relaytest.Within(t, 30*time.Second, "the victim healthy", func() bool { return victimHealthy(gr, v.Agent.ID()) })
			time.Sleep(time.Second)
			close(stop)
			<-loadDone
			rate := float64(ok.Load()) / float64(max(total.Load(), 1))
			hrate := float64(healthy.Load()) / float64(max(total.Load(), 1))
			t.Logf("%s at 2^32-1: %d packets accepted before the cut-off (%v); rejoin: %v; victim served %d/%d (%.2f%%), healthy in %.2f%% of samples, healthy %v after", f.name, sent, cut.Round(time.Millisecond), err, ok.Load(), total.Load(), 100*rate, 100*hrate, back.Round(time.Millisecond))
			if rate < 0.99 {
				t.Errorf("victim served %.2f%%, want >= 99%%", 100*rate)
			}
			if hrate < 0.99 {
				t.Errorf("victim healthy in the relay's gossip in %.2f%% of samples, want >= 99%%", 100*hrate)
			}
			if back > probe {
				t.Errorf("victim healthy %v after the attack, want within %v", back, probe)
			}
		})
	}

	t.Run("victim restarts during an attack", func(t *testing.T) {
		ml := newMallory(t, gr)
		victim := v.Agent.ID() // the same identity after the restart
		stop := make(chan struct{})
		attackDone := make(chan struct{})
		go func() {
			defer close(attackDone)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-time.After(500 * time.Millisecond):
				}
				f := low[i%len(low)]
				_ = ml.send(ri.ID, nil, f.msg(t, victim, ml.h.ID(), uint32(1+i%64)))
			}
		}()
		defer func() { close(stop); <-attackDone }()
		time.Sleep(time.Second)
		v.Stop()
		relaytest.Within(t, 30*time.Second, "the victim's registration to end", func() bool { return !gr.Relay.Registry().IsJoined(v.Agent.ID()) })
		time.Sleep(time.Second)
		v = relaytest.RunAgent(t, v.Config)
		relaytest.Within(t, 30*time.Second, "the victim to join again", func() bool { return gr.Relay.Registry().IsJoined(v.Agent.ID()) })
		took := relaytest.Within(t, 10*time.Second, "the restarted victim routable", func() bool { return routable(gr, "victim") })
		served := servedBy(t, gr, 5)
		gossipTook := relaytest.Within(t, 30*time.Second, "the restarted victim alive in the relay's gossip", func() bool { return victimHealthy(gr, v.Agent.ID()) })
		t.Logf("restarted victim routable %v after its join, under attack (alive with its metadata in the relay's gossip after %v); served %v",
			took.Round(time.Millisecond), gossipTook.Round(time.Millisecond), served)
		if took > 2*time.Second {
			t.Errorf("restarted victim routable %v after its join, want within 2 s", took)
		}
		if served["victim"] != 5 {
			t.Errorf("restarted victim served %v", served)
		}
	})
}
