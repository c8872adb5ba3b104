package transport

import (
	"testing"

	"github.com/computeflux/computeflux/scheduler"
)

func TestFlowHeaderRoundTrip(t *testing.T) {
	f := Flow{Client: "alice", Weight: 2.5, Class: scheduler.BandBatch, Cost: 1234}
	if got := ParseFlow(f.String()); got != f {
		t.Fatalf("round trip: %+v from %q", got, f.String())
	}
	for in, want := range map[string]Flow{
		"":                                      {},
		"client=bob":                            {Client: "bob"},
		"weight=x, class=urgent, cost=-, other": {},
		" client=c ,cost=7":                     {Client: "c", Cost: 7},
	} {
		if got := ParseFlow(in); got != want {
			t.Errorf("ParseFlow(%q) = %+v, want %+v", in, got, want)
		}
	}
}

func FuzzParseFlow(f *testing.F) {
	f.Add("client=alice, weight=2, class=batch, cost=100")
	f.Add("client=, weight=NaN, class=, cost=1e400")
	f.Fuzz(func(t *testing.T, s string) {
		fl := ParseFlow(s)
		if len(fl.Client) > 256 {
			t.Fatalf("client of %d bytes kept", len(fl.Client))
		}
	})
}
