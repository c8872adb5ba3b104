package transport

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
)

// handshakeStream plays the agent's side of a join handshake against the
// relay's JoinServer.handshake, in memory. Once the relay's challenge has
// been written, Read serves a hello over info, with a proof that is right
// (or deliberately wrong), followed by arbitrary bytes.
type handshakeStream struct {
	network.Stream // nil: only the methods below are used
	token          []byte
	relay, agent   peer.ID
	info           []byte
	corrupt        byte // 0: a valid proof; else XORed into its first byte
	tail           []byte

	written bytes.Buffer // what the relay wrote
	in      *bytes.Reader
}

func (s *handshakeStream) Write(p []byte) (int, error) { return s.written.Write(p) }

func (s *handshakeStream) Read(p []byte) (int, error) {
	if s.in == nil {
		typ, body, err := readFrame(bytes.NewReader(s.written.Bytes()))
		if err != nil || typ != FrameChallenge {
			return 0, io.ErrUnexpectedEOF
		}
		mac := joinProof(s.token, s.relay, s.agent, body, s.info)
		mac[0] ^= s.corrupt
		var b bytes.Buffer
		if err := writeFrame(&b, FrameHello, append(mac, s.info...)); err != nil {
			b.Reset() // too large to frame: send only the tail
		}
		b.Write(s.tail)
		s.in = bytes.NewReader(b.Bytes())
	}
	return s.in.Read(p)
}

func (s *handshakeStream) SetDeadline(time.Time) error { return nil }
func (s *handshakeStream) Close() error                { return nil }
func (s *handshakeStream) Reset() error                { return nil }

// idHost is a host that only knows its ID.
type idHost struct {
	host.Host
	id peer.ID
}

func (h idHost) ID() peer.ID { return h.id }

func fuzzPeer(f *testing.F) peer.ID {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	k, err := crypto.UnmarshalEd25519PrivateKey(priv)
	if err != nil {
		f.Fatal(err)
	}
	id, err := peer.IDFromPrivateKey(k)
	if err != nil {
		f.Fatal(err)
	}
	return id
}

// FuzzJoinHandshake runs the relay's side of the handshake against an agent
// that sends arbitrary info with a right or wrong proof and arbitrary bytes
// after it. The relay admits exactly the agents with a right proof over
// valid info, and then learns exactly that info.
func FuzzJoinHandshake(f *testing.F) {
	relay, agent := fuzzPeer(f), fuzzPeer(f)
	token := []byte("fuzz-join-token")
	good, _ := encodeInfo(JoinInfo{Name: "gpu1", Models: []string{"llama-3", "qwen"}, Weight: 2, Capacity: 8})
	f.Add(good, byte(0), []byte(nil))
	f.Add(good, byte(1), []byte(nil))
	f.Add([]byte(`{"name":""}`), byte(0), []byte{0, 0, 0, 2, 1, 5})
	f.Add([]byte(`{"name":"x","weight":-1}`), byte(0), []byte(nil))
	f.Add([]byte(`not json`), byte(0), []byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, info []byte, corrupt byte, tail []byte) {
		js := &JoinServer{h: idHost{id: relay}, token: token}
		s := &handshakeStream{token: token, relay: relay, agent: agent, info: info, corrupt: corrupt, tail: tail}
		got, _, reject, err := js.handshake(joinHandshake(token), s, agent)
		want, perr := parseInfo(info)
		framed := len(info)+2+macSize <= maxFrameSize
		valid := corrupt == 0 && perr == nil && framed
		if (err == nil) != valid {
			t.Fatalf("admitted=%v, want %v (corrupt %d, parse %v, framed %v, err %v)", err == nil, valid, corrupt, perr, framed, err)
		}
		if err == nil && fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("relay learned %+v, agent sent %+v", got, want)
		}
		if err != nil && len(reject) > maxReasonLen {
			t.Fatalf("reject reason of %d bytes", len(reject))
		}
		if err != nil && corrupt != 0 && framed && reject == "" {
			t.Fatalf("a wrong proof failed without a reason for the agent: %v", err)
		}
	})
}
