package relay_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
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
// command (with RELAY:8080 and the key file replaced), and the Node examples
// with the official OpenAI client and Anthropic's SDK (skipped with the reason when node, npm
// or the registry is missing).
func TestREADMEClients(t *testing.T) {
	slow.Gate(t, "runs the README's curl and Node examples")
	t.Parallel() // waits on npm and client processes, with its own relay
	rl := startRelay(t, "", "")
	responsesFleet(t, rl, "readme-1", "readme-2")
	host := strings.TrimPrefix(rl.URL, "http://")
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
	if len(js) != 2 {
		t.Fatalf("want two Node examples in the README (OpenAI's client, Anthropic's), found %d", len(js))
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed; the README's Node examples were not run")
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Skip("npm is not installed; the README's Node examples were not run")
	}
	dir := t.TempDir()
	install := exec.CommandContext(ctx, npm, "install", "--prefix", dir, "--no-audit", "--no-fund", "--loglevel=error",
		"openai@"+openaiNodeVersion, "@anthropic-ai/sdk@"+anthropicSDKVersion)
	install.Env = append(os.Environ(), "npm_config_update_notifier=false")
	if out, err := install.CombinedOutput(); err != nil {
		t.Skipf("npm install failed (registry unavailable?); the README's Node examples were not run: %v\n%s", err, out)
	}
	run := func(i int) []string {
		t.Helper()
		src := strings.ReplaceAll(js[i], "http://RELAY:8080", rl.URL)
		src = strings.ReplaceAll(src, "'sk-...'", "'"+itKey+"'")
		script := filepath.Join(dir, fmt.Sprintf("example%d.mjs", i)) // beside node_modules, so the import resolves
		if err := os.WriteFile(script, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.CommandContext(ctx, node, script).CombinedOutput()
		if err != nil {
			t.Fatalf("README Node example %d: %v\n%s", i+1, err, out)
		}
		t.Logf("README Node example %d printed:\n%s", i+1, out)
		return strings.Split(strings.TrimSpace(string(out)), "\n")
	}
	isCount := func(s string) bool { return s != "" && strings.Trim(s, "0123456789") == "" }
	// OpenAI's: the second turn's text and its cached tokens (a count),
	// then the streamed chat answer.
	lines := run(0)
	f := strings.Fields(lines[0])
	if len(lines) != 2 || len(f) < 2 || !isCount(f[len(f)-1]) || len(strings.Fields(lines[1])) == 0 {
		t.Fatalf("README's OpenAI example printed %q", lines)
	}
	// Anthropic's: the answer's text and its input tokens.
	lines = run(1)
	if f := strings.Fields(lines[0]); len(lines) != 1 || len(f) < 2 || !isCount(f[len(f)-1]) || f[len(f)-1] == "0" {
		t.Fatalf("README's Anthropic example printed %q", lines)
	}
}
