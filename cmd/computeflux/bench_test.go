package main

import (
	"context"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/cmd/computeflux/internal/bench"
)

// --keyless is another spelling of --keys without: alone or with that
// setting it sends no keys; with keys asked for as well it is refused
// rather than run keyless under a "keys" label.
func TestBenchKeylessIsKeysWithout(t *testing.T) {
	for _, args := range [][]string{{"--keyless"}, {"--keyless", "--keys", "without"}, {"--keys", "without"}} {
		cfg, _, _, _, err := benchConfig(args, io.Discard)
		if err != nil || cfg.Keys != bench.KeysWithout {
			t.Errorf("%q: keys %q, %v", args, cfg.Keys, err)
		}
	}
	for _, k := range []string{bench.KeysWith, bench.KeysBoth} {
		if _, _, _, _, err := benchConfig([]string{"--keys", k, "--keyless"}, io.Discard); err == nil || !strings.Contains(err.Error(), "keyless") {
			t.Errorf("keys %q with keyless: %v", k, err)
		}
	}
}

// bench --overhead's help lists the rows, stock-floor among them, and its
// flags but the ones the benchmark runs itself with; those exclude each
// other.
func TestBenchOverheadUsage(t *testing.T) {
	var help strings.Builder
	if err := runOverhead(context.Background(), []string{"-h"}, io.Discard, &help); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h: %v", err)
	}
	for _, want := range []string{"stock-floor", "go-reverse-proxy", "-requests", "-base-binary"} {
		if !strings.Contains(help.String(), want) {
			t.Errorf("help lacks %q:\n%s", want, help.String())
		}
	}
	for _, hidden := range []string{"-serve-reverse-proxy", "-serve-stock-floor-relay", "-serve-stock-floor-agent", "-addr-file", "-upstream"} {
		if strings.Contains(help.String(), hidden) {
			t.Errorf("help lists %q:\n%s", hidden, help.String())
		}
	}
	err := runOverhead(context.Background(), []string{"--serve-stock-floor-relay", "127.0.0.1:0", "--serve-stock-floor-agent", "/ip4/127.0.0.1/udp/1/quic-v1"}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "exclude each other") {
		t.Fatalf("two serve flags: %v", err)
	}
}
