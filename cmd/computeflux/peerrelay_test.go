package main

import (
	"io"
	"testing"
	"time"
)

func TestRelayPeerFlags(t *testing.T) {
	const peerA = "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A"
	env := map[string]string{"COMPUTEFLUX_PEER_RELAY": peerA, "COMPUTEFLUX_WARM_UP": "3s"}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	cfg, _, err := relayConfig([]string{"--token", "t", "--no-auth"}, lookup, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Peers.Relays) != 1 || cfg.Peers.Relays[0].ID.String() != "12D3KooWGzh9fVnBvQUzvTDiStHRrptQhY1SDCNwX5UzqjmdBM1A" || cfg.WarmUp != 3*time.Second || cfg.Peers.Disabled {
		t.Errorf("peers %+v warm-up %v", cfg.Peers, cfg.WarmUp)
	}
	if _, _, err := relayConfig([]string{"--token", "t", "--no-auth", "--peer-relay", "/ip4/127.0.0.1/udp/1/quic-v1"}, lookup, io.Discard); err == nil {
		t.Error("a peer relay without /p2p/ was accepted")
	}
	cfg, _, err = relayConfig([]string{"--token", "t", "--no-auth", "--no-peer-relays"}, lookup, io.Discard)
	if err != nil || !cfg.Peers.Disabled {
		t.Errorf("--no-peer-relays: %v %+v", err, cfg.Peers)
	}
}
