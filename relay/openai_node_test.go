package relay_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// TestOpenAINodeClient drives the relay with the official OpenAI client for
// Node (npm "openai"), installed into a temporary directory. It is skipped,
// with the reason, when node or npm is missing or the registry is out of
// reach.
func TestOpenAINodeClient(t *testing.T) {
	slow.Gate(t, "installs and runs the OpenAI SDK on Node")
	t.Parallel() // waits on npm and node, with its own relay
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := installOpenAINode(ctx, t, "openai")

	// A real relay over QUIC with two agents in front of OpenAI-like engines.
	rl := startRelay(t, "", "")
	for _, n := range []string{"a", "b"} {
		relaytest.RunAgent(t, relaytest.AgentConfig(n, itToken, relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: n}).URL(), rl.Addr()))
	}
	waitFor(t, "agents joined", func() bool {
		ags := rl.Relay.Registry().Agents()
		return len(ags) == 2 && len(ags[0].Models) == 1 && len(ags[1].Models) == 1
	})
	out := runNodeScript(ctx, t, "openai_client.mjs", dir, "RELAY_URL="+rl.URL, "API_KEY="+itKey, "MODEL=m1")
	var got struct {
		Content, Agent, Streamed string
		Chunks                   int
		Models                   []string
		AuthError, ModelError    string
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("node output %q: %v", out, err)
	}
	t.Logf("node client saw %+v", got)
	if !strings.HasPrefix(got.Content, "hello from ") || got.Agent == "" {
		t.Errorf("non-streamed: content %q agent %q", got.Content, got.Agent)
	}
	// Same session (header, then prompt_cache_key): same agent.
	if got.Streamed != got.Content || got.Chunks != 2 {
		t.Errorf("streamed %q in %d chunks, want %q in 2", got.Streamed, got.Chunks, got.Content)
	}
	if strings.Join(got.Models, ",") != "m1" {
		t.Errorf("models %v", got.Models)
	}
	if got.AuthError != "401 invalid_api_key" || got.ModelError != "404 model_not_found" {
		t.Errorf("errors as the SDK sees them: auth %q, model %q", got.AuthError, got.ModelError)
	}
}

// installOpenAINode installs the npm package spec (openai, or openai@version)
// into a temporary directory and returns it. The test is skipped, with the
// reason, in -short mode, when node or npm is missing, or when the registry
// is out of reach.
func installOpenAINode(ctx context.Context, t *testing.T, spec string) string {
	t.Helper()
	if testing.Short() {
		t.Skip("skipped in -short mode: installs the npm package openai")
	}
	if _, err := exec.LookPath("node"); err != nil {
		t.Skip("node is not installed; skipping the OpenAI Node client test")
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Skip("npm is not installed; skipping the OpenAI Node client test")
	}
	dir := t.TempDir()
	install := exec.CommandContext(ctx, npm, "install", "--prefix", dir, "--no-audit", "--no-fund", "--loglevel=error", spec)
	install.Env = append(os.Environ(), "npm_config_update_notifier=false")
	if out, err := install.CombinedOutput(); err != nil {
		t.Skipf("npm install %s failed (registry unavailable?); skipping: %v\n%s", spec, err, out)
	}
	return dir
}

// runNodeScript runs testdata/script with node, the installed packages in
// dir and env added to the environment, and returns its standard output.
// A failing script fails the test with its output.
func runNodeScript(ctx context.Context, t *testing.T, script, dir string, env ...string) []byte {
	t.Helper()
	path, err := filepath.Abs(filepath.Join("testdata", script))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, "node", path, dir)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("node client: %v\n%s\n%s", err, out, stderr)
	}
	return out
}
