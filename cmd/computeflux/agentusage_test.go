package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/transport"
)

// computeflux agent usage against a real relay over libp2p: the owner of a
// joined agent's key sees what that agent served and nothing else; a key
// whose agent is not joined, or the wrong secret, gets a clear refusal.
func TestAgentUsageCommand(t *testing.T) {
	dir := t.TempDir()
	const secret = "agent-usage-join-secret-0123456789"
	l, err := ledger.Open(ledger.Config{Path: filepath.Join(dir, "ledger.db")})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	now := time.Now()
	for range 3 {
		l.Record(ledger.Entry{Time: now, Client: "alice", Model: "llama", Agent: "gpu-1", PromptTokens: 1000, CachedTokens: 750, CompletionTokens: 100, Serving: time.Second})
	}
	l.Record(ledger.Entry{Time: now, Client: "bob", Model: "qwen", Agent: "gpu-2", PromptTokens: 500, CompletionTokens: 50})
	r, err := relay.New(relay.Config{P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Token: []byte(secret), NoAuth: true, Ledger: l})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	relayAddr := r.Addrs()[0].String()

	// gpu-1 is joined (from its own host, with its identity); gpu-2 is not.
	idFile := func(name string) string { return filepath.Join(dir, name+".key") }
	key1, err := transport.LoadOrCreateIdentity(idFile("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := transport.LoadOrCreateIdentity(idFile("gpu-3")); err != nil {
		t.Fatal(err)
	}
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Key: key1})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.Connect(ctx, r.Host().Peerstore().PeerInfo(r.Host().ID())); err != nil {
		// The relay's own peer store lists its addresses.
		t.Fatal(err)
	}
	m, err := transport.Join(ctx, h, r.Host().ID(), []byte(secret), transport.JoinInfo{Name: "gpu-1", Models: []string{"llama"}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()

	tf := filepath.Join(dir, "token")
	if err := os.WriteFile(tf, []byte(secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (string, string, error) {
		var out, errb bytes.Buffer
		noEnv := func(string) (string, bool) { return "", false }
		err := runAgentUsage(ctx, args, noEnv, &out, &errb)
		return out.String(), errb.String(), err
	}

	out, _, err := run("--relay", relayAddr, "--token-file", tf, "--identity", idFile("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"agent gpu-1 on relay", "MODEL", "llama", "3000", "2250", "75.0", "TOTAL"} {
		if !strings.Contains(out, want) {
			t.Fatalf("table lacks %q:\n%s", want, out)
		}
	}
	for _, never := range []string{"gpu-2", "qwen", "alice", "bob", secret} {
		if strings.Contains(out, never) {
			t.Fatalf("gpu-1's owner sees %q:\n%s", never, out)
		}
	}
	out, _, err = run("--relay", relayAddr, "--token-file", tf, "--identity", idFile("gpu-1"), "--format", "json", "--since", "1d")
	if err != nil {
		t.Fatal(err)
	}
	var reps []relay.AgentUsage
	if err := json.Unmarshal([]byte(out), &reps); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(reps) != 1 || reps[0].Agent != "gpu-1" || reps[0].Total.Requests != 3 || reps[0].Total.PromptTokens != 3000 ||
		reps[0].Total.CachedTokens != 2250 || reps[0].Total.CompletionTokens != 300 || len(reps[0].Rows) != 1 {
		t.Fatalf("gpu-1's report %+v", reps)
	}

	// A relay that refuses (another join secret) is reported as such, and
	// the answer of the next one is labelled with its own address.
	other, err := relay.New(relay.Config{P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Token: []byte("another-secret-0123456789"), NoAuth: true, Ledger: l})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	otherAddr := other.Addrs()[0].String()
	out, stderr, err := run("--relay", otherAddr, "--relay", relayAddr, "--token-file", tf, "--identity", idFile("gpu-1"))
	if err == nil || !strings.Contains(err.Error(), "1 of 2 relays did not answer") || !strings.Contains(stderr, "invalid proof") {
		t.Fatalf("one relay refusing: %v, stderr %q", err, stderr)
	}
	if !strings.Contains(out, "agent gpu-1 on relay "+relayAddr) || strings.Contains(out, otherAddr) {
		t.Fatalf("the answering relay mislabelled:\n%s", out)
	}

	// Another identity that takes the name while its first owner is away
	// sees nothing of what was served under it before.
	m.Close()
	key2, err := transport.LoadOrCreateIdentity(idFile("gpu-2"))
	if err != nil {
		t.Fatal(err)
	}
	h2, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Key: key2})
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	if err := h2.Connect(ctx, r.Host().Peerstore().PeerInfo(r.Host().ID())); err != nil {
		t.Fatal(err)
	}
	var m2 *transport.Membership
	deadline := time.Now().Add(20 * time.Second)
	for m2 == nil {
		// The name is free once the relay has seen gpu-1's registration end.
		if m2, err = transport.Join(ctx, h2, r.Host().ID(), []byte(secret), transport.JoinInfo{Name: "gpu-1", Models: []string{"llama"}}); err != nil {
			if time.Now().After(deadline) {
				t.Fatalf("a second identity could not take the name: %v", err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	defer m2.Close()
	out, _, err = run("--relay", relayAddr, "--token-file", tf, "--identity", idFile("gpu-2"), "--format", "json")
	if err != nil {
		t.Fatal(err)
	}
	reps = nil
	if err := json.Unmarshal([]byte(out), &reps); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(reps) != 1 || reps[0].Agent != "gpu-1" || reps[0].Total.Requests != 0 || len(reps[0].Rows) != 0 || !strings.Contains(reps[0].Note, "another identity") {
		t.Fatalf("the name's second identity sees %+v", reps)
	}

	// Refusals, each saying why.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--relay", relayAddr, "--token-file", tf, "--identity", idFile("gpu-3")}, "not joined to this relay"},
		{[]string{"--relay", relayAddr, "--token", "another-secret-0123456789", "--identity", idFile("gpu-1")}, "invalid proof"},
		{[]string{"--relay", relayAddr, "--token-file", tf, "--identity", filepath.Join(dir, "none.key")}, "identity file"},
		{[]string{"--token-file", tf, "--identity", idFile("gpu-1")}, "--relay"},
		{[]string{"--relay", relayAddr, "--token-file", tf, "--identity", idFile("gpu-1"), "--since", "soon"}, "since"},
	} {
		_, stderr, err := run(c.args...)
		if err == nil || !strings.Contains(err.Error()+stderr, c.want) {
			t.Errorf("%v: got %v (stderr %q), want an error saying %q", c.args, err, stderr, c.want)
		}
	}
}
