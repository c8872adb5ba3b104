package ledger

import (
	"testing"
	"time"
)

// FuzzDecodeCounts: a row's value from the file decodes to what was
// encoded, and any bytes decode without a panic (a damaged file is an
// error, not a crash).
func FuzzDecodeCounts(f *testing.F) {
	f.Add(encodeCounts(nil, Counts{}))
	f.Add(encodeCounts(nil, Counts{Requests: 3, PromptTokens: 4000, CachedTokens: 3000, CompletionTokens: 200, Errors: 1, Estimated: 2,
		Serving: 1500 * time.Millisecond, Cost: 1_250_000, Saved: 75}))
	f.Add([]byte{0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := decodeCounts(b)
		if err != nil {
			return
		}
		if again, err := decodeCounts(encodeCounts(nil, c)); err != nil || again != c {
			t.Fatalf("%x: %+v, then %+v (%v)", b, c, again, err)
		}
	})
}

// FuzzDecodeRow: any key and value decode without a panic, and a key the
// store wrote decodes to its row.
func FuzzDecodeRow(f *testing.F) {
	s := &BoltStore{names: []string{"alice", "llama", Other}}
	f.Add(rowKey(nil, 474779, KindClient, 0, 1), encodeCounts(nil, Counts{Requests: 1}))
	f.Add([]byte{0, 0, 0, 1, 1, 0x80}, []byte{1})
	f.Fuzz(func(t *testing.T, k, v []byte) {
		r, err := s.decodeRow(k, v)
		if err != nil {
			return
		}
		if got := rowKey(nil, r.Period, r.Kind, uint32(indexOf(s.names, r.Name)), uint32(indexOf(s.names, r.Model))); string(got) != string(k) {
			t.Fatalf("key %x decodes to %+v, which encodes to %x", k, r, got)
		}
	})
}

func indexOf(names []string, n string) int {
	for i, x := range names {
		if x == n {
			return i
		}
	}
	return -1
}
