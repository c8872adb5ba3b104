package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/relay/relaytest/ports"

	"github.com/computeflux/computeflux/agent"
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

func TestFindUpstream(t *testing.T) {
	sim := func() (*httptest.Server, agent.EnginePort) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/v1/models":
				io.WriteString(w, `{"object":"list","data":[{"id":"m1","object":"model","owned_by":"ollama-like"}]}`)
			case "/api/version":
				io.WriteString(w, `{"version":"0.12.6"}`)
			case "/api/ps":
				io.WriteString(w, `{"models":[]}`)
			default:
				http.NotFound(w, r)
			}
		}))
		t.Cleanup(srv.Close)
		port, _ := strconv.Atoi(srv.URL[strings.LastIndexByte(srv.URL, ':')+1:])
		return srv, agent.EnginePort{Port: port, Engine: "Ollama"}
	}
	_, closed0, _ := net.SplitHostPort(ports.Free(t, "tcp"))
	closedPort, _ := strconv.Atoi(closed0)
	closed := agent.EnginePort{Port: closedPort, Engine: "vLLM"}

	srv, p := sim()
	var out strings.Builder
	got, err := findUpstream(context.Background(), []agent.EnginePort{closed, p}, &out)
	if err != nil || got != srv.URL || !strings.Contains(out.String(), "found ollama 0.12.6 at "+srv.URL) {
		t.Fatalf("one engine: %q %v, said %q", got, err, out.String())
	}
	_, err = findUpstream(context.Background(), []agent.EnginePort{closed}, io.Discard)
	if !errors.Is(err, agent.ErrNoEngine) || !strings.Contains(err.Error(), strconv.Itoa(closedPort)+" (vLLM)") || !strings.Contains(err.Error(), "--upstream http://HOST:PORT") {
		t.Fatalf("none: %v", err)
	}
	srv2, p2 := sim()
	_, err = findUpstream(context.Background(), []agent.EnginePort{p, p2}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "--upstream "+srv.URL) || !strings.Contains(err.Error(), "--upstream "+srv2.URL) {
		t.Fatalf("several: %v", err)
	}
}
