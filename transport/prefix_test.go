package transport

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"reflect"
	"testing"
)

func randHashes(r *rand.Rand, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = r.Uint64()
	}
	return out
}

func TestPrefixFrameRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	cases := []struct {
		name string
		m    PrefixMsg
	}{
		{"hello", PrefixMsg{Type: PrefixHello, BlockTokens: 16, BytesPerToken: 4, MaxBlocks: 8192, CapacityBlocks: 16384}},
		{"hello zero", PrefixMsg{Type: PrefixHello}},
		{"snapshot whole", PrefixMsg{Type: PrefixSnapshot, Seq: 7, First: true, Last: true, Added: randHashes(r, 100)}},
		{"snapshot empty", PrefixMsg{Type: PrefixSnapshot, Seq: 0, First: true, Last: true}},
		{"snapshot middle part", PrefixMsg{Type: PrefixSnapshot, Seq: 1 << 40, Added: randHashes(r, 3)}},
		{"snapshot full frame", PrefixMsg{Type: PrefixSnapshot, Seq: 9, First: true, Added: randHashes(r, PrefixMaxHashes)}},
		{"delta", PrefixMsg{Type: PrefixDelta, Seq: 8, Added: randHashes(r, 20), Evicted: randHashes(r, 5)}},
		{"delta evictions only", PrefixMsg{Type: PrefixDelta, Seq: ^uint64(0), Evicted: []uint64{0, ^uint64(0)}}},
		{"delta full frame", PrefixMsg{Type: PrefixDelta, Seq: 3, Added: randHashes(r, PrefixMaxHashes-1), Evicted: []uint64{5}}},
		{"resync", PrefixMsg{Type: PrefixResync}},
		{"reject", PrefixMsg{Type: PrefixReject, Reason: "seq 9 after 7: out of order"}},
	}
	var stream []byte
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b, err := AppendPrefixFrame(nil, &tc.m)
			if err != nil {
				t.Fatal(err)
			}
			if len(b)-uvarintLen(uint64(len(b))) > PrefixMaxFrame {
				t.Fatalf("frame of %d bytes over the limit", len(b))
			}
			size, n := binary.Uvarint(b)
			if n <= 0 || int(size) != len(b)-n {
				t.Fatalf("length prefix %d (n %d) for %d bytes", size, n, len(b))
			}
			var got PrefixMsg
			if err := DecodePrefixMsg(b[n:], &got); err != nil {
				t.Fatal(err)
			}
			if !msgEqual(got, tc.m) {
				t.Fatalf("decoded %+v\nwant %+v", got, tc.m)
			}
			stream = append(stream, b...)
		})
	}
	// The same frames back to back through a reader, with sizes.
	pr := NewPrefixReader(bytes.NewReader(stream))
	var m PrefixMsg
	total := 0
	for i := range cases {
		n, err := pr.Next(&m)
		if err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		total += n
		if !msgEqual(m, cases[i].m) {
			t.Fatalf("frame %d: %+v", i, m)
		}
	}
	if _, err := pr.Next(&m); err != io.EOF {
		t.Fatalf("after the last frame: %v, want EOF", err)
	}
	if total != len(stream) {
		t.Fatalf("sizes add up to %d, stream is %d bytes", total, len(stream))
	}
}

// msgEqual compares messages treating nil and empty slices alike.
func msgEqual(a, b PrefixMsg) bool {
	norm := func(s []uint64) []uint64 {
		if len(s) == 0 {
			return nil
		}
		return s
	}
	a.Added, a.Evicted, b.Added, b.Evicted = norm(a.Added), norm(a.Evicted), norm(b.Added), norm(b.Evicted)
	return reflect.DeepEqual(a, b)
}

func TestPrefixFrameEncodeRejects(t *testing.T) {
	cases := []struct {
		name string
		m    PrefixMsg
	}{
		{"no type", PrefixMsg{}},
		{"unknown type", PrefixMsg{Type: 99}},
		{"too many hashes", PrefixMsg{Type: PrefixDelta, Added: make([]uint64, PrefixMaxHashes), Evicted: []uint64{1}}},
		{"snapshot with evictions", PrefixMsg{Type: PrefixSnapshot, Evicted: []uint64{1}}},
		{"negative hello", PrefixMsg{Type: PrefixHello, BlockTokens: -1}},
		{"huge hello", PrefixMsg{Type: PrefixHello, MaxBlocks: PrefixMaxConfig + 1}},
		{"long reason", PrefixMsg{Type: PrefixReject, Reason: string(make([]byte, 513))}},
		{"reason not UTF-8", PrefixMsg{Type: PrefixReject, Reason: "\xff"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dst := []byte("keep")
			b, err := AppendPrefixFrame(dst, &tc.m)
			if err == nil {
				t.Fatal("encoded")
			}
			if string(b) != "keep" {
				t.Fatalf("dst changed to %q", b)
			}
		})
	}
}

func TestPrefixDecodeMalformed(t *testing.T) {
	valid, _ := AppendPrefixFrame(nil, &PrefixMsg{Type: PrefixDelta, Seq: 1, Added: []uint64{1, 2}, Evicted: []uint64{3}})
	body := valid[1:] // a one-byte length prefix
	cases := []struct {
		name string
		body []byte
	}{
		{"empty", nil},
		{"one byte", []byte{prefixVersion}},
		{"other version", append([]byte{2}, body[1:]...)},
		{"unknown type", []byte{prefixVersion, 42}},
		{"truncated hashes", body[:len(body)-1]},
		{"trailing byte", append(bytes.Clone(body), 0)},
		{"count over the limit", binary.AppendUvarint([]byte{prefixVersion, byte(PrefixSnapshot), 1, 3}, PrefixMaxHashes+1)},
		{"counts sum over the limit", binary.AppendUvarint(binary.AppendUvarint([]byte{prefixVersion, byte(PrefixDelta), 1}, PrefixMaxHashes), 1)},
		{"bad snapshot flags", []byte{prefixVersion, byte(PrefixSnapshot), 1, 4, 0}},
		{"bad varint", []byte{prefixVersion, byte(PrefixDelta), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}},
		{"hello value over the limit", binary.AppendUvarint([]byte{prefixVersion, byte(PrefixHello)}, PrefixMaxConfig+1)},
		{"resync with a body", []byte{prefixVersion, byte(PrefixResync), 0}},
		{"reject not UTF-8", []byte{prefixVersion, byte(PrefixReject), 0xff}},
		{"oversized", make([]byte, PrefixMaxFrame+1)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := PrefixMsg{Added: make([]uint64, 0, 8)}
			err := DecodePrefixMsg(tc.body, &m)
			if !errors.Is(err, ErrPrefixMalformed) {
				t.Fatalf("err = %v, want ErrPrefixMalformed", err)
			}
			if m.Type != 0 || len(m.Added) != 0 || len(m.Evicted) != 0 {
				t.Fatalf("a failed decode left %+v", m)
			}
		})
	}
}

func TestPrefixReaderLimits(t *testing.T) {
	t.Run("announced length over the limit", func(t *testing.T) {
		// The reader must refuse before reading (or allocating) the body.
		b := binary.AppendUvarint(nil, PrefixMaxFrame+1)
		_, err := NewPrefixReader(bytes.NewReader(b)).Next(&PrefixMsg{})
		if !errors.Is(err, ErrPrefixTooLarge) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("cut short", func(t *testing.T) {
		b, _ := AppendPrefixFrame(nil, &PrefixMsg{Type: PrefixDelta, Seq: 1, Added: []uint64{1}})
		_, err := NewPrefixReader(bytes.NewReader(b[:len(b)-2])).Next(&PrefixMsg{})
		if !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("varint cut short", func(t *testing.T) {
		_, err := NewPrefixReader(bytes.NewReader([]byte{0x80})).Next(&PrefixMsg{})
		if !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("overlong varint", func(t *testing.T) {
		b := bytes.Repeat([]byte{0xff}, 11)
		_, err := NewPrefixReader(bytes.NewReader(b)).Next(&PrefixMsg{})
		if !errors.Is(err, ErrPrefixMalformed) {
			t.Fatalf("err = %v", err)
		}
	})
}

// TestPrefixDeltaSize pins the encoding's overhead: a delta costs 8 bytes
// per hash plus its header (length prefix, version, type, a 3-byte seq and
// the two counts).
func TestPrefixDeltaSize(t *testing.T) {
	for _, tc := range []struct{ added, evicted, maxOverhead int }{
		{0, 0, 8}, {1, 0, 8}, {64, 16, 9}, {1000, 1000, 11},
	} {
		m := PrefixMsg{Type: PrefixDelta, Seq: 1 << 20, Added: make([]uint64, tc.added), Evicted: make([]uint64, tc.evicted)}
		b, err := AppendPrefixFrame(nil, &m)
		if err != nil {
			t.Fatal(err)
		}
		if over := len(b) - 8*(tc.added+tc.evicted); over > tc.maxOverhead {
			t.Errorf("%d+%d hashes: %d bytes, %d over the hashes (want <= %d)", tc.added, tc.evicted, len(b), over, tc.maxOverhead)
		}
	}
}

func FuzzDecodePrefixMsg(f *testing.F) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, m := range []PrefixMsg{
		{Type: PrefixHello, BlockTokens: 16, BytesPerToken: 4, MaxBlocks: 8192, CapacityBlocks: 16384},
		{Type: PrefixSnapshot, Seq: 1, First: true, Last: true, Added: randHashes(r, 4)},
		{Type: PrefixDelta, Seq: 2, Added: randHashes(r, 3), Evicted: randHashes(r, 2)},
		{Type: PrefixResync},
		{Type: PrefixReject, Reason: "out of order"},
	} {
		b, err := AppendPrefixFrame(nil, &m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		// As a stream of frames, and as one frame's body.
		pr := NewPrefixReader(bytes.NewReader(data))
		var m PrefixMsg
		for range 64 {
			if _, err := pr.Next(&m); err != nil {
				break
			}
			checkReencode(t, &m)
		}
		if err := DecodePrefixMsg(data, &m); err == nil {
			checkReencode(t, &m)
		}
	})
}

// checkReencode asserts that a decoded message encodes back to a frame
// that decodes to the same message.
func checkReencode(t *testing.T, m *PrefixMsg) {
	t.Helper()
	if len(m.Added)+len(m.Evicted) > PrefixMaxHashes {
		t.Fatalf("decoded %d hashes", len(m.Added)+len(m.Evicted))
	}
	b, err := AppendPrefixFrame(nil, m)
	if err != nil {
		t.Fatalf("decoded message does not encode: %v (%+v)", err, m)
	}
	_, n := binary.Uvarint(b)
	var again PrefixMsg
	if err := DecodePrefixMsg(b[n:], &again); err != nil {
		t.Fatalf("re-encoded message does not decode: %v", err)
	}
	if !msgEqual(again, *m) {
		t.Fatalf("round trip changed %+v to %+v", *m, again)
	}
}
