package main

import (
	"io"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
)

func TestNATAndGossipFlags(t *testing.T) {
	env := map[string]string{"COMPUTEFLUX_GOSSIP_PROBE_TIMEOUT": "700ms"}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	cfg, _, err := relayConfig([]string{"--token", "t", "--no-auth",
		"--public-cidr", "100.64.0.0/10", "--public-cidr", "198.18.0.0/15,192.0.2.0/24",
		"--gossip-preset", "wan", "--gossip-probe-interval", "3s"}, lookup, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("100.64.0.0/10"), netip.MustParsePrefix("198.18.0.0/15"), netip.MustParsePrefix("192.0.2.0/24")}
	if !slices.Equal(cfg.PublicCIDRs, want) {
		t.Errorf("public CIDRs %v, want %v", cfg.PublicCIDRs, want)
	}
	if cfg.Gossip.Preset != "wan" || cfg.Gossip.Tune == nil || cfg.Gossip.Disabled {
		t.Fatalf("gossip config %+v", cfg.Gossip)
	}
	var mc memberlist.Config
	cfg.Gossip.Tune(&mc)
	if mc.ProbeInterval != 3*time.Second || mc.ProbeTimeout != 700*time.Millisecond || mc.SuspicionMult != 0 {
		t.Errorf("overrides not applied: interval %v timeout %v mult %d", mc.ProbeInterval, mc.ProbeTimeout, mc.SuspicionMult)
	}

	// From the environment, a comma list.
	env = map[string]string{"COMPUTEFLUX_PUBLIC_CIDR": "100.64.0.0/10, 10.9.0.0/16"}
	cfg, _, err = relayConfig([]string{"--token", "t", "--no-auth"}, lookup, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.PublicCIDRs) != 2 || cfg.Gossip.Tune != nil || cfg.Gossip.Preset != "home" {
		t.Errorf("env: CIDRs %v, gossip %+v", cfg.PublicCIDRs, cfg.Gossip)
	}
	// Defaults: no public ranges.
	cfg, _, err = relayConfig([]string{"--token", "t", "--no-auth"}, func(string) (string, bool) { return "", false }, io.Discard)
	if err != nil || len(cfg.PublicCIDRs) != 0 {
		t.Errorf("default public CIDRs %v (%v)", cfg.PublicCIDRs, err)
	}

	for _, bad := range [][]string{
		{"--public-cidr", "100.64.0.1"},
		{"--gossip-preset", "fast"},
		{"--gossip-suspicion-mult", "-1"},
		{"--gossip-relay", "/ip4/1.2.3.4/udp/1/quic-v1"},
	} {
		args := append([]string{"--token", "t", "--no-auth"}, bad...)
		if _, _, err := relayConfig(args, func(string) (string, bool) { return "", false }, io.Discard); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

func TestAgentIdentityDefault(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", dir)
	none := func(string) (string, bool) { return "", false }
	cfg, err := agentConfig([]string{"--name", "gpu box/1", "--public-cidr", "100.64.0.0/10", "--no-gossip"}, none, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "computeflux", "agent-gpu_box_1.key"); cfg.IdentityFile != want {
		t.Errorf("identity %q, want %q", cfg.IdentityFile, want)
	}
	if len(cfg.PublicCIDRs) != 1 || !cfg.Gossip.Disabled {
		t.Errorf("NAT or gossip flags lost: %v %+v", cfg.PublicCIDRs, cfg.Gossip)
	}
	cfg, err = agentConfig([]string{"--ephemeral-identity"}, none, io.Discard)
	if err != nil || cfg.IdentityFile != "" {
		t.Errorf("ephemeral: identity %q (%v)", cfg.IdentityFile, err)
	}
	if _, err := agentConfig([]string{"--ephemeral-identity", "--identity", "/x"}, none, io.Discard); err == nil {
		t.Error("both identity flags accepted")
	}
}
