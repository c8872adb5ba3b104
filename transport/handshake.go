package transport

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/libp2p/go-libp2p/core/peer"
)

// The framed handshake that opens our protocols whose two ends share a
// secret: the join protocol (an agent proves the join token to its relay)
// and the relays' sessions protocol (each relay proves it to the other).
//
// Frames:
//
//	length  uint32, big endian: bytes that follow (2 .. MaxFrame)
//	version byte: the protocol's
//	type    byte: FrameChallenge ... FrameReject, then the protocol's own
//	body    length-2 bytes
//
// The accepting side opens with a challenge (32 random bytes). The
// initiating side answers with a hello: its own nonce (32 random bytes)
// when the handshake is mutual, then HMAC-SHA256 keyed by the secret over
// the label, the version, the acceptor's and the initiator's peer IDs, the
// challenge and the payload exactly as sent, then the payload. The
// acceptor answers welcome (mutual: its own proof, the same HMAC under the
// label with " reply" over the initiator's nonce and no payload) or reject
// (a reason, UTF-8). A reject may also come instead of the challenge.
//
// Peer IDs are the ones libp2p authenticated for the connection, so a proof
// cannot be replayed by another peer, to another peer, or on another
// stream; the reply's own label keeps one side's proof from passing for the
// other's.

// Frame types of the handshake; a protocol numbers its own from
// FrameProtocol up.
const (
	FrameChallenge byte = 1 // acceptor -> initiator: nonce
	FrameHello     byte = 2 // initiator -> acceptor: [nonce] || proof || payload
	FrameWelcome   byte = 3 // acceptor -> initiator: empty, or its proof when mutual
	FrameReject    byte = 4 // acceptor -> initiator: reason
	FrameProtocol  byte = 5 // the first type a protocol may use for its own frames
)

const (
	handshakeNonce = 32
	handshakeMAC   = sha256.Size
)

// ErrBadProof is returned when the other side's proof of the shared secret
// is wrong: it holds another secret, or none.
var ErrBadProof = errors.New("invalid proof of the shared secret")

// errBadFrame reports a frame that violates the protocol.
var errBadFrame = errors.New("malformed frame")

// Framing reads and writes one protocol's frames. Its methods are safe for
// concurrent use on different streams.
type Framing struct {
	// Version is the protocol's version byte; a frame with another is
	// refused.
	Version byte
	// MaxFrame bounds a frame's length field (version, type and body).
	MaxFrame int
}

// WriteFrame writes one frame in a single Write.
func (f Framing) WriteFrame(w io.Writer, typ byte, body []byte) error {
	if len(body)+2 > f.MaxFrame {
		return fmt.Errorf("frame of %d bytes exceeds %d", len(body)+2, f.MaxFrame)
	}
	b := make([]byte, 6+len(body))
	binary.BigEndian.PutUint32(b, uint32(len(body)+2))
	b[4] = f.Version
	b[5] = typ
	copy(b[6:], body)
	_, err := w.Write(b)
	return err
}

// ReadFrame reads one frame and checks its length and version.
func (f Framing) ReadFrame(r io.Reader) (typ byte, body []byte, err error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n < 2 || n > uint32(f.MaxFrame) {
		return 0, nil, fmt.Errorf("%w: length %d", errBadFrame, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	if b[0] != f.Version {
		return 0, nil, fmt.Errorf("%w: version %d, want %d", errBadFrame, b[0], f.Version)
	}
	return b[1], b[2:], nil
}

// Handshake is one protocol's framed proof of a shared secret (see above).
// Its methods do no I/O but on the reader and writer they are given, and set
// no deadlines: the caller bounds them.
type Handshake struct {
	Framing
	// Secret is the shared secret (the join token).
	Secret []byte
	// Label names the protocol in every proof, so that a proof for one
	// protocol is worth nothing in another.
	Label string
	// Mutual makes the acceptor prove the secret too, in its welcome.
	Mutual bool
}

// Hello is an initiator's verified hello, returned by Accept.
type Hello struct {
	// Payload is what the initiator sent with its proof.
	Payload []byte
	nonce   []byte // the initiator's, when mutual
}

// proof is the HMAC of one side: label, version, both peer IDs, the other
// side's nonce and the payload, each length-prefixed.
func (hs *Handshake) proof(label string, acceptor, initiator peer.ID, nonce, payload []byte) []byte {
	m := hmac.New(sha256.New, hs.Secret)
	m.Write([]byte(label))
	m.Write([]byte{hs.Version})
	for _, b := range [][]byte{[]byte(acceptor), []byte(initiator), nonce, payload} {
		var n [4]byte
		binary.BigEndian.PutUint32(n[:], uint32(len(b)))
		m.Write(n[:])
		m.Write(b)
	}
	return m.Sum(nil)
}

func (hs *Handshake) replyLabel() string { return hs.Label + " reply" }

// Accept runs the acceptor's side (self accepted the stream of remote) up
// to a verified hello: it sends the challenge, reads the hello and checks
// its proof (ErrBadProof when wrong). End the handshake with Welcome or
// Reject.
func (hs *Handshake) Accept(r io.Reader, w io.Writer, self, remote peer.ID) (*Hello, error) {
	var nonce [handshakeNonce]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return nil, err
	}
	if err := hs.WriteFrame(w, FrameChallenge, nonce[:]); err != nil {
		return nil, err
	}
	typ, body, err := hs.ReadFrame(r)
	if err != nil {
		return nil, err
	}
	h := &Hello{}
	if hs.Mutual {
		if typ != FrameHello || len(body) < handshakeNonce {
			return nil, errBadFrame
		}
		h.nonce, body = body[:handshakeNonce], body[handshakeNonce:]
	}
	if typ != FrameHello || len(body) < handshakeMAC {
		return nil, errBadFrame
	}
	mac, payload := body[:handshakeMAC], body[handshakeMAC:]
	if !hmac.Equal(mac, hs.proof(hs.Label, self, remote, nonce[:], payload)) {
		return nil, ErrBadProof
	}
	h.Payload = payload
	return h, nil
}

// Welcome ends an accepted handshake with h: the initiator is in (and,
// when mutual, learns that self holds the secret too).
func (hs *Handshake) Welcome(w io.Writer, h *Hello, self, remote peer.ID) error {
	var body []byte
	if hs.Mutual {
		body = hs.proof(hs.replyLabel(), self, remote, h.nonce, nil)
	}
	return hs.WriteFrame(w, FrameWelcome, body)
}

// Reject ends a handshake, at any point on the acceptor's side, with a
// reason for the initiator (cut at maxReasonLen bytes, made valid UTF-8).
func (hs *Handshake) Reject(w io.Writer, reason string) error {
	if len(reason) > maxReasonLen {
		reason = reason[:maxReasonLen]
	}
	return hs.WriteFrame(w, FrameReject, bytes.ToValidUTF8([]byte(reason), []byte("?")))
}

// Initiate runs the initiator's side (self opened the stream to remote): it
// answers the challenge with a hello carrying payload and reads the
// acceptor's answer. A reject, instead of the challenge or after the hello,
// is a *RejectedError; a wrong proof in a mutual welcome is ErrBadProof.
func (hs *Handshake) Initiate(r io.Reader, w io.Writer, self, remote peer.ID, payload []byte) error {
	typ, body, err := hs.ReadFrame(r)
	if err != nil {
		return err
	}
	if typ == FrameReject {
		return rejected(body)
	}
	if typ != FrameChallenge || len(body) != handshakeNonce {
		return errBadFrame
	}
	hello := make([]byte, 0, handshakeNonce+handshakeMAC+len(payload))
	var nonce [handshakeNonce]byte
	if hs.Mutual {
		if _, err := rand.Read(nonce[:]); err != nil {
			return err
		}
		hello = append(hello, nonce[:]...)
	}
	hello = append(hello, hs.proof(hs.Label, remote, self, body, payload)...)
	hello = append(hello, payload...)
	if err := hs.WriteFrame(w, FrameHello, hello); err != nil {
		return err
	}
	typ, body, err = hs.ReadFrame(r)
	if err != nil {
		return err
	}
	switch typ {
	case FrameWelcome:
	case FrameReject:
		return rejected(body)
	default:
		return errBadFrame
	}
	if hs.Mutual && !hmac.Equal(body, hs.proof(hs.replyLabel(), remote, self, nonce[:], nil)) {
		return ErrBadProof
	}
	return nil
}

// rejected is the error of a reject frame.
func rejected(reason []byte) *RejectedError {
	return &RejectedError{Reason: string(bytes.ToValidUTF8(reason, []byte("?")))}
}
