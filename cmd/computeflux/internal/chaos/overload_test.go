package chaos

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// The overload scenario through real processes, short: two relays, two
// engines of four slots. The light client (on the first relay) is served
// between the heavy client's requests (on the second), not behind its
// backlog; two heavy clients of weights 2 and 1 share the fleet 2:1; the
// first relay killed and started again answers every request sent to it
// after its start. Ratios are taken within one run, side by side: with
// the queue off (--queue-wait=-1s --dispatch-limit=-1) the light client's
// time to first token under the flood equals the heavy client's, and the
// restarted relay answers 503 until its agents rejoin.
func TestOverloadRealProcesses(t *testing.T) {
	slow.Gate(t, "runs the computeflux binary as processes")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := RunOverload(ctx, OverloadConfig{Binary: binary, Relays: 2, Phase: 8 * time.Second, HeavySpread: 0.5,
		Weighted: true, RestartRelay: true, Progress: testWriter{t}})
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	res.Write(&sb)
	for _, l := range strings.Split(strings.TrimSpace(sb.String()), "\n") {
		t.Log(l)
	}
	for name, f := range map[string]ClientFigures{"light alone": res.LightAlone, "heavy alone": res.HeavyAlone,
		"light under the flood": res.LightFlood, "heavy with light": res.HeavyFlood,
		"heavy weight 2": res.HeavyTwo, "heavy weight 1": res.HeavyOne, "sent after the relay's restart": res.Restart} {
		if f.failed() > 0 {
			t.Errorf("%s: failed %v", name, f.Failed)
		}
		if f.Done == 0 {
			t.Errorf("%s: nothing served", name)
		}
	}
	// Without the queue the light client waits behind the whole backlog:
	// its median time to first token is the heavy client's. With it, the
	// light client waits for one slot at most.
	if l, h := res.LightFlood.TTFT.P50, res.HeavyFlood.TTFT.P50; l > h/3 {
		t.Errorf("light client's TTFT p50 under the flood %v is more than a third of the heavy client's %v", l, h)
	}
	if res.HeavyOne.Streamed > 0 {
		if r := float64(res.HeavyTwo.Streamed) / float64(res.HeavyOne.Streamed); r < 1.6 || r > 2.4 {
			t.Errorf("weights 2 and 1 got %.2f : 1 of the tokens, want 2 within 20%%", r)
		}
	}
	if res.Restart.Done < 20 {
		t.Errorf("only %d requests answered after the relay's restart", res.Restart.Done)
	}
}
