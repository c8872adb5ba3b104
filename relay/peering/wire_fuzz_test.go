package peering

import (
	"slices"
	"testing"

	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler"
)

func FuzzDecodeBindings(f *testing.F) {
	valid, _ := encodeBindings([]scheduler.Binding{
		{Key: "chat-42", Endpoint: "gpu1", Gen: 1, Since: 1_796_000_000_000_000_000, Last: 1_796_000_000_500_000_000},
		{Key: "k", Endpoint: "gpu2", Gen: 7, Since: 5, Last: 5},
	}, peerBatchBytes)
	f.Add(valid)
	f.Add([]byte{0})
	f.Add([]byte{1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		bs, err := decodeBindings(b)
		if err != nil {
			return
		}
		for _, x := range bs {
			if x.Key == "" || len(x.Key) > maxPeerKey || x.Endpoint == "" || len(x.Endpoint) > maxPeerEndpoint || x.Gen == 0 || x.Last < x.Since {
				t.Fatalf("decoded an out-of-bounds binding %+v", x)
			}
		}
		// What decodes re-encodes to the same bytes.
		again, n := encodeBindings(bs, maxPeerFrame)
		if n != len(bs) {
			t.Fatalf("re-encoded %d of %d", n, len(bs))
		}
		back, err := decodeBindings(again)
		if err != nil || !slices.Equal(back, bs) {
			t.Fatalf("round trip: %v\n%+v\n%+v", err, bs, back)
		}
	})
}

func TestEncodeBindingsSplitsFrames(t *testing.T) {
	var bs []scheduler.Binding
	for i := range 5000 {
		bs = append(bs, scheduler.Binding{Key: string(rune('a'+i%26)) + "-session-key-of-some-length", Endpoint: "agent-1", Gen: 1, Since: int64(i), Last: int64(i + 1)})
	}
	total := 0
	for rest := bs; len(rest) > 0; {
		body, n := encodeBindings(rest, peerBatchBytes)
		if len(body) > peerBatchBytes+64 || n == 0 {
			t.Fatalf("frame of %d bytes for %d bindings", len(body), n)
		}
		got, err := decodeBindings(body)
		if err != nil || len(got) != n || got[0] != rest[0] {
			t.Fatalf("decode: %v, %d of %d", err, len(got), n)
		}
		total += n
		rest = rest[n:]
	}
	if total != len(bs) {
		t.Fatalf("encoded %d of %d", total, len(bs))
	}
}

func FuzzDecodeSpent(f *testing.F) {
	valid, _ := encodeSpent([]ledger.ClientSpent{
		{Client: "alice", Spent: ledger.Spent{Day: 20_424, Month: 24_323, DayTokens: 418, MonthTokens: 9_000, MonthCost: 1_250_000}},
		{Client: "key-0a1b2c3d4e5f", Spent: ledger.Spent{Day: 20_424, Month: 24_323, DayTokens: 1}},
	}, peerBatchBytes)
	f.Add(valid)
	f.Add([]byte{0})
	f.Add([]byte{1, 1, 'a', 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		cs, err := decodeSpent(b)
		if err != nil {
			return
		}
		for _, c := range cs {
			if c.Client == "" || len(c.Client) > maxPeerClient || c.Day < 0 || c.Month < 0 ||
				c.DayTokens < 0 || c.DayTokens > maxPeerSpent || c.MonthTokens < 0 || c.MonthTokens > maxPeerSpent ||
				c.MonthCost < 0 || c.MonthCost > maxPeerSpent {
				t.Fatalf("decoded an out-of-bounds report %+v", c)
			}
		}
		// What decodes re-encodes to the same report.
		again, n := encodeSpent(cs, maxPeerFrame)
		if n != len(cs) {
			t.Fatalf("re-encoded %d of %d", n, len(cs))
		}
		back, err := decodeSpent(again)
		if err != nil || !slices.Equal(back, cs) {
			t.Fatalf("round trip: %v\n%+v\n%+v", err, cs, back)
		}
	})
}
