package main

import (
	"io"
	"testing"
)

func TestRelayLimitAndTLSFlags(t *testing.T) {
	none := func(string) (string, bool) { return "", false }
	cfg, tf, err := relayConfig([]string{"--token", "t", "--no-auth", "--key-rpm", "60", "--key-concurrency", "4",
		"--metrics-key", "mk", "--tls-cert", "c.pem", "--tls-key", "k.pem"}, none, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.KeyRPM != 60 || cfg.KeyConcurrency != 4 || cfg.MetricsKey != "mk" || tf.cert != "c.pem" || tf.key != "k.pem" {
		t.Errorf("flags not applied: %+v %+v", cfg, tf)
	}
	env := map[string]string{"COMPUTEFLUX_KEY_RPM": "30", "COMPUTEFLUX_METRICS_KEY": "from-env"}
	cfg, _, err = relayConfig([]string{"--token", "t", "--no-auth"}, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, io.Discard)
	if err != nil || cfg.KeyRPM != 30 || cfg.MetricsKey != "from-env" {
		t.Errorf("environment not applied: %+v %v", cfg, err)
	}
	for _, args := range [][]string{
		{"--token", "t", "--no-auth", "--tls-cert", "c.pem"},
		{"--token", "t", "--no-auth", "--tls-key", "k.pem"},
	} {
		if _, _, err := relayConfig(args, none, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	for addr, want := range map[string]bool{"127.0.0.1:8080": true, "[::1]:80": true, "localhost:1": true, ":8080": false, "0.0.0.0:80": false, "10.0.0.1:80": false} {
		if got := isLoopbackListen(addr); got != want {
			t.Errorf("isLoopbackListen(%q) = %v", addr, got)
		}
	}
}
