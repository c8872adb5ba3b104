package transport

import (
	"bytes"
	"compress/lzw"
	"encoding/binary"
	"hash/crc32"
	"testing"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"
)

// Encoders that mirror memberlist's (util.go), to feed the observer.
func mlEncode(t *testing.T, typ byte, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	buf.WriteByte(typ)
	var h codec.MsgpackHandle
	if err := codec.NewEncoder(&buf, &h).Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func mlCompound(parts ...[]byte) []byte {
	b := []byte{mlCompoundMsg, byte(len(parts))}
	for _, p := range parts {
		b = binary.BigEndian.AppendUint16(b, uint16(len(p)))
	}
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

func mlCompressed(t *testing.T, b []byte) []byte {
	var z bytes.Buffer
	w := lzw.NewWriter(&z, lzw.LSB, mlLzwLitWidth)
	w.Write(b)
	w.Close()
	return mlEncode(t, mlCompressMsg, &mlCompress{Algo: 0, Buf: z.Bytes()})
}

func mlWithCRC(b []byte) []byte {
	out := []byte{mlHasCrcMsg}
	out = binary.BigEndian.AppendUint32(out, crc32.ChecksumIEEE(b))
	return append(out, b...)
}

func testPeer(t *testing.T) peer.ID {
	_, pub, err := crypto.GenerateEd25519Key(nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := peer.IDFromPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// newObserverGossip is a Gossip with only the state the observer touches.
func newObserverGossip(self peer.ID, members ...peer.ID) *Gossip {
	g := &Gossip{
		self: self, members: map[peer.ID]*gossipEntry{}, incarn: map[peer.ID]uint32{},
		leftSeen: map[peer.ID]time.Time{}, wake: make(chan struct{}, 1),
		suspicionMult: 4, suspicionMaxMult: 4, probeInterval: 2 * time.Second,
	}
	for _, p := range members {
		g.members[p] = &gossipEntry{}
	}
	return g
}

func (g *Gossip) takeEvents() []GossipEventType {
	var out []GossipEventType
	for _, ev := range g.queue {
		out = append(out, ev.Type)
	}
	g.queue = nil
	return out
}

func TestGossipObserverSuspicion(t *testing.T) {
	self, a, b := testPeer(t), testPeer(t), testPeer(t)
	g := newObserverGossip(self, a, b)
	alive := func(p peer.ID, inc uint32) []byte {
		return mlEncode(t, mlAliveMsg, &struct {
			Incarnation uint32
			Node        string
			Addr        []byte
			Port        uint16
			Meta        []byte
			Vsn         []uint8
		}{inc, p.String(), make([]byte, 16), 1234, []byte{1, 0}, []uint8{1, 5, 2, 0, 0, 0}})
	}
	suspect := func(p peer.ID, inc uint32) []byte {
		return mlEncode(t, mlSuspectMsg, &mlSuspect{Incarnation: inc, Node: p.String(), From: self.String()})
	}
	ping := []byte{0, 0x80}

	steps := []struct {
		name string
		pkt  []byte
		want []GossipEventType
	}{
		{"alive sets the incarnation", alive(a, 5), nil},
		{"stale suspicion ignored", suspect(a, 4), nil},
		{"ping skipped", ping, nil},
		{"suspicion in a compressed compound with CRC", mlWithCRC(mlCompressed(t, mlCompound(ping, suspect(a, 5)))), []GossipEventType{GossipSuspect}},
		{"repeated suspicion", suspect(a, 5), nil},
		{"same incarnation does not refute", alive(a, 5), nil},
		{"refutation", mlCompound(alive(a, 6)), []GossipEventType{GossipAlive}},
		{"suspicion of ourselves ignored", suspect(self, 9), nil},
		{"unknown member ignored", suspect(testPeer(t), 0), nil},
		{"garbage", []byte{mlCompoundMsg, 9, 1}, nil},
	}
	for _, s := range steps {
		g.observe(s.pkt)
		if got := g.takeEvents(); len(got) != len(s.want) || (len(got) > 0 && got[0] != s.want[0]) {
			t.Fatalf("%s: events %v, want %v", s.name, got, s.want)
		}
	}

	// A suspicion nobody resolves for us expires.
	g.observe(suspect(b, 0))
	if got := g.takeEvents(); len(got) != 1 || got[0] != GossipSuspect {
		t.Fatalf("suspect b: %v", got)
	}
	g.expireSuspicion(time.Now())
	if got := g.takeEvents(); len(got) != 0 {
		t.Fatalf("expired too early: %v", got)
	}
	g.expireSuspicion(time.Now().Add(g.maxSuspectLocked() + time.Second))
	if got := g.takeEvents(); len(got) != 1 || got[0] != GossipAlive {
		t.Fatalf("expiry: %v", got)
	}

	// A dead message from the member itself marks a leave.
	g.observe(mlEncode(t, mlDeadMsg, &mlDead{Incarnation: 7, Node: b.String(), From: b.String()}))
	g.observe(mlEncode(t, mlDeadMsg, &mlDead{Incarnation: 7, Node: a.String(), From: b.String()}))
	if _, ok := g.leftSeen[b]; !ok {
		t.Error("leave not recorded")
	}
	if _, ok := g.leftSeen[a]; ok {
		t.Error("a death reported by another member recorded as a leave")
	}
}

func FuzzGossipObserve(f *testing.F) {
	f.Add([]byte{mlCompoundMsg, 2, 0, 1, 0, 1, 0, 0})
	f.Add([]byte{mlHasCrcMsg, 0, 0, 0, 0, mlSuspectMsg, 0x80})
	f.Add([]byte{mlCompressMsg, 0x82})
	self := peer.ID("self")
	f.Fuzz(func(t *testing.T, b []byte) {
		g := newObserverGossip(self)
		g.observe(b) // must not panic
	})
}

func TestGossipConfigDefaultsAndValidation(t *testing.T) {
	var c GossipConfig
	c.populate()
	if c.Preset != GossipPresetHome || c.MetaInterval != time.Second || c.MetaRefresh != 10*time.Second || c.MetaSource == nil || c.OnEvent == nil {
		t.Fatalf("defaults: %+v", c)
	}
	if err := c.validate(); err == nil {
		t.Fatal("no host, no admit: accepted")
	}
	for _, name := range []string{"", GossipPresetHome, GossipPresetWAN, GossipPresetLAN, GossipPresetLocal} {
		mc, err := gossipPreset(name)
		if err != nil || mc.ProbeTimeout >= mc.ProbeInterval {
			t.Errorf("preset %q: %v", name, err)
		}
	}
	if _, err := gossipPreset("fast"); err == nil {
		t.Error("unknown preset accepted")
	}
	home, _ := gossipPreset(GossipPresetHome)
	if home.ProbeInterval != 2*time.Second || home.SuspicionMult != 4 {
		t.Errorf("home preset changed: %v %d", home.ProbeInterval, home.SuspicionMult)
	}
}

func TestMemberlistLogLevels(t *testing.T) {
	var buf bytes.Buffer
	w := memberlistLogWriter{zerolog.New(&buf)}
	w.Write([]byte("[WARN] memberlist: Was able to connect to x but other probes failed\n"))
	w.Write([]byte("[DEBUG] memberlist: Stream connection from=y\n"))
	got := buf.String()
	if !bytes.Contains([]byte(got), []byte(`{"level":"warn","message":"Was able to connect to x but other probes failed"}`)) ||
		!bytes.Contains([]byte(got), []byte(`{"level":"debug","message":"Stream connection from=y"}`)) {
		t.Fatalf("log lines: %s", got)
	}
}
