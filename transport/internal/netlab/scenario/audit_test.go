package scenario

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/transport/internal/netlab"
)

// TestAuditSybilsBehindOneAddress: one contributor runs three agents in
// one home, behind its router's one address, serving another model (sim
// engine seed 2) under the shared model's name; two other homes serve it
// honestly (seed 1). There is no operator's reference. The relay counts
// agents behind one address as one voice (--audit-independence address:
// the lab's homes share the public /24, which the default, network, would
// count as one voice too), so the three liars are one voice against two:
// all three are quarantined and the honest agents are not. Clients send
// sampled requests with a user field. The audits' floor is shortened to
// keep the test short; what convicts is the count of voices, not the
// pace.
func TestAuditSybilsBehindOneAddress(t *testing.T) {
	slow.Gate(t, "network namespaces and real processes")
	bin := binary(t)
	eim := netlab.EndpointIndependent
	dir, err := os.MkdirTemp("", "natlab-audit")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := NewCluster(ctx, ClusterConfig{Bin: bin, Dir: dir, Homes: []netlab.NATKind{eim, eim, eim}, Seeds: []uint64{2, 1, 1},
		Prefix: os.Getenv("CF_NATLAB_PREFIX"), Logf: func(string, ...any) {},
		RelayArgs: []string{"--audit-independence", "address", "--audit-floor", "3s"}})
	if err != nil {
		t.Fatalf("cluster (logs in %s): %v", dir, err)
	}
	defer func() {
		c.Close()
		if t.Failed() {
			t.Logf("logs kept in %s", dir)
			return
		}
		_ = os.RemoveAll(dir)
	}()
	liars := []string{AgentName(0), "h0-b", "h0-c"}
	for _, n := range liars[1:] {
		if err := c.AddAgent(ctx, 0, n); err != nil {
			t.Fatal(err)
		}
	}
	quarantined := func() map[string]bool {
		out := map[string]bool{}
		for _, l := range c.Relay.Log.Lines(0, Msg("agent quarantined for model")) {
			if l.Str("model") == SharedModel {
				out[l.Str("agent")] = true
			}
		}
		return out
	}
	// Sampled traffic until the liars are out, two minutes at most.
	served := map[string]int{}
	deadline := time.Now().Add(2 * time.Minute)
	for i := 0; time.Now().Before(deadline); i++ {
		q := quarantined()
		if q[liars[0]] && q[liars[1]] && q[liars[2]] {
			break
		}
		agent, err := c.sampled(ctx, i)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		served[agent]++
		time.Sleep(20 * time.Millisecond)
	}
	q := quarantined()
	t.Logf("served %v; quarantined %v", served, q)
	for _, n := range liars {
		if !q[n] {
			t.Errorf("%s (one of three liars behind one address) was not quarantined", n)
		}
	}
	for _, n := range []string{AgentName(1), AgentName(2)} {
		if q[n] {
			t.Errorf("honest %s was quarantined", n)
		}
	}
	// Afterwards the honest homes serve everything.
	for i := range 20 {
		agent, err := c.sampled(ctx, 10000+i)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(agent, "h0") {
			t.Errorf("a quarantined liar (%s) served a request", agent)
		}
	}
}

// sampled sends one chat request as front ends send it (temperature 0.8,
// a user) from the client namespace and returns the agent that served it.
func (c *Cluster) sampled(ctx context.Context, i int) (string, error) {
	body, _ := json.Marshal(map[string]any{"model": SharedModel, "max_tokens": 8, "temperature": 0.8,
		"user":     fmt.Sprintf("user-%04d", 1000+i%7),
		"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("question %d about the river and the old bridge", i)}}})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+RelayHTTP+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return resp.Header.Get("X-ComputeFlux-Agent"), nil
}
