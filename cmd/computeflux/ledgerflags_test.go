package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The usage ledger's flags: --ledger-file opens and closes it; a budget in
// the clients file without one is a start-up error.
func TestRelayLedgerFlags(t *testing.T) {
	dir := t.TempDir()
	clients := filepath.Join(dir, "clients.yaml")
	if err := os.WriteFile(clients, []byte("clients:\n  - name: dave\n    keys: [sk-dave]\n    budget: {tokens_per_day: 10}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	none := func(string) (string, bool) { return "", false }
	_, _, err := relayConfig([]string{"--token", "t", "--clients-file", clients}, none, io.Discard)
	if err == nil || !strings.Contains(err.Error(), `"dave"`) || !strings.Contains(err.Error(), "--ledger-file") {
		t.Fatalf("a budget without --ledger-file: %v", err)
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
