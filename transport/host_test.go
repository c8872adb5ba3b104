package transport

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// newTestHost starts a host on an ephemeral loopback QUIC port and closes it
// at the end of the test.
func newTestHost(t testing.TB) host.Host {
	t.Helper()
	h, err := NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// connect makes a dial b.
func connect(t testing.TB, a, b host.Host) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.Connect(ctx, peer.AddrInfo{ID: b.ID(), Addrs: b.Addrs()}); err != nil {
		t.Fatal(err)
	}
}

// waitFor polls cond until it holds or a generous deadline passes.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestNewHostLogsIdentityAndAddrs(t *testing.T) {
	var buf bytes.Buffer
	h, err := NewHost(HostConfig{
		ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Logger:      zerolog.New(&buf),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	out := buf.String()
	if !strings.Contains(out, h.ID().String()) {
		t.Errorf("log lacks the peer ID: %s", out)
	}
	if !strings.Contains(out, "/quic-v1/p2p/"+h.ID().String()) {
		t.Errorf("log lacks a full multiaddr: %s", out)
	}
	for _, a := range h.Addrs() {
		if !strings.Contains(a.String(), "/quic-v1") {
			t.Errorf("non-QUIC address %s", a)
		}
	}
}

func TestNewHostRejectsNonQUICListenAddr(t *testing.T) {
	for _, a := range []string{"/ip4/127.0.0.1/tcp/0", "not a multiaddr"} {
		h, err := NewHost(HostConfig{ListenAddrs: []string{a}})
		if err == nil {
			h.Close()
			t.Errorf("%q: accepted", a)
		}
	}
}

func TestNewHostKeepsIdentity(t *testing.T) {
	path := t.TempDir() + "/id.key"
	h1, err := NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, IdentityFile: path})
	if err != nil {
		t.Fatal(err)
	}
	id := h1.ID()
	h1.Close()
	h2, err := NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, IdentityFile: path})
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	if h2.ID() != id {
		t.Fatalf("peer ID changed across restarts: %s then %s", id, h2.ID())
	}
}
