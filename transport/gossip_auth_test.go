package transport

import (
	"bufio"
	"bytes"
	"io"
	"math"
	"testing"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/peer"
)

func testPeerID(t testing.TB) peer.ID {
	t.Helper()
	_, pub, err := crypto.GenerateEd25519Key(nil)
	if err != nil {
		t.Fatal(err)
	}
	id, err := peer.IDFromPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func mlMsg(t testing.TB, typ byte, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	buf.WriteByte(typ)
	if err := codec.NewEncoder(&buf, &codec.MsgpackHandle{}).Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func aliveMsg(t testing.TB, node peer.ID, inc uint32) []byte {
	type alive struct {
		Incarnation uint32
		Node        string
		Meta        []byte
	}
	return mlMsg(t, mlAliveMsg, alive{Incarnation: inc, Node: node.String(), Meta: []byte("m")})
}

func claimMsg(t testing.TB, typ byte, node, from peer.ID, inc uint32) []byte {
	return mlMsg(t, typ, mlDead{Incarnation: inc, Node: node.String(), From: from.String()})
}

func TestGossipGuardPackets(t *testing.T) {
	self, relay, a, b := testPeerID(t), testPeerID(t), testPeerID(t), testPeerID(t)
	ping := []byte{mlPingMsg, 0x80}
	cases := []struct {
		name   string
		from   peer.ID
		pkt    []byte
		want   []byte // nil: dropped whole
		forged bool
	}{
		{"own alive", a, aliveMsg(t, a, 3), aliveMsg(t, a, 3), false},
		{"own leave", a, claimMsg(t, mlDeadMsg, a, a, 3), claimMsg(t, mlDeadMsg, a, a, 3), false},
		{"alive about another", a, aliveMsg(t, b, 3), nil, false},
		{"leave of another", a, claimMsg(t, mlDeadMsg, b, b, 3), nil, false},
		{"dead about another", a, claimMsg(t, mlDeadMsg, b, a, 3), nil, false},
		{"suspect about another", a, claimMsg(t, mlSuspectMsg, b, a, 3), nil, false},
		{"suspect about us", a, claimMsg(t, mlSuspectMsg, self, a, 3), nil, false},
		{"alive about another at the wrap", a, aliveMsg(t, b, math.MaxUint32), nil, true},
		{"dead about another at the wrap", a, claimMsg(t, mlDeadMsg, b, a, math.MaxUint32), nil, true},
		{"suspect about us at the wrap", a, claimMsg(t, mlSuspectMsg, self, a, math.MaxUint32), nil, true},
		{"own alive at the wrap", a, aliveMsg(t, a, math.MaxUint32), nil, true},
		{"far above what the member announced", a, aliveMsg(t, b, gossipForgeGap+10), nil, true},
		{"trusted about another", relay, claimMsg(t, mlSuspectMsg, b, relay, 3), claimMsg(t, mlSuspectMsg, b, relay, 3), false},
		{"trusted about us", relay, claimMsg(t, mlSuspectMsg, self, relay, 3), claimMsg(t, mlSuspectMsg, self, relay, 3), false},
		{"trusted at the wrap", relay, aliveMsg(t, b, math.MaxUint32), nil, true},
		{"probe", a, ping, ping, false},
		{"compound kept whole", a, compoundMessage([][]byte{ping, aliveMsg(t, a, 4)}), compoundMessage([][]byte{ping, aliveMsg(t, a, 4)}), false},
		{"compound with one forged part", a, compoundMessage([][]byte{ping, aliveMsg(t, b, 4), aliveMsg(t, a, 4)}), compoundMessage([][]byte{ping, aliveMsg(t, a, 4)}), false},
		{"compound down to one part", a, compoundMessage([][]byte{claimMsg(t, mlDeadMsg, b, a, 4), ping}), ping, false},
		{"garbage alive", a, []byte{mlAliveMsg, 0xc1}, nil, false},
		{"truncated compound", a, []byte{mlCompoundMsg, 3, 0, 1}, nil, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			gd := newGossipGuard(self, []peer.ID{relay})
			gd.mu.Lock()
			gd.known[b] = 3
			gd.mu.Unlock()
			out, forged := gd.filterPacket(c.from, c.pkt)
			if !bytes.Equal(out, c.want) {
				t.Errorf("out %x, want %x", out, c.want)
			}
			if (forged != "") != c.forged {
				t.Errorf("forged %q, want forged=%v", forged, c.forged)
			}
		})
	}
}

func TestGossipGuardForwardsOwnClaims(t *testing.T) {
	self, relay, a := testPeerID(t), testPeerID(t), testPeerID(t)
	gd := newGossipGuard(self, []peer.ID{relay})
	pkt := compoundMessage([][]byte{{mlPingMsg, 0x80}, aliveMsg(t, self, 7)})
	fwd := gd.outgoing(a, pkt)
	if len(fwd[relay]) != 1 || !bytes.Equal(fwd[relay][0], aliveMsg(t, self, 7)) {
		t.Fatalf("forwarded %x", fwd)
	}
	if gd.selfInc != 7 {
		t.Errorf("own incarnation %d, want 7", gd.selfInc)
	}
	if fwd := gd.outgoing(a, pkt); len(fwd) != 0 {
		t.Errorf("the same alive forwarded twice: %x", fwd)
	}
	if fwd := gd.outgoing(relay, aliveMsg(t, self, 8)); len(fwd) != 0 {
		t.Errorf("forwarded to the relay what it gets directly: %x", fwd)
	}
	if fwd := gd.outgoing(a, claimMsg(t, mlDeadMsg, self, self, 9)); len(fwd[relay]) != 1 {
		t.Errorf("our leave not forwarded: %x", fwd)
	}
}

// Another member's suspicion or death of us reaches memberlist, which
// refutes it, only at our current incarnation and at most once per
// gossipRefuteGap.
func TestGossipGuardLetsUsRefute(t *testing.T) {
	self, a, b := testPeerID(t), testPeerID(t), testPeerID(t)
	gd := newGossipGuard(self, nil)
	gd.selfInc = 5
	rewind := func() { gd.mu.Lock(); gd.refutedAt = time.Time{}; gd.mu.Unlock() }
	for _, c := range []struct {
		name   string
		rewind bool
		pkt    []byte
		kept   bool
	}{
		{"suspicion at our incarnation", true, claimMsg(t, mlSuspectMsg, self, a, 5), true},
		{"a second one at once, from another member", false, claimMsg(t, mlSuspectMsg, self, b, 5), false},
		{"death at our incarnation", true, claimMsg(t, mlDeadMsg, self, a, 5), true},
		{"suspicion at an older incarnation", true, claimMsg(t, mlSuspectMsg, self, a, 4), false},
		{"suspicion at a newer incarnation", true, claimMsg(t, mlSuspectMsg, self, a, 6), false},
		{"alive about us", true, aliveMsg(t, self, 5), false},
	} {
		if c.rewind {
			rewind()
		}
		out, forged := gd.filterPacket(a, c.pkt)
		if (out != nil) != c.kept || forged != "" {
			t.Errorf("%s: kept %v (forged %q), want kept %v", c.name, out != nil, forged, c.kept)
		}
	}
	rewind()
	suspect := mlPushNodeState{Name: self.String(), Incarnation: 5, State: mlStateSuspect}
	for i, want := range []int{1, 0} { // the second inside the gap
		r := &guardedReader{gd: gd, from: a, src: bufio.NewReader(bytes.NewReader(pushPull(t, suspect)))}
		got, err := io.ReadAll(r)
		if err != nil {
			t.Fatal(err)
		}
		var hdr mlPushPullHeader
		if err := codec.NewDecoder(bytes.NewReader(got[1:]), &codec.MsgpackHandle{}).Decode(&hdr); err != nil || hdr.Nodes != want {
			t.Errorf("push/pull %d: %d states about us kept (%v), want %d", i, hdr.Nodes, err, want)
		}
	}
}

func pushPull(t testing.TB, states ...mlPushNodeState) []byte {
	var buf bytes.Buffer
	buf.WriteByte(mlPushPullMsg)
	enc := codec.NewEncoder(&buf, &codec.MsgpackHandle{})
	if err := enc.Encode(&mlPushPullHeader{Nodes: len(states), UserStateLen: 2}); err != nil {
		t.Fatal(err)
	}
	for i := range states {
		if err := enc.Encode(&states[i]); err != nil {
			t.Fatal(err)
		}
	}
	buf.WriteString("us")
	buf.WriteString("rest")
	return buf.Bytes()
}

func TestGossipGuardPushPull(t *testing.T) {
	self, a, b := testPeerID(t), testPeerID(t), testPeerID(t)
	own := mlPushNodeState{Name: a.String(), Addr: []byte{1}, Port: 9, Meta: []byte("m"), Incarnation: 4, State: mlStateAlive, Vsn: []uint8{1, 5, 2, 0, 0, 0}}
	other := mlPushNodeState{Name: b.String(), Incarnation: 9, State: 2}
	forged := mlPushNodeState{Name: b.String(), Incarnation: math.MaxUint32, State: mlStateAlive}
	for _, c := range []struct {
		name   string
		in     []mlPushNodeState
		keep   int
		forged bool
	}{
		{"own state kept, others dropped", []mlPushNodeState{other, own}, 1, false},
		{"forged incarnation", []mlPushNodeState{own, forged}, 1, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			gd := newGossipGuard(self, nil)
			var reason string
			r := &guardedReader{gd: gd, from: a, src: bufio.NewReader(bytes.NewReader(pushPull(t, c.in...))), onForged: func(_ peer.ID, why string) { reason = why }}
			got, err := io.ReadAll(r)
			if err != nil {
				t.Fatal(err)
			}
			if (reason != "") != c.forged {
				t.Errorf("forged %q, want %v", reason, c.forged)
			}
			dec := codec.NewDecoder(bytes.NewReader(got[1:]), &codec.MsgpackHandle{})
			var hdr mlPushPullHeader
			if got[0] != mlPushPullMsg || dec.Decode(&hdr) != nil || hdr.Nodes != c.keep || hdr.UserStateLen != 2 {
				t.Fatalf("header %+v", hdr)
			}
			var s mlPushNodeState
			if err := dec.Decode(&s); err != nil || s.Name != a.String() || s.Incarnation != 4 || !bytes.Equal(s.Meta, []byte("m")) || s.Port != 9 || len(s.Vsn) != 6 {
				t.Fatalf("kept %+v (%v)", s, err)
			}
			if !bytes.HasSuffix(got, []byte("usrest")) {
				t.Errorf("user state and the rest of the stream lost: %q", got)
			}
		})
	}
}

// FuzzGossipGuard feeds arbitrary packets and streams to the guard: it
// must not panic, and what it lets through from an untrusted member never
// carries a claim about another member.
func FuzzGossipGuard(f *testing.F) {
	self, a, b := testPeerID(f), testPeerID(f), testPeerID(f)
	f.Add(aliveMsg(f, a, 3))
	f.Add(compoundMessage([][]byte{{mlPingMsg, 0x80}, aliveMsg(f, b, 4), claimMsg(f, mlDeadMsg, b, a, 1)}))
	f.Add(pushPull(f, mlPushNodeState{Name: a.String(), Incarnation: 1}, mlPushNodeState{Name: b.String(), Incarnation: 1}))
	f.Add([]byte{mlHasCrcMsg, 0, 0, 0, 0, mlPingMsg})
	f.Fuzz(func(t *testing.T, b []byte) {
		gd := newGossipGuard(self, nil)
		out, _ := gd.filterPacket(a, b)
		if out != nil && !bytes.Equal(out, b) {
			// A rebuilt packet passes the guard unchanged.
			if again, _ := gd.filterPacket(a, out); !bytes.Equal(again, out) {
				t.Fatalf("rebuilt packet %x filtered again to %x", out, again)
			}
		}
		r := &guardedReader{gd: gd, from: a, src: bufio.NewReader(bytes.NewReader(b))}
		_, _ = io.ReadAll(io.LimitReader(r, 1<<20))
	})
}
