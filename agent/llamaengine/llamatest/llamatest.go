// Package llamatest starts real llama.cpp engines (package llamaengine)
// for tests: it writes their tiny models into the test's temporary
// directory and stops the engines when the test ends. A test that needs
// engines is skipped, with the reason, when node or the npm packages are
// missing, unless COMPUTEFLUX_REQUIRE_LLAMA is set (as CI sets it after
// installing them): then it fails.
package llamatest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/llamaengine"
)

// RequireEnv is the environment variable that turns a missing engine from
// a skip into a failure.
const RequireEnv = "COMPUTEFLUX_REQUIRE_LLAMA"

// Need skips (or, with RequireEnv set, fails) t when engines cannot run
// here, and in -short mode.
func Need(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("skipped in -short mode: runs llama.cpp engines")
	}
	if err := llamaengine.Available(""); err != nil {
		if os.Getenv(RequireEnv) != "" {
			t.Fatalf("%s is set but: %v", RequireEnv, err)
		}
		t.Skipf("no llama.cpp engine here: %v", err)
	}
}

// Models writes one tiny model per seed into t's temporary directory and
// returns their paths.
func Models(t testing.TB, seeds ...uint64) []string {
	t.Helper()
	dir := t.TempDir()
	var out []string
	for _, s := range seeds {
		p := filepath.Join(dir, fmt.Sprintf("tiny-%d.gguf", s))
		if err := llamaengine.WriteModelFile(p, llamaengine.ModelConfig{Seed: s}); err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

// Engines starts one engine per model file, each serving it under name,
// logging to t, and closes them when t ends. It calls Need first.
func Engines(t testing.TB, name string, files ...string) []*llamaengine.Engine {
	t.Helper()
	Need(t)
	var out []*llamaengine.Engine
	for i, f := range files {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		e, err := llamaengine.Start(ctx, llamaengine.Config{Model: f, Name: name, Stderr: logWriter{t: t, prefix: fmt.Sprintf("engine %d: ", i)}})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		out = append(out, e)
	}
	return out
}

// logWriter writes an engine's log lines into the test's log.
type logWriter struct {
	t      testing.TB
	prefix string
}

func (w logWriter) Write(b []byte) (int, error) {
	if s := bytes.TrimRight(b, "\n"); len(s) > 0 {
		w.t.Logf("%s%s", w.prefix, s)
	}
	return len(b), nil
}
