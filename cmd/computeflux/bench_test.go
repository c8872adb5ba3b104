package main

import (
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
