package bench

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/scheduler"
)

// A short live run through a real relay, agents and engines: sticky keeps
// more of the cache than round-robin on multi-turn chat, and the engines
// see exactly the prompts the simulation builds.
func TestLiveStickyBeatsRoundRobin(t *testing.T) {
	slow.Gate(t, "starts a cluster over QUIC")
	cfg, rp := runLiveStickyRoundRobin(t, 0)
	if sticky := rp.Results[0]; sticky.HitRatio > rp.Oracle+1e-9 {
		t.Fatalf("sticky's hit ratio %.3f is above the oracle's %.3f", sticky.HitRatio, rp.Oracle)
	}

	cfg.Mode = ModeSim
	sim, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range sim.Results {
		if r.PromptTokens != rp.Results[i].PromptTokens || r.OutputTokens != rp.Results[i].OutputTokens {
			t.Fatalf("%s: live sent %d prompt and got %d completion tokens, the simulation %d and %d",
				r.Policy, rp.Results[i].PromptTokens, rp.Results[i].OutputTokens, r.PromptTokens, r.OutputTokens)
		}
	}
}

// runLiveStickyRoundRobin runs a short live chat workload over relays real
// relays (0: the one-relay cluster) with sticky and round-robin routing,
// and fails t unless every turn was answered and sticky hit the cache more
// often than round-robin. It returns the config and the report.
func runLiveStickyRoundRobin(t *testing.T, relays int) (Config, *Report) {
	t.Helper()
	cfg := Config{
		Mode:      ModeLive,
		Engines:   3,
		Relays:    relays,
		Seed:      2,
		TimeScale: 50,
		Policies:  []scheduler.Policy{scheduler.PolicySticky, scheduler.PolicyRoundRobin},
		Chat:      ChatConfig{Sessions: 12, SystemTokens: 1000, MeanTurns: 4, Think: 2 * time.Second, ArrivalSpan: 5 * time.Second},
	}
	rp, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	sticky, rr := rp.Results[0], rp.Results[1]
	t.Logf("oracle %.3f, sticky %.3f (%d relays, %d binding updates, %.0f B/s per relay), round-robin %.3f",
		rp.Oracle, sticky.HitRatio, relays, sticky.BindingUpdates, sticky.BindingBytesPerSec, rr.HitRatio)
	for _, r := range rp.Results {
		if r.Errors != 0 || r.Requests != rp.Turns || r.Relays != relays {
			t.Fatalf("%s: %d errors (%v) in %d requests over %d relays, want %d requests over %d", r.Policy, r.Errors, r.ErrorCauses, r.Requests, r.Relays, rp.Turns, relays)
		}
	}
	if sticky.HitRatio <= rr.HitRatio {
		t.Fatalf("sticky's hit ratio %.3f is not above round-robin's %.3f", sticky.HitRatio, rr.HitRatio)
	}
	return cfg, rp
}

// ReadStream joins the deltas, reads the usage chunk, calls first once at
// the first content and refuses an error chunk, a bad chunk or an answer
// without content.
func TestReadStream(t *testing.T) {
	const ok = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n" +
		": keep-alive\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\n" +
		"data: [DONE]\n\n"
	firsts := 0
	r, err := ReadStream(strings.NewReader(ok), func() { firsts++ })
	if err != nil || r != (StreamReply{Answer: "Hello", PromptTokens: 7, CompletionTokens: 2, CachedTokens: 5, Usage: true, Done: true}) || firsts != 1 {
		t.Fatalf("reply %+v, %v, first called %d times", r, err, firsts)
	}
	for in, want := range map[string]string{
		"data: {\"error\":{\"message\":\"engine gone\"}}\n\n": "engine gone",
		"data: {\"choices\":\n\n":                             "stream:",
		"data: {\"choices\":[]}\n\ndata: [DONE]\n\n":          "ended early",
	} {
		if _, err := ReadStream(strings.NewReader(in), nil); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error with %q", in, err, want)
		}
	}
}

func FuzzReadStream(f *testing.F) {
	f.Add("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n")
	f.Add("data: {\"error\":{\"message\":\"x\"}}\n\n")
	f.Fuzz(func(t *testing.T, in string) {
		r, err := ReadStream(strings.NewReader(in), nil)
		if err == nil && r.Answer == "" {
			t.Fatalf("%q: no error and no answer", in)
		}
	})
}
