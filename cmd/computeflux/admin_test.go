package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/computeflux/computeflux/relay/relaytest/poll"
	"github.com/computeflux/computeflux/relay/relaytest/ports"
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestOperatorFlags(t *testing.T) {
	dir := t.TempDir()
	kf := filepath.Join(dir, "admin.key")
	if err := os.WriteFile(kf, []byte("adm-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	none := func(string) (string, bool) { return "", false }
	cfg, _, err := relayConfig([]string{"--token", "t", "--no-auth", "--endpoints-file", "e.yaml", "--admin-key-file", kf,
		"--admin-listen", "127.0.0.1:9", "--status-public", "--max-agent-weight", "2.5"}, none, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.EndpointsFile != "e.yaml" || cfg.AdminKey != "adm-secret" || cfg.AdminListen != "127.0.0.1:9" || !cfg.StatusPublic || cfg.MaxAgentWeight != 2.5 {
		t.Fatalf("flags not applied: %+v", cfg)
	}
	if err := os.WriteFile(kf, []byte("two keys\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := relayConfig([]string{"--token", "t", "--no-auth", "--admin-key-file", kf}, none, io.Discard); err == nil {
		t.Fatal("a malformed admin key file was accepted")
	}
}

// The relay subcommand with an endpoints file: status prints the table,
// admin disables, SIGHUP reloads (and a malformed file leaves the table in
// force).
func TestRelayStatusAdminAndHangup(t *testing.T) {
	// Keep SIGHUP caught for the whole test, so a signal that arrives
	// between the relay's own Notify calls cannot stop the test binary.
	hup := make(chan os.Signal, 4)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	dir := t.TempDir()
	ef := filepath.Join(dir, "endpoints.yaml")
	kf := filepath.Join(dir, "admin.key")
	write := func(p, s string) {
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(kf, "adm-0123456789\n")
	write(ef, "endpoints:\n  - {name: cloud, url: https://127.0.0.1:1/v1, keys: [sk-prov-secret], models: [m1]}\n")
	admin := ports.Free(t, "tcp")
	var logs lockedBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runRelay(ctx, []string{"--token", "t", "--no-auth", "--listen", "127.0.0.1:0",
			"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--endpoints-file", ef, "--admin-key-file", kf,
			"--admin-listen", admin, "--log-format", "json"}, io.Discard, &logs)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	}()
	adminArgs := []string{"--admin-url", "http://" + admin, "--admin-key-file", kf}
	status := func() string {
		var out bytes.Buffer
		if err := runStatus(ctx, adminArgs, &out, io.Discard); err != nil {
			return "error: " + err.Error()
		}
		return out.String()
	}
	waitUntil(t, "the admin API", func() bool { return strings.Contains(status(), "cloud") })
	out := status()
	if !strings.Contains(out, "NAME") || !strings.Contains(out, "provider") || !strings.Contains(out, "#1 closed") {
		t.Fatalf("status:\n%s", out)
	}

	var aout bytes.Buffer
	if err := runAdmin(ctx, append(adminArgs, "disable", "cloud"), &aout, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(aout.String(), "disabled") {
		t.Fatalf("admin disable printed:\n%s", aout.String())
	}
	if err := runAdmin(ctx, append(adminArgs, "weight", "cloud", "3"), io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	if err := runAdmin(ctx, append(adminArgs, "disable", "nobody"), io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("unknown endpoint: %v", err)
	}
	if err := runAdmin(ctx, append(adminArgs, "explode", "cloud"), io.Discard, io.Discard); err == nil {
		t.Fatal("unknown action accepted")
	}

	// A new provider on SIGHUP; the admin's disable holds.
	write(ef, "endpoints:\n  - {name: cloud, url: https://127.0.0.1:1/v1, keys: [sk-prov-secret], models: [m1]}\n  - {name: lan, url: http://127.0.0.1:2/v1, models: [m2], priority: 3}\n")
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the reload", func() bool { return strings.Contains(status(), "lan") })
	out = status()
	if !strings.Contains(out, "disabled") || !strings.Contains(out, "3 (admin)") {
		t.Fatalf("after reload, the admin settings are gone:\n%s", out)
	}

	// A malformed file on SIGHUP: logged, the table stays.
	write(ef, "endpoints:\n  - {name: cloud, url: ftp://x}\n")
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the reload error", func() bool { return strings.Contains(logs.String(), "routing table in force stays") })
	if out := status(); !strings.Contains(out, "lan") || !strings.Contains(out, "cloud") {
		t.Fatalf("a bad reload changed the table:\n%s", out)
	}
	if strings.Contains(logs.String(), "sk-prov-secret") || strings.Contains(logs.String(), "adm-0123456789") {
		t.Fatal("a key reached the logs")
	}
	if !strings.Contains(logs.String(), "line 2") {
		t.Fatalf("the reload error does not name the line:\n%s", logs.String())
	}
}

// waitUntil polls cond until it holds or a generous deadline passes.
var waitUntil = poll.Eventually
