package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// curlRE takes the printed curl line apart: URL, the three headers, body.
var curlRE = regexp.MustCompile(`^curl -sN (\S+) -H "Authorization: Bearer (\S+)" -H "Content-Type: application/json" -H "X-Session-ID: (\S+)" -d '(.+)'$`)

// The demo prints a relay URL, a key and a curl line that work, prints the
// comparison table and stops when asked.
func TestDemo(t *testing.T) {
	slow.Gate(t, "starts clusters over QUIC")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := runDemo(ctx, []string{"--engines", "3", "--sessions", "2", "--turns", "3", "--compare-time-scale", "4", "--duration", "10m"}, pw, io.Discard)
		pw.CloseWithError(io.EOF)
		done <- err
	}()
	sc := bufio.NewScanner(pr)
	var relayURL, key string
	tried, table, verdict := false, false, false
	hits := map[string]float64{}
	failed := map[string]int{}
	var ratio float64
	deadline := time.AfterFunc(3*time.Minute, cancel)
	defer deadline.Stop()
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		t.Log(line)
		if u, ok := strings.CutPrefix(line, "Relay URL:"); ok {
			relayURL = strings.TrimSpace(u)
		}
		if k, ok := strings.CutPrefix(line, "Client key:"); ok {
			key = strings.TrimSpace(k)
		}
		if m := curlRE.FindStringSubmatch(line); m != nil {
			if !strings.HasPrefix(m[1], strings.TrimSuffix(relayURL, "/v1")) || m[2] != key {
				t.Fatalf("curl line %q does not match URL %q and key %q", line, relayURL, key)
			}
			curl(t, m[1], m[2], m[3], m[4])
			tried = true
		}
		// The summary: one row per policy, its cache hit share, then the
		// verdict with the medians.
		if f := strings.Fields(line); len(f) == 9 && (f[0] == "sticky" || f[0] == "round-robin") {
			h, err := strconv.ParseFloat(strings.TrimSuffix(f[7], "%"), 64)
			if err != nil {
				t.Fatalf("summary row %q: %v", line, err)
			}
			n, err := strconv.Atoi(f[8])
			if err != nil {
				t.Fatalf("summary row %q: %v", line, err)
			}
			hits[f[0]], failed[f[0]] = h, n
			table = true
		}
		if strings.Contains(line, ": failed: ") {
			t.Errorf("a turn failed: %s", line)
		}
		if m := verdictRE.FindStringSubmatch(line); m != nil {
			r, err := strconv.ParseFloat(m[1], 64)
			if err != nil {
				t.Fatalf("verdict %q: %v", line, err)
			}
			ratio, verdict = r, true
		}
		if strings.HasPrefix(line, "Serving at") {
			cancel()
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !tried || !table || !verdict {
		t.Fatalf("the demo printed no usable curl line (%v), no summary (%v) or no verdict (%v)", tried, table, verdict)
	}
	if failed["sticky"] != 0 || failed["round-robin"] != 0 {
		t.Errorf("failed turns: %v", failed)
	}
	// Sticky keeps each conversation on the engine that holds it: its later
	// turns (two of three, 2/3 of the prompt tokens) are cached but their
	// newest message, 66.4% of all prompt tokens. With 3 engines and 2
	// conversations round-robin sends a later turn to an engine that holds
	// only the shared system prompt when the turns arrive in their usual
	// order (1.0%); when a slow turn 2 swaps that order, its cycle lands
	// up to half the later turns on their engine (33.5% seen under CI's
	// load). With 2 and 2 it would send each conversation to the same
	// engine every turn, and tie. Counted,
	// not timed: the verdict's time-to-first-token ratio (6.3x to 18.8x
	// here, 1.2x on a machine starved by other work) is a speed figure,
	// for the demo to print, not for a test to bound.
	if len(hits) != 2 || hits["sticky"] < minStickyHits || hits["sticky"] < hits["round-robin"]+minHitLead {
		t.Errorf("cache hits %v: want sticky at least %.0f%% and %.0f points above round-robin's", hits, minStickyHits, minHitLead)
	}
	if ratio <= 0 {
		t.Errorf("verdict ratio %v", ratio)
	}
}

// TestDemo's bounds on the share of prompt tokens found cached (see there):
// sticky's, and its lead over round-robin's.
const (
	minStickyHits = 60.0
	minHitLead    = 30.0
)

// verdictRE reads the ratio of the demo's verdict line.
var verdictRE = regexp.MustCompile(`^Sticky routing: median time to first token ([0-9.]+)x lower than round-robin`)

// curl does what the printed curl line does, twice, and checks the
// streamed answers and that the second turn is an affinity hit.
func curl(t *testing.T, url, key, session, body string) {
	t.Helper()
	for turn := 1; turn <= 2; turn++ {
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Session-ID", session)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"cached_tokens"`) || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") {
			t.Fatalf("turn %d: status %d, body %q", turn, resp.StatusCode, b)
		}
		if aff := resp.Header.Get("X-ComputeFlux-Affinity"); turn == 2 && aff != "hit" {
			t.Fatalf("second turn affinity %q, want hit", aff)
		}
	}
}
