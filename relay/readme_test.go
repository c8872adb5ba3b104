package relay_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// readmeBlocks returns the README's fenced code blocks of a language.
func readmeBlocks(t *testing.T, lang string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile("(?ms)^```" + lang + "\n(.*?)^```")
	var out []string
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		out = append(out, m[1])
	}
	return out
}

// TestREADMEClients runs the README's client examples, as written, against
// a relay with package agents in front of sim engines over QUIC: every curl
// command (with RELAY:8080 and the key file replaced), and the Node example
// with the official OpenAI client (skipped with the reason when node, npm
// or the registry is missing).
func TestREADMEClients(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: starts a cluster and installs the npm package openai")
	}
	t.Parallel() // waits on npm and client processes, with its own relay
	rl := startRelay(t, "", "")
	a, b := startSimAgent(t, rl, "readme-1"), startSimAgent(t, rl, "readme-2")
	waitResponsesAgents(t, rl, a, b)
	host := strings.TrimPrefix(rl.url, "http://")
	keyFile := filepath.Join(t.TempDir(), "api-keys")
	if err := os.WriteFile(keyFile, []byte(itKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	curls := 0
	for _, block := range readmeBlocks(t, "sh") {
		if !strings.HasPrefix(block, "curl ") {
			continue
		}
		curls++
		cmdline := strings.ReplaceAll(strings.TrimSpace(block), "RELAY:8080", host)
		cmdline = strings.ReplaceAll(cmdline, "$(cat api-keys)", "$(cat "+keyFile+")")
		cmd := exec.CommandContext(ctx, "bash", "-c", "set -o pipefail; "+cmdline+" --fail-with-body")
		out, err := cmd.CombinedOutput()
		if err != nil || strings.Contains(string(out), `"error"`) {
			t.Errorf("README curl failed: %v\n%s\n%s", err, block, out)
			continue
		}
		if !strings.Contains(string(out), "data: [DONE]") && !strings.Contains(string(out), `"object":"response"`) {
			t.Errorf("README curl answered %s", out)
		}
	}
	if curls < 2 {
		t.Fatalf("found %d curl examples in the README, want the chat and the Responses one", curls)
	}

	js := readmeBlocks(t, "js")
	if len(js) != 1 {
		t.Fatalf("want one Node example in the README, found %d", len(js))
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed; the README's Node example was not run")
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Skip("npm is not installed; the README's Node example was not run")
	}
	dir := t.TempDir()
	install := exec.CommandContext(ctx, npm, "install", "--prefix", dir, "--no-audit", "--no-fund", "--loglevel=error", "openai@"+openaiNodeVersion)
	install.Env = append(os.Environ(), "npm_config_update_notifier=false")
	if out, err := install.CombinedOutput(); err != nil {
		t.Skipf("npm install openai failed (registry unavailable?); the README's Node example was not run: %v\n%s", err, out)
	}
	src := strings.ReplaceAll(js[0], "http://RELAY:8080", rl.url)
	src = strings.ReplaceAll(src, "'sk-...'", "'"+itKey+"'")
	script := filepath.Join(dir, "example.mjs") // beside node_modules, so the import resolves
	if err := os.WriteFile(script, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(ctx, node, script).CombinedOutput()
	if err != nil {
		t.Fatalf("README Node example: %v\n%s", err, out)
	}
	// It prints the second turn's text and its cached tokens (a count),
	// then the streamed chat answer.
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	f := strings.Fields(lines[0])
	if len(lines) != 2 || len(f) < 2 || strings.Trim(f[len(f)-1], "0123456789") != "" || len(strings.Fields(lines[1])) == 0 {
		t.Fatalf("README Node example printed:\n%s", out)
	}
	t.Logf("README Node example printed:\n%s", out)
}
