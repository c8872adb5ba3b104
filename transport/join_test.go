package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
)

// recorder is a JoinHandler that records every call.
type recorder struct {
	mu     sync.Mutex
	events []string
	reject error
	infos  map[peer.ID]JoinInfo
}

func (r *recorder) Joined(p peer.ID, info JoinInfo) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.reject != nil {
		return r.reject
	}
	if r.infos == nil {
		r.infos = map[peer.ID]JoinInfo{}
	}
	r.infos[p] = info
	r.events = append(r.events, "joined "+info.Name)
	return nil
}

func (r *recorder) Updated(p peer.ID, info JoinInfo) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.infos[p] = info
	r.events = append(r.events, fmt.Sprintf("updated %s %v %d %v", info.Name, info.Models, info.Capacity, info.Draining))
}

func (r *recorder) Left(p peer.ID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, "left "+r.infos[p].Name)
}

func (r *recorder) has(ev string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.events {
		if e == ev {
			return true
		}
	}
	return false
}

func (r *recorder) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.events...)
}

var testToken = []byte("s3cret-join-token")

func serveJoin(t *testing.T, relay host.Host, rec *recorder) *JoinServer {
	t.Helper()
	c, err := ServeJoin(relay, testToken, rec)
	if err != nil {
		t.Fatal(err)
	}
	js := c.(*JoinServer)
	t.Cleanup(func() { js.Close() })
	return js
}

func joinCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestJoinUpdateLeave(t *testing.T) {
	relay, agent := newTestHost(t), newTestHost(t)
	rec := &recorder{}
	serveJoin(t, relay, rec)
	connect(t, agent, relay)

	m, err := Join(joinCtx(t), agent, relay.ID(), testToken, JoinInfo{Name: "gpu1", Models: []string{"llama"}, Capacity: 4})
	if err != nil {
		t.Fatal(err)
	}
	if !rec.has("joined gpu1") {
		t.Fatalf("events %v", rec.list())
	}
	if err := m.Update(JoinInfo{Name: "gpu1", Models: []string{"llama", "qwen"}, Capacity: 8, Draining: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "update", func() bool { return rec.has("updated gpu1 [llama qwen] 8 true") })
	if !relay.ConnManager().IsProtected(agent.ID(), protectTag) {
		t.Error("relay does not protect the joined agent's connection")
	}
	m.Close()
	waitFor(t, "left", func() bool { return rec.has("left gpu1") })
	if !errors.Is(m.Err(), net.ErrClosed) {
		t.Fatalf("Err after Close = %v", m.Err())
	}
	if err := m.Update(JoinInfo{Name: "gpu1"}); err == nil {
		t.Fatal("Update after Close succeeded")
	}
}

func TestJoinRefused(t *testing.T) {
	relay, agent := newTestHost(t), newTestHost(t)
	rec := &recorder{}
	js := serveJoin(t, relay, rec)
	connect(t, agent, relay)

	_, err := Join(joinCtx(t), agent, relay.ID(), []byte("wrong token"), JoinInfo{Name: "gpu1"})
	var rej *RejectedError
	if !errors.As(err, &rej) || !errors.Is(err, ErrRejected) {
		t.Fatalf("wrong token: err = %v, want a rejection", err)
	}
	if bytes.Contains([]byte(err.Error()), testToken) {
		t.Fatal("error reveals the token")
	}
	if _, err := Join(joinCtx(t), agent, relay.ID(), nil, JoinInfo{Name: "gpu1"}); err == nil {
		t.Fatal("joined without a token")
	}
	if _, err := Join(joinCtx(t), agent, relay.ID(), testToken, JoinInfo{}); err == nil {
		t.Fatal("joined without a name")
	}
	// A peer that speaks the protocol but sends no proof at all.
	s, err := agent.NewStream(joinCtx(t), relay.ID(), JoinProtocol)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := readFrame(s); err != nil {
		t.Fatal(err)
	}
	writeFrame(s, msgUpdate, []byte(`{"name":"sneaky"}`))
	if _, _, err := readFrame(s); err == nil {
		t.Fatal("relay answered a message that is not a hello")
	}
	s.Reset()
	if evs := rec.list(); len(evs) != 0 {
		t.Fatalf("handler saw %v", evs)
	}
	waitFor(t, "failures counted", func() bool { return js.Failed() == 2 })
}

func TestJoinProofReplayedByAnotherPeerFails(t *testing.T) {
	relay, agent, thief := newTestHost(t), newTestHost(t), newTestHost(t)
	rec := &recorder{}
	serveJoin(t, relay, rec)
	connect(t, thief, relay)

	s, err := thief.NewStream(joinCtx(t), relay.ID(), JoinProtocol)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Reset()
	typ, nonce, err := readFrame(s)
	if err != nil || typ != FrameChallenge {
		t.Fatalf("challenge: %d %v", typ, err)
	}
	// The thief has obtained the agent's genuine proof for this very nonce
	// (the worst case: e.g. it relayed the challenge to the agent).
	info := []byte(`{"name":"gpu1"}`)
	proof := joinProof(testToken, relay.ID(), agent.ID(), nonce, info)
	if err := writeFrame(s, FrameHello, append(proof, info...)); err != nil {
		t.Fatal(err)
	}
	typ, reason, err := readFrame(s)
	if err != nil || typ != FrameReject {
		t.Fatalf("replayed proof: answer %d %q %v, want a reject", typ, reason, err)
	}
	if evs := rec.list(); len(evs) != 0 {
		t.Fatalf("handler saw %v", evs)
	}
	// The same proof bound to the thief's own ID but computed without the
	// token is no better; with the token it would be the thief's own join.
}

func TestJoinHandlerRejects(t *testing.T) {
	relay, agent := newTestHost(t), newTestHost(t)
	rec := &recorder{reject: errors.New("name gpu1 is taken")}
	serveJoin(t, relay, rec)
	connect(t, agent, relay)
	_, err := Join(joinCtx(t), agent, relay.ID(), testToken, JoinInfo{Name: "gpu1"})
	var rej *RejectedError
	if !errors.As(err, &rej) || rej.Reason != "name gpu1 is taken" {
		t.Fatalf("err = %v", err)
	}
}

func TestJoinLeftWhenAgentHostCloses(t *testing.T) {
	relay := newTestHost(t)
	agent, err := NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	serveJoin(t, relay, rec)
	connect(t, agent, relay)
	m, err := Join(joinCtx(t), agent, relay.ID(), testToken, JoinInfo{Name: "gpu1"})
	if err != nil {
		t.Fatal(err)
	}
	agent.Close()
	<-m.Done()
	waitFor(t, "left after the agent's host closed", func() bool { return rec.has("left gpu1") })
}

func TestJoinDoneWhenRelayCloses(t *testing.T) {
	relay, agent := newTestHost(t), newTestHost(t)
	rec := &recorder{}
	js := serveJoin(t, relay, rec)
	connect(t, agent, relay)
	m, err := Join(joinCtx(t), agent, relay.ID(), testToken, JoinInfo{Name: "gpu1"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	js.Close()
	if !rec.has("left gpu1") {
		t.Fatal("Close did not end the registration")
	}
	<-m.Done()
	if m.Err() == nil || errors.Is(m.Err(), net.ErrClosed) {
		t.Fatalf("Err = %v, want the relay's end", m.Err())
	}
}

func TestJoinAgainReplacesOldRegistrationInOrder(t *testing.T) {
	relay, agent := newTestHost(t), newTestHost(t)
	rec := &recorder{}
	serveJoin(t, relay, rec)
	connect(t, agent, relay)
	m1, err := Join(joinCtx(t), agent, relay.ID(), testToken, JoinInfo{Name: "gpu1"})
	if err != nil {
		t.Fatal(err)
	}
	defer m1.Close()
	m2, err := Join(joinCtx(t), agent, relay.ID(), testToken, JoinInfo{Name: "gpu1"})
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	<-m1.Done()
	want := []string{"joined gpu1", "left gpu1", "joined gpu1"}
	if got := rec.list(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("events %v, want %v", got, want)
	}
}

func TestJoinCancelledContext(t *testing.T) {
	relay, agent := newTestHost(t), newTestHost(t)
	connect(t, agent, relay)
	// This relay takes the stream and never answers.
	entered := make(chan struct{}, 1)
	relay.SetStreamHandler(JoinProtocol, func(s network.Stream) {
		entered <- struct{}{}
		io.Copy(io.Discard, s)
		s.Reset()
	})
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-entered
		cancel()
	}()
	if _, err := Join(ctx, agent, relay.ID(), testToken, JoinInfo{Name: "x"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
}

func FuzzJoinDecode(f *testing.F) {
	var buf bytes.Buffer
	writeFrame(&buf, FrameChallenge, make([]byte, handshakeNonce))
	f.Add(buf.Bytes())
	buf.Reset()
	info, _ := encodeInfo(JoinInfo{Name: "gpu1", Models: []string{"a", "b"}, Weight: 2, Capacity: 3, Draining: true})
	writeFrame(&buf, FrameHello, append(make([]byte, macSize), info...))
	f.Add(buf.Bytes())
	buf.Reset()
	writeFrame(&buf, msgUpdate, info)
	f.Add(buf.Bytes())
	f.Add([]byte{0, 0, 0, 2, 1, 3})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		for range 8 {
			typ, body, err := readFrame(r)
			if err != nil {
				return
			}
			if len(body)+2 > maxFrameSize {
				t.Fatalf("frame body of %d bytes accepted", len(body))
			}
			var payload []byte = body
			if typ == FrameHello && len(body) >= macSize {
				payload = body[macSize:]
			}
			info, err := parseInfo(payload)
			if err != nil {
				continue
			}
			// A decoded info re-encodes and decodes to itself.
			again, err := encodeInfo(info)
			if err != nil {
				t.Fatalf("decoded info %+v does not encode: %v", info, err)
			}
			back, err := parseInfo(again)
			if err != nil || fmt.Sprint(back) != fmt.Sprint(info) {
				t.Fatalf("round trip %+v -> %+v (%v)", info, back, err)
			}
		}
	})
}

// joinProof is an agent's proof of token for the join handshake with relay.
func joinProof(token []byte, relay, agent peer.ID, nonce, info []byte) []byte {
	return joinHandshake(token).proof(proofLabel, relay, agent, nonce, info)
}
