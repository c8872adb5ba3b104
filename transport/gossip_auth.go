package transport

import (
	"bufio"
	"bytes"
	"compress/lzw"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"sync"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/libp2p/go-libp2p/core/peer"
)

// Who may say what about whom.
//
// Memberlist believes any member about any member: one packet claiming that
// member X is alive at incarnation 2^32-1 with other metadata, or dead, left
// or suspect, is accepted and spread, and memberlist v0.7.0's refutation
// wraps its uint32 incarnation to 0 against 2^32-1, so X can never refute.
// Every packet and stream our transport delivers comes from a peer that
// libp2p authenticated, so the transport checks each claim against its
// sender before memberlist sees it (gossipGuard):
//
//   - a member's own state (alive with its metadata, its leave) counts only
//     when the member itself sends it: first-hand;
//   - any claim about another member (alive, suspect, dead, push/pull
//     state) counts only from a trusted member (GossipConfig.Trusted: an
//     agent trusts its relay, a relay its peer relays), which passes on only
//     what it accepted itself;
//   - claims about ourselves from others are dropped, so nobody makes us
//     refute to an incarnation of their choosing, with one exception: a
//     suspicion (or death) of us at exactly our current incarnation, at
//     most one per gossipRefuteGap, which memberlist refutes with the next
//     one; and no incarnation at or above gossipIncCeiling is accepted
//     from anyone.
//
// Dropped third-party claims lose nothing an honest member needs: the
// trusted members hear every member first-hand (a member's transport also
// forwards its own alive and leave to them, whoever memberlist picked) and
// spread it. Suspicion raised by an ordinary member's failed probe stays
// that member's own view (the relay routes on its own probes), but it
// reaches the suspect, in the suspecter's gossip or push/pull, and the
// suspect refutes it as SWIM intends. Without that, one agent's probes lost
// on a loaded box or a lossy path would always end with it declaring
// another agent dead, healed only when memberlist forgets the dead member
// and hears of it afresh. The exception gives nothing away: a claim at our
// current incarnation is one any member that heard our alive can make, the
// refutation's incarnation is ours to pick (one more), and the rate bound
// keeps a member that spams such claims from walking us towards the wrap
// (2^32 refutations at one a second are 136 years).
//
// A claim that no honest member can make (an incarnation at the wrap, or far
// above any its subject ever announced) proves the sender forges; the
// transport resets its packet stream and reports it (GossipConfig.OnForged),
// and Gossip stops admitting it. Claims below that bar are only dropped: an
// honest member may pass on what it heard.
//
// Signing each member's metadata (for example with its libp2p key over
// incarnation and metadata) was the alternative: memberlist asks for the
// metadata before it picks the incarnation and re-sends the same metadata
// with a new incarnation when it refutes, so such a signature cannot cover
// the incarnation without rewriting memberlist's own messages, and one
// that does not cover it lets a replayed old state pin an agent at 2^32-1.

const (
	mlPingMsg      = 0
	mlAckMsg       = 2
	mlPushPullMsg  = 6
	mlStateAlive   = 0
	mlStateSuspect = 1
	mlStateDead    = 2
	// mlMaxParts is the most parts memberlist puts in one compound message.
	mlMaxParts = 255
	// mlMaxDecompressed bounds what one compressed message may expand to
	// (memberlist's own bound is 40 MiB; ours carries push/pull states of a
	// few thousand members).
	mlMaxDecompressed = 16 << 20
	// mlMaxPushNodes bounds the states one push/pull may carry.
	mlMaxPushNodes = 1 << 16
)

// gossipForgeGap is how far above the highest incarnation a member ever
// announced a claim about it must be to prove a forgery: a member bumps its
// incarnation about once per metadata change or refutation, so 2^24 is
// years of honest bumps.
const gossipForgeGap = 1 << 24

// gossipIncCeiling: incarnations at or above it are refused from everyone.
// A member bumps its incarnation once per refutation or metadata change; it
// never gets near 2^32 honestly, and memberlist wraps to 0 past it.
const gossipIncCeiling = math.MaxUint32 - 1<<16

// gossipRefuteGap is the least time between two claims about us from
// untrusted members that we let memberlist refute.
const gossipRefuteGap = time.Second

// errGossipStream rejects a gossip stream that carries what we never send.
var errGossipStream = errors.New("transport: gossip stream message not accepted")

// gossipGuard filters what members say about each other (see above). Safe
// for concurrent use.
type gossipGuard struct {
	self    peer.ID
	trusted map[peer.ID]bool

	mu sync.Mutex // guards the following fields
	// known is the highest incarnation announced per member; a member's
	// entry goes when it leaves (forget) or is no member (keepOnly).
	known   map[peer.ID]uint32
	selfInc uint32
	// refutedAt is when a claim about us from an untrusted member was last
	// let through (see refutableLocked).
	refutedAt time.Time
	// fwd is the last incarnation of our own alive (and leave) forwarded to
	// each trusted member: keyed by trusted members only, so bounded by
	// the Trusted list, which is fixed.
	fwdAlive, fwdDead map[peer.ID]uint32
}

func newGossipGuard(self peer.ID, trusted []peer.ID) *gossipGuard {
	gd := &gossipGuard{
		self:     self,
		trusted:  make(map[peer.ID]bool, len(trusted)),
		known:    make(map[peer.ID]uint32),
		fwdAlive: make(map[peer.ID]uint32),
		fwdDead:  make(map[peer.ID]uint32),
	}
	for _, p := range trusted {
		if p != self {
			gd.trusted[p] = true
		}
	}
	return gd
}

// forget drops what the guard knows of member p, which left.
func (gd *gossipGuard) forget(p peer.ID) {
	gd.mu.Lock()
	delete(gd.known, p)
	gd.mu.Unlock()
}

// keepOnly drops what the guard knows of the peers keep rejects (no longer
// members).
func (gd *gossipGuard) keepOnly(keep func(peer.ID) bool) {
	gd.mu.Lock()
	defer gd.mu.Unlock()
	for p := range gd.known {
		if !keep(p) {
			delete(gd.known, p)
		}
	}
}

// isTrusted reports whether p's claims about others count.
func (gd *gossipGuard) isTrusted(p peer.ID) bool { return gd.trusted[p] }

// Wire shapes of the memberlist messages we read (net.go in v0.7.0).
type mlPushPullHeader struct {
	Nodes        int
	UserStateLen int
	Join         bool
}

type mlPushNodeState struct {
	Name        string
	Addr        []byte
	Port        uint16
	Meta        []byte
	Incarnation uint32
	State       int
	Vsn         []uint8
}

// filterPacket returns what memberlist may read of packet b from peer from:
// b itself when every claim in it holds, a rebuilt packet with the allowed
// messages, or nil when none is left. forged is non-empty when from made a
// claim no honest member makes.
func (gd *gossipGuard) filterPacket(from peer.ID, b []byte) (out []byte, forged string) {
	w := packetWalk{gd: gd, from: from, trusted: gd.isTrusted(from)}
	gd.mu.Lock()
	w.walk(b, 0)
	gd.mu.Unlock()
	switch {
	case !w.dropped:
		return b, w.forged
	case len(w.keep) == 0:
		return nil, w.forged
	case len(w.keep) == 1:
		return w.keep[0], w.forged
	}
	if len(w.keep) > mlMaxParts {
		w.keep = w.keep[:mlMaxParts]
	}
	return compoundMessage(w.keep), w.forged
}

// compoundMessage builds memberlist's compound message from parts (at most
// 255 parts of at most 65535 bytes each).
func compoundMessage(parts [][]byte) []byte {
	n := 2 + 2*len(parts)
	for _, p := range parts {
		n += len(p)
	}
	out := make([]byte, 0, n)
	out = append(out, mlCompoundMsg, byte(len(parts)))
	for _, p := range parts {
		out = binary.BigEndian.AppendUint16(out, uint16(len(p)))
	}
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

type packetWalk struct {
	gd      *gossipGuard
	from    peer.ID
	trusted bool
	keep    [][]byte // leaf messages allowed, in order
	dropped bool     // some message was dropped (or the packet was unwrapped)
	forged  string
}

// walk visits the messages of b; gd.mu is held.
func (w *packetWalk) walk(b []byte, depth int) {
	if len(b) == 0 {
		w.dropped = true
		return
	}
	if depth > mlMaxDepth {
		w.dropped = true
		return
	}
	switch b[0] {
	case mlHasCrcMsg:
		if len(b) < 5 || crc32.ChecksumIEEE(b[5:]) != binary.BigEndian.Uint32(b[1:5]) {
			w.dropped = true
			return
		}
		w.unwrapped(b, func() { w.walk(b[5:], depth+1) })
	case mlCompoundMsg:
		parts, ok := splitCompoundStrict(b[1:])
		if !ok {
			w.dropped = true
			return
		}
		w.unwrapped(b, func() {
			for _, part := range parts {
				w.walk(part, depth+1)
			}
		})
	case mlCompressMsg:
		plain, err := decompressMsg(b[1:])
		if err != nil {
			w.dropped = true
			return
		}
		w.unwrapped(b, func() { w.walk(plain, depth+1) })
	case mlAliveMsg:
		var a mlAlive
		if mlDecode(b[1:], &a) != nil {
			w.dropped = true
			return
		}
		w.verdict(b, w.gd.judge(w.from, w.trusted, claimAlive, a.Node, a.Node, a.Incarnation))
	case mlSuspectMsg, mlDeadMsg:
		var s mlSuspect // a dead message has the same fields
		if mlDecode(b[1:], &s) != nil {
			w.dropped = true
			return
		}
		kind := claimSuspect
		if b[0] == mlDeadMsg {
			kind = claimDead
		}
		w.verdict(b, w.gd.judge(w.from, w.trusted, kind, s.Node, s.From, s.Incarnation))
	default:
		// Probes, acks, nacks, user messages: nothing about membership.
		w.keep = append(w.keep, b)
	}
}

// unwrapped runs inner on a wrapper's content; if anything inside was
// dropped the wrapper is rebuilt from its kept leaves, otherwise kept whole.
func (w *packetWalk) unwrapped(b []byte, inner func()) {
	keep, dropped := w.keep, w.dropped
	w.keep, w.dropped = nil, false
	inner()
	if w.dropped {
		w.keep = append(keep, w.keep...)
		return
	}
	w.keep, w.dropped = append(keep, b), dropped
}

func (w *packetWalk) verdict(b []byte, v claimVerdict) {
	if v.forged != "" && w.forged == "" {
		w.forged = v.forged
	}
	if v.keep {
		w.keep = append(w.keep, b)
	} else {
		w.dropped = true
	}
}

type claimKind int

const (
	claimAlive claimKind = iota
	claimSuspect
	claimDead
)

type claimVerdict struct {
	keep   bool
	forged string
}

// judge decides one claim by sender from about node (by origin, the From of
// suspect and dead) at incarnation inc; gd.mu is held.
func (gd *gossipGuard) judge(from peer.ID, trusted bool, kind claimKind, node, origin string, inc uint32) claimVerdict {
	x, err := peer.Decode(node)
	if err != nil {
		return claimVerdict{}
	}
	if inc >= gossipIncCeiling {
		return claimVerdict{forged: fmt.Sprintf("incarnation %d for %s is at the wrap", inc, x)}
	}
	if x == gd.self {
		// We know our own state: a trusted member passes on only
		// suspicion to refute, and another member's suspicion of us
		// counts only at our incarnation, to be refuted (refutableLocked).
		if trusted || (kind != claimAlive && gd.refutableLocked(inc)) {
			return claimVerdict{keep: true}
		}
		return claimVerdict{forged: gd.evidenceLocked(x, inc)}
	}
	firstHand := x == from && (kind == claimAlive || (kind == claimDead && origin == node))
	if firstHand || trusted {
		gd.noteLocked(x, inc)
		return claimVerdict{keep: true}
	}
	return claimVerdict{forged: gd.evidenceLocked(x, inc)}
}

// refutableLocked reports whether an untrusted member's suspicion or death
// of us at incarnation inc goes to memberlist, which refutes it: only at
// our current incarnation (an older one memberlist ignores, a newer one no
// honest member knows) and at most once per gossipRefuteGap.
func (gd *gossipGuard) refutableLocked(inc uint32) bool {
	if gd.selfInc == 0 || inc != gd.selfInc {
		return false
	}
	now := time.Now()
	if now.Sub(gd.refutedAt) < gossipRefuteGap {
		return false
	}
	gd.refutedAt = now
	return true
}

// noteLocked records an incarnation announced for x.
func (gd *gossipGuard) noteLocked(x peer.ID, inc uint32) {
	if inc > gd.known[x] {
		gd.known[x] = inc
	}
}

// evidenceLocked says why a claim about x at incarnation inc is one no
// honest member makes, or "" when it may be honest (it is dropped anyway).
// The bar is high on purpose: a member that restarted starts again at 1
// while others remember its old incarnation, so only an incarnation far
// beyond anything x ever announced (or at the wrap) proves a forgery.
func (gd *gossipGuard) evidenceLocked(x peer.ID, inc uint32) string {
	if inc >= gossipIncCeiling {
		return fmt.Sprintf("incarnation %d for %s is at the wrap", inc, x)
	}
	known := gd.known[x]
	if x == gd.self {
		known = gd.selfInc
	}
	if uint64(inc) > uint64(known)+gossipForgeGap {
		return fmt.Sprintf("incarnation %d for %s, who announced %d", inc, x, known)
	}
	return ""
}

// outgoing notes our own incarnation from a packet we send to peer to and
// returns our own alive and leave messages in it that a trusted member has
// not had from us first-hand yet (the caller forwards them).
func (gd *gossipGuard) outgoing(to peer.ID, b []byte) (fwd map[peer.ID][][]byte) {
	if len(b) == 0 || b[0] == mlPingMsg || b[0] == mlAckMsg {
		return nil
	}
	var mine []ownClaim
	collectOwn(gd.self.String(), b, 0, &mine)
	if len(mine) == 0 {
		return nil
	}
	gd.mu.Lock()
	defer gd.mu.Unlock()
	for _, c := range mine {
		if c.inc > gd.selfInc && c.inc < gossipIncCeiling {
			gd.selfInc = c.inc
		}
	}
	for p := range gd.trusted {
		for _, c := range mine {
			last := gd.fwdAlive
			if c.dead {
				last = gd.fwdDead
			}
			if prev, ok := last[p]; ok && prev >= c.inc {
				continue
			}
			last[p] = c.inc
			if p == to {
				continue // it gets this very packet
			}
			if fwd == nil {
				fwd = make(map[peer.ID][][]byte)
			}
			fwd[p] = append(fwd[p], c.msg)
		}
	}
	return fwd
}

type ownClaim struct {
	msg  []byte
	inc  uint32
	dead bool
}

// collectOwn finds our own alive and leave messages in an outgoing packet.
func collectOwn(self string, b []byte, depth int, out *[]ownClaim) {
	if len(b) == 0 || depth > mlMaxDepth {
		return
	}
	switch b[0] {
	case mlHasCrcMsg:
		if len(b) >= 5 {
			collectOwn(self, b[5:], depth+1, out)
		}
	case mlCompoundMsg:
		for _, part := range splitCompound(b[1:]) {
			collectOwn(self, part, depth+1, out)
		}
	case mlCompressMsg:
		if plain, err := decompressMsg(b[1:]); err == nil {
			collectOwn(self, plain, depth+1, out)
		}
	case mlAliveMsg:
		var a mlAlive
		if mlDecode(b[1:], &a) == nil && a.Node == self {
			*out = append(*out, ownClaim{msg: b, inc: a.Incarnation})
		}
	case mlDeadMsg:
		var d mlDead
		if mlDecode(b[1:], &d) == nil && d.Node == self && d.From == self {
			*out = append(*out, ownClaim{msg: b, inc: d.Incarnation, dead: true})
		}
	}
}

// splitCompoundStrict is splitCompound that also reports a truncated body.
func splitCompoundStrict(b []byte) ([][]byte, bool) {
	if len(b) < 1 {
		return nil, false
	}
	n := int(b[0])
	parts := splitCompound(b)
	return parts, len(parts) == n
}

func decompressMsg(b []byte) ([]byte, error) {
	var c mlCompress
	if err := mlDecode(b, &c); err != nil {
		return nil, err
	}
	return lzwExpand(c)
}

func lzwExpand(c mlCompress) ([]byte, error) {
	if c.Algo != 0 {
		return nil, fmt.Errorf("transport: gossip compression %d", c.Algo)
	}
	r := lzw.NewReader(bytes.NewReader(c.Buf), lzw.LSB, mlLzwLitWidth)
	defer r.Close()
	plain, err := io.ReadAll(io.LimitReader(r, mlMaxDecompressed+1))
	if err != nil {
		return nil, err
	}
	if len(plain) > mlMaxDecompressed || len(plain) == 0 {
		return nil, errors.New("transport: gossip message decompresses to nothing or too much")
	}
	return plain, nil
}

// guardedReader serves a gossip stream from an untrusted member with its
// push/pull state reduced to the sender's own alive state: memberlist merges
// every state a push/pull carries, about anyone.
type guardedReader struct {
	gd   *gossipGuard
	from peer.ID
	src  *bufio.Reader
	// onForged is told of a forged claim found in the stream, onFiltered
	// of states removed from it.
	onForged   func(peer.ID, string)
	onFiltered func()

	head   []byte // the filtered message, served before the rest of src
	parsed bool
	err    error
}

func (r *guardedReader) Read(b []byte) (int, error) {
	if !r.parsed {
		r.parsed = true
		r.head, r.err = r.readMessage()
	}
	if len(r.head) > 0 {
		n := copy(b, r.head)
		r.head = r.head[n:]
		return n, nil
	}
	if r.err != nil {
		return 0, r.err
	}
	return r.src.Read(b)
}

// readMessage reads the stream's first message and returns what memberlist
// may read of it.
func (r *guardedReader) readMessage() ([]byte, error) {
	t, err := r.src.ReadByte()
	if err != nil {
		return nil, err
	}
	dec := codec.NewDecoder(r.src, &codec.MsgpackHandle{})
	switch t {
	case mlPushPullMsg:
		return r.filterPushPull(r.src, dec)
	case mlCompressMsg:
		var c mlCompress
		if err := dec.Decode(&c); err != nil {
			return nil, err
		}
		plain, err := lzwExpand(c)
		if err != nil {
			return nil, err
		}
		if plain[0] != mlPushPullMsg {
			return plain, nil
		}
		br := bufio.NewReader(bytes.NewReader(plain[1:]))
		return r.filterPushPull(br, codec.NewDecoder(br, &codec.MsgpackHandle{}))
	case mlPingMsg, 8 /* user message */, mlErrMsg:
		return []byte{t}, nil
	default:
		// Encryption and labels are not configured; nothing else starts a
		// stream.
		return nil, fmt.Errorf("%w: type %d", errGossipStream, t)
	}
}

const mlErrMsg = 13

func (r *guardedReader) filterPushPull(src io.Reader, dec *codec.Decoder) ([]byte, error) {
	var hdr mlPushPullHeader
	if err := dec.Decode(&hdr); err != nil {
		return nil, err
	}
	if hdr.Nodes < 0 || hdr.Nodes > mlMaxPushNodes || hdr.UserStateLen < 0 || hdr.UserStateLen > mlMaxDecompressed {
		return nil, fmt.Errorf("%w: push/pull of %d states, %d bytes", errGossipStream, hdr.Nodes, hdr.UserStateLen)
	}
	var kept []mlPushNodeState
	var forged string
	self := r.from.String()
	r.gd.mu.Lock()
	for range hdr.Nodes {
		var s mlPushNodeState
		if err := dec.Decode(&s); err != nil {
			r.gd.mu.Unlock()
			return nil, err
		}
		x, err := peer.Decode(s.Name)
		switch {
		case err != nil:
		case s.Name == self && s.State == mlStateAlive && s.Incarnation < gossipIncCeiling:
			r.gd.noteLocked(x, s.Incarnation)
			kept = append(kept, s)
		case x == r.gd.self && (s.State == mlStateSuspect || s.State == mlStateDead) && r.gd.refutableLocked(s.Incarnation):
			// The sender suspects us: memberlist refutes it.
			kept = append(kept, s)
		default:
			if f := r.gd.evidenceLocked(x, s.Incarnation); f != "" {
				forged = "push/pull: " + f
			}
		}
	}
	r.gd.mu.Unlock()
	user := make([]byte, hdr.UserStateLen)
	if _, err := io.ReadFull(src, user); err != nil {
		return nil, err
	}
	if len(kept) < hdr.Nodes && r.onFiltered != nil {
		r.onFiltered()
	}
	if forged != "" && r.onForged != nil {
		r.onForged(r.from, forged)
	}
	var buf bytes.Buffer
	buf.WriteByte(mlPushPullMsg)
	enc := codec.NewEncoder(&buf, &codec.MsgpackHandle{})
	hdr.Nodes = len(kept)
	if err := enc.Encode(&hdr); err != nil {
		return nil, err
	}
	for i := range kept {
		if err := enc.Encode(&kept[i]); err != nil {
			return nil, err
		}
	}
	buf.Write(user)
	return buf.Bytes(), nil
}
