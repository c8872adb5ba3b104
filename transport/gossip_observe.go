package transport

import (
	"bytes"
	"encoding/binary"
	"math"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/libp2p/go-libp2p/core/peer"
)

// Memberlist gives no callback when a member becomes suspect (its Node.State
// is not maintained either), and reports "dead" and "left" through the same
// NotifyLeave. Gossip therefore reads three of memberlist's own messages as
// they cross our transport in either direction, and nothing else:
//
//   - suspect{Incarnation, Node, From}: the member is suspect if the
//     incarnation is not older than the last alive we saw;
//   - alive{Incarnation, Node, ...} with a newer incarnation: the member
//     refuted; it is alive again;
//   - dead{Incarnation, Node, From} with From == Node: the member left, so
//     the NotifyLeave that follows is reported as GossipLeft.
//
// The message numbers and layouts below are memberlist's wire protocol
// (net.go, util.go in v0.7.0; protocol versions 2 to 5). A suspicion
// memberlist resolves without a message we see (learned by push/pull)
// expires after the longest suspicion timeout.
const (
	mlSuspectMsg  = 3
	mlAliveMsg    = 4
	mlDeadMsg     = 5
	mlCompoundMsg = 7
	mlCompressMsg = 9
	mlHasCrcMsg   = 12
	mlLzwLitWidth = 8
	mlMaxDepth    = 3 // a compressed compound of messages, wrapped in a CRC
)

type mlSuspect struct {
	Incarnation uint32
	Node        string
	From        string
}

type mlAlive struct {
	Incarnation uint32
	Node        string
}

type mlDead struct {
	Incarnation uint32
	Node        string
	From        string
}

type mlCompress struct {
	Algo uint8
	Buf  []byte
}

// observe is called by the transport for every packet; it must be cheap and
// never block: pings and acks are skipped on their first byte.
func (g *Gossip) observe(b []byte) {
	g.observeMsg(b, 0)
}

func (g *Gossip) observeMsg(b []byte, depth int) {
	if len(b) == 0 || depth > mlMaxDepth {
		return
	}
	switch b[0] {
	case mlHasCrcMsg:
		if len(b) >= 5 {
			g.observeMsg(b[5:], depth+1)
		}
	case mlCompoundMsg:
		for _, part := range splitCompound(b[1:]) {
			g.observeMsg(part, depth+1)
		}
	case mlCompressMsg:
		// The guard's decoder, with the guard's bound.
		if plain, err := decompressMsg(b[1:]); err == nil {
			g.observeMsg(plain, depth+1)
		}
	case mlSuspectMsg:
		var s mlSuspect
		if mlDecode(b[1:], &s) == nil {
			g.sawSuspect(s.Node, s.Incarnation, time.Now())
		}
	case mlAliveMsg:
		var a mlAlive
		if mlDecode(b[1:], &a) == nil {
			g.sawAlive(a.Node, a.Incarnation, time.Now())
		}
	case mlDeadMsg:
		var d mlDead
		if mlDecode(b[1:], &d) == nil && d.Node == d.From {
			g.sawLeave(d.Node, time.Now())
		}
	}
}

func mlDecode(b []byte, out any) error {
	var h codec.MsgpackHandle
	return codec.NewDecoder(bytes.NewReader(b), &h).Decode(out)
}

// splitCompound splits memberlist's compound message body: a count byte,
// that many big-endian uint16 lengths, then the parts.
func splitCompound(b []byte) [][]byte {
	if len(b) < 1 {
		return nil
	}
	n := int(b[0])
	b = b[1:]
	if len(b) < 2*n {
		return nil
	}
	lens := b[:2*n]
	b = b[2*n:]
	parts := make([][]byte, 0, n)
	for i := range n {
		l := int(binary.BigEndian.Uint16(lens[2*i:]))
		if len(b) < l {
			break
		}
		parts = append(parts, b[:l])
		b = b[l:]
	}
	return parts
}

func (g *Gossip) sawSuspect(name string, inc uint32, now time.Time) {
	p, err := peer.Decode(name)
	if err != nil || p == g.self {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.members[p]
	if e == nil || e.suspect {
		return
	}
	if known, ok := g.incarn[p]; ok && inc < known {
		return // memberlist ignores a suspicion older than the member's last alive
	}
	e.suspect, e.since = true, now
	e.suspectUntil = now.Add(g.maxSuspectLocked())
	g.record(GossipEvent{Type: GossipSuspect, Peer: p, Meta: e.meta, MetaErr: e.metaErr, At: now})
}

func (g *Gossip) sawAlive(name string, inc uint32, now time.Time) {
	p, err := peer.Decode(name)
	if err != nil || p == g.self {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	known, ok := g.incarn[p]
	if ok && inc <= known {
		return
	}
	g.incarn[p] = inc
	if e := g.members[p]; e != nil && e.suspect {
		e.suspect, e.since = false, now
		g.record(GossipEvent{Type: GossipAlive, Peer: p, Meta: e.meta, MetaErr: e.metaErr, At: now})
	}
}

func (g *Gossip) sawLeave(name string, now time.Time) {
	p, err := peer.Decode(name)
	if err != nil || p == g.self {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.members[p]; ok {
		g.leftSeen[p] = now
	}
}

// maxSuspectLocked bounds how long we show a member as suspect without news:
// memberlist's longest suspicion timeout plus a probe interval. It counts
// members from our own table (g.mu held), never asking memberlist, whose
// lock is held when it calls our delegates.
func (g *Gossip) maxSuspectLocked() time.Duration {
	n := float64(len(g.members) + 1)
	base := float64(g.suspicionMult) * math.Max(1, math.Log10(n)) * float64(g.probeInterval)
	return time.Duration(base*float64(g.suspicionMaxMult)) + g.probeInterval
}
