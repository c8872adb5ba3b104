package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The usage ledger's flags: --ledger-file opens and closes it, none turns
// it off; a budget in the clients file without a ledger is a start-up
// error.
func TestRelayLedgerFlags(t *testing.T) {
	dir := t.TempDir()
	clients := filepath.Join(dir, "clients.yaml")
	if err := os.WriteFile(clients, []byte("clients:\n  - name: dave\n    keys: [sk-dave]\n    budget: {tokens_per_day: 10}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	none := func(string) (string, bool) { return "", false }
	_, _, err := relayConfig([]string{"--token", "t", "--clients-file", clients, "--ledger-file", "none"}, none, io.Discard)
	if err == nil || !strings.Contains(err.Error(), `"dave"`) || !strings.Contains(err.Error(), "--ledger-file none") {
		t.Fatalf("a budget with --ledger-file none: %v", err)
	}
	db := filepath.Join(dir, "usage.db")
	cfg, files, err := relayConfig([]string{"--token", "t", "--clients-file", clients, "--ledger-file", db, "--ledger-fail-closed"}, none, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	closeLedger, err := files.openLedger(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Ledger == nil || !cfg.Ledger.Health().FailClosed {
		t.Fatalf("ledger %v, health %+v", cfg.Ledger, cfg.Ledger.Health())
	}
	closeLedger()
	if _, err := os.Stat(db); err != nil {
		t.Fatal(err)
	}
}

// With no --ledger-file the ledger is on, in the relay's state directory:
// beside its identity file and named after it (two identities in one
// directory, two ledgers), else in systemd's $STATE_DIRECTORY, else in
// <user config dir>/computeflux. A place that cannot be written, and a
// file another relay holds, are start-up errors that say what to do.
func TestRelayLedgerDefault(t *testing.T) {
	dir := t.TempDir()
	env := map[string]string{}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	ledgerOf := func(args ...string) string {
		t.Helper()
		_, files, err := relayConfig(append([]string{"--token", "t", "--no-auth"}, args...), lookup, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		return files.ledger
	}
	for _, c := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"beside the identity", []string{"--identity", filepath.Join(dir, "relay.key")}, nil, filepath.Join(dir, "relay-usage.db")},
		{"a second identity there", []string{"--identity", filepath.Join(dir, "relay-2.key")}, nil, filepath.Join(dir, "relay-2-usage.db")},
		{"the identity wins over systemd's", []string{"--identity", filepath.Join(dir, "a", "relay.key")}, map[string]string{"STATE_DIRECTORY": "/var/lib/computeflux"}, filepath.Join(dir, "a", "relay-usage.db")},
		{"systemd's state directory", nil, map[string]string{"STATE_DIRECTORY": "/var/lib/computeflux:/var/lib/other"}, "/var/lib/computeflux/relay-usage.db"},
		{"the user's config directory", nil, map[string]string{}, filepath.Join(os.Getenv("XDG_CONFIG_HOME"), "computeflux", "relay-usage.db")},
		{"from the environment", nil, map[string]string{"COMPUTEFLUX_LEDGER_FILE": filepath.Join(dir, "x.db")}, filepath.Join(dir, "x.db")},
		{"none", []string{"--ledger-file", "none"}, nil, ""},
	} {
		env = c.env
		if got := ledgerOf(c.args...); got != c.want {
			t.Errorf("%s: ledger %q, want %q", c.name, got, c.want)
		}
	}

	// Opened: the file is created, and a second relay on it is refused.
	env = nil
	cfg, files, err := relayConfig([]string{"--token", "t", "--no-auth", "--identity", filepath.Join(dir, "relay.key")}, lookup, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	closeLedger, err := files.openLedger(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer closeLedger()
	if cfg.Ledger == nil {
		t.Fatal("no ledger by default")
	}
	if _, err := os.Stat(filepath.Join(dir, "relay-usage.db")); err != nil {
		t.Fatal(err)
	}
	cfg2, _, _ := relayConfig([]string{"--token", "t", "--no-auth"}, lookup, io.Discard)
	if _, err := files.openLedger(&cfg2); err == nil || !strings.Contains(err.Error(), "another process holds the file") ||
		!strings.Contains(err.Error(), "--ledger-file none") {
		t.Fatalf("a second relay on the same ledger: %v", err)
	}

	// A place that cannot be written.
	ro := filepath.Join(dir, "ro")
	if err := os.Mkdir(ro, 0o500); err != nil {
		t.Fatal(err)
	}
	if os.Getuid() == 0 {
		// root writes anywhere: a file where the directory should be
		// stands in for a place no one can write.
		ro = filepath.Join(dir, "relay-usage.db", "sub")
	}
	bad := relayFiles{ledger: filepath.Join(ro, "usage.db")}
	if _, err := bad.openLedger(&cfg2); err == nil || !strings.Contains(err.Error(), "usage ledger") || !strings.Contains(err.Error(), "--ledger-file") {
		t.Fatalf("an unwritable place: %v", err)
	}
}
