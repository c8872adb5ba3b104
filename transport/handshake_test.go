package transport

import (
	"errors"
	"net"
	"testing"

	"github.com/libp2p/go-libp2p/core/peer"
)

// TestHandshakeMutual runs both sides of a mutual handshake over a pipe:
// the payload arrives when both hold the secret; a wrong secret on either
// side fails, and the side that holds the right one learns it.
func TestHandshakeMutual(t *testing.T) {
	acceptor, initiator := peerFor(t, 1), peerFor(t, 2)
	hs := func(secret string) *Handshake {
		return &Handshake{Framing: Framing{Version: 7, MaxFrame: 1 << 10}, Secret: []byte(secret), Label: "test proof", Mutual: true}
	}
	cases := []struct {
		name              string
		accept, initiate  string
		acceptErr, iniErr error // nil: no error
	}{
		{"same secret", "s3cret", "s3cret", nil, nil},
		{"initiator's secret wrong", "s3cret", "other", ErrBadProof, ErrRejected},
		{"acceptor's secret wrong", "other", "s3cret", ErrBadProof, ErrRejected},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a, b := net.Pipe()
			defer a.Close()
			defer b.Close()
			got := make(chan error, 1)
			go func() {
				h, err := hs(c.accept).Accept(a, a, acceptor, initiator)
				if err == nil {
					if string(h.Payload) != "hello" {
						err = errors.New("payload " + string(h.Payload))
					} else {
						err = hs(c.accept).Welcome(a, h, acceptor, initiator)
					}
				} else {
					_ = hs(c.accept).Reject(a, err.Error())
				}
				got <- err
			}()
			ierr := hs(c.initiate).Initiate(b, b, initiator, acceptor, []byte("hello"))
			aerr := <-got
			if (c.acceptErr == nil) != (aerr == nil) || (c.acceptErr != nil && !errors.Is(aerr, c.acceptErr)) {
				t.Fatalf("acceptor: %v, want %v", aerr, c.acceptErr)
			}
			if (c.iniErr == nil) != (ierr == nil) || (c.iniErr != nil && !errors.Is(ierr, c.iniErr)) {
				t.Fatalf("initiator: %v, want %v", ierr, c.iniErr)
			}
		})
	}
}

// TestHandshakeReplyIsNotAProof: the acceptor's proof in its welcome,
// computed over the same nonce and peers, is not an initiator's proof.
func TestHandshakeReplyIsNotAProof(t *testing.T) {
	hs := &Handshake{Framing: Framing{Version: 1, MaxFrame: 1 << 10}, Secret: []byte("k"), Label: "l", Mutual: true}
	a, i := peerFor(t, 1), peerFor(t, 2)
	nonce := make([]byte, handshakeNonce)
	if string(hs.proof(hs.Label, a, i, nonce, nil)) == string(hs.proof(hs.replyLabel(), a, i, nonce, nil)) {
		t.Fatal("the reply's proof equals the hello's")
	}
}

func peerFor(t *testing.T, n byte) peer.ID {
	t.Helper()
	return peer.ID([]byte{0, 4, 't', 'e', 's', n})
}

// TestHandshakeImpostorAcceptor: an acceptor without the secret that
// welcomes anyone (it cannot check the hello) is caught by the initiator of
// a mutual handshake.
func TestHandshakeImpostorAcceptor(t *testing.T) {
	hs := &Handshake{Framing: Framing{Version: 1, MaxFrame: 1 << 10}, Secret: []byte("k"), Label: "l", Mutual: true}
	acceptor, initiator := peerFor(t, 1), peerFor(t, 2)
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go func() {
		_ = hs.WriteFrame(a, FrameChallenge, make([]byte, handshakeNonce))
		_, _, _ = hs.ReadFrame(a)
		_ = hs.WriteFrame(a, FrameWelcome, make([]byte, handshakeMAC))
	}()
	if err := hs.Initiate(b, b, initiator, acceptor, nil); !errors.Is(err, ErrBadProof) {
		t.Fatalf("initiator: %v, want ErrBadProof", err)
	}
}
