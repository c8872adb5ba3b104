package main

import (
	"io"
	"testing"
)

func TestAgentConfigFlagsAndEnv(t *testing.T) {
	env := map[string]string{
		"COMPUTEFLUX_RELAY":           "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A",
		"COMPUTEFLUX_TOKEN_FILE":      "/run/secrets/token",
		"COMPUTEFLUX_UPSTREAM":        "http://127.0.0.1:9999",
		"COMPUTEFLUX_MAX_CONCURRENCY": "8",
		"COMPUTEFLUX_NAME":            "from-env",
	}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	cfg, err := agentConfig([]string{"--name", "from-flag", "--weight", "2.5", "--upstream-api-key", "k", "--log-format", "json"}, lookup, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Name != "from-flag" {
		t.Errorf("flag should win over env: name %q", cfg.Name)
	}
	if len(cfg.Relays) != 1 || cfg.Relays[0] != env["COMPUTEFLUX_RELAY"] || cfg.TokenFile != "/run/secrets/token" || cfg.Upstream != "http://127.0.0.1:9999" ||
		cfg.MaxConcurrency != 8 || cfg.Weight != 2.5 || cfg.UpstreamAPIKey != "k" {
		t.Errorf("config %+v", cfg)
	}
	const relayA = "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A"
	const relayB = "/ip4/127.0.0.1/udp/4002/quic-v1/p2p/12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK"
	multi, err := agentConfig([]string{"--relay", relayA, "--relay", relayB}, lookup, io.Discard)
	if err != nil || len(multi.Relays) != 2 || multi.Relays[0] != relayA || multi.Relays[1] != relayB {
		t.Errorf("repeated --relay: %v %q", err, multi.Relays)
	}
	env["COMPUTEFLUX_RELAY"] = relayA + ", " + relayB
	multi, err = agentConfig(nil, lookup, io.Discard)
	if err != nil || len(multi.Relays) != 2 || multi.Relays[1] != relayB {
		t.Errorf("comma list in COMPUTEFLUX_RELAY: %v %q", err, multi.Relays)
	}
	for _, bad := range [][]string{{"--log-format", "xml"}, {"--log-level", "loud"}, {"extra"}, {"--weight", "x"}} {
		if _, err := agentConfig(bad, lookup, io.Discard); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	if _, err := agentConfig(nil, func(k string) (string, bool) {
		if k == "COMPUTEFLUX_MAX_CONCURRENCY" {
			return "many", true
		}
		return "", false
	}, io.Discard); err == nil {
		t.Error("bad env value accepted")
	}
}
