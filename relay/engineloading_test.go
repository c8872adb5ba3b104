package relay_test

import (
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// TestEngineLoadingThroughRealParts: an engine that is still loading when
// its agent starts answers /v1/models but 503 on everything else, as
// llama.cpp's server does while it loads its model. The agent (package
// agent, joined to a relay over QUIC) serves the model list meanwhile;
// once the engine has loaded, the agent identifies it again and the relay
// routes the Responses API, which only a recognised engine gets, to it.
func TestEngineLoadingThroughRealParts(t *testing.T) {
	slow.Gate(t, "waits on an engine loading its model")
	eng, stopEngine := relaytest.RunSimEngine(t, fastSim)
	defer stopEngine()
	var loading atomic.Bool
	loading.Store(true)
	front := relaytest.Front(t, eng.URL(), func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if loading.Load() && r.URL.Path != "/v1/models" {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, `{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}`)
			return
		}
		next.ServeHTTP(w, r)
	})

	rl := startRelay(t, "", "")
	ra := relaytest.RunAgent(t, indexAgentConfig("loading", front, 0, rl.Addr())) // refreshes every 200 ms
	waitAgents(t, rl, "loading")
	if k := ra.Agent.Engine().Kind; k != agent.EngineUnknown {
		t.Fatalf("engine %q while it loads, want not identified yet", k)
	}
	body := fmt.Sprintf(`{"model":%q,"input":"Hello"}`, simengine.DefaultModel)
	if resp, b := postJSON(t, rl.URL+"/v1/responses", body); resp.StatusCode == http.StatusOK {
		t.Fatalf("Responses API served before the engine was identified: %s", b)
	}

	loading.Store(false)
	loadedAt := time.Now()
	waitFor(t, "the engine identified after loading", func() bool { return ra.Agent.Engine().Kind == agent.EngineSim })
	identified := time.Since(loadedAt)
	var resp *http.Response
	var b []byte
	waitFor(t, "the relay routing the Responses API to the agent", func() bool {
		resp, b = postJSON(t, rl.URL+"/v1/responses", body)
		return resp.StatusCode == http.StatusOK
	})
	if got := resp.Header.Get("X-ComputeFlux-Agent"); got != "loading" {
		t.Fatalf("served by %q: %s", got, b)
	}
	if n := ra.Agent.KVCapacityTokens(); n <= 0 {
		t.Fatalf("KV capacity %d after identification", n)
	}
	t.Logf("identified %v after the engine loaded (refresh every 200 ms)", identified.Round(time.Millisecond))
}
