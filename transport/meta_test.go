package transport

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

func sampleMetas() map[string]NodeMeta {
	return map[string]NodeMeta{
		"zero":  {},
		"relay": {Role: NodeRoleRelay, Seq: 7},
		"agent": {
			Role: NodeRoleAgent, Name: "gpu-box-1", Models: []string{"llama-3.1-8b", "qwen2.5-7b"},
			Capacity: 8, InFlight: 3, Running: 2, Waiting: 5, KVCacheUsage: 0.4217, Seq: 1 << 40, Panics: 3,
		},
		"flags":        {Role: NodeRoleAgent, Name: "x", Draining: true, Unavailable: true, Capacity: metaMaxInt},
		"load unknown": {Role: NodeRoleAgent, Name: "y", InFlight: 2, LoadUnknown: true},
	}
}

func TestMetaRoundTrip(t *testing.T) {
	for name, m := range sampleMetas() {
		t.Run(name, func(t *testing.T) {
			b, err := EncodeMeta(m, 0)
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeMeta(b)
			if err != nil {
				t.Fatal(err)
			}
			want := m
			want.ModelCount = len(m.Models)
			want.ModelsDigest = ModelsDigest(m.Models)
			if want.Models == nil {
				want.Models = []string{}
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, want)
			}
		})
	}
}

func TestMetaModelsSortedAndDeduplicated(t *testing.T) {
	b, err := EncodeMeta(NodeMeta{Models: []string{"b", "a", "b"}}, 0)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.Models, []string{"a", "b"}) || got.ModelCount != 2 {
		t.Fatalf("models %v count %d", got.Models, got.ModelCount)
	}
	if ModelsDigest([]string{"b", "a"}) != ModelsDigest([]string{"a", "b", "a"}) {
		t.Fatal("digest depends on order or duplicates")
	}
}

func TestMetaLimitWithManyModels(t *testing.T) {
	var models []string
	for i := range 200 {
		models = append(models, fmt.Sprintf("organisation-%03d/a-rather-long-model-name-Instruct-GGUF-Q4_K_M", i))
	}
	m := NodeMeta{Role: NodeRoleAgent, Name: strings.Repeat("n", 255), Models: models, Capacity: 4, Seq: 99}
	b, err := EncodeMeta(m, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > MetaMaxSize {
		t.Fatalf("encoded %d bytes, limit %d", len(b), MetaMaxSize)
	}
	got, err := DecodeMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	if !got.ModelsTruncated || got.Models != nil || got.ModelCount != 200 || got.ModelsDigest != ModelsDigest(models) {
		t.Fatalf("truncated=%v models=%d count=%d", got.ModelsTruncated, len(got.Models), got.ModelCount)
	}
	if got.Name != m.Name || got.Capacity != 4 || got.Seq != 99 {
		t.Fatalf("fields lost: %+v", got)
	}
	// A smaller limit is honoured as well, and a few short models still fit in full.
	small := NodeMeta{Role: NodeRoleAgent, Name: "a", Models: []string{"m1", "m2"}}
	b, err = EncodeMeta(small, 40)
	if err != nil || len(b) > 40 {
		t.Fatalf("len %d err %v", len(b), err)
	}
	if got, _ := DecodeMeta(b); got.ModelsTruncated {
		t.Fatal("short list was truncated")
	}
}

func TestMetaEncodeErrors(t *testing.T) {
	cases := map[string]NodeMeta{
		"long name":        {Name: strings.Repeat("n", 256)},
		"negative counter": {InFlight: -1},
		"bad role":         {Role: 9},
	}
	for name, m := range cases {
		if _, err := EncodeMeta(m, 0); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := EncodeMeta(NodeMeta{Name: strings.Repeat("n", 200)}, 20); !errors.Is(err, ErrMetaTooLarge) {
		t.Errorf("tiny limit: %v", err)
	}
}

func TestMetaDecodeErrors(t *testing.T) {
	good, _ := EncodeMeta(sampleMetas()["agent"], 0)
	cases := map[string][]byte{
		"empty":     nil,
		"version":   append([]byte{2}, good[1:]...),
		"truncated": good[:len(good)-3],
		"too large": make([]byte, MetaMaxSize+1),
		"unsorted":  appendMeta(nil, NodeMeta{}, []string{"b", "a"}, false),
	}
	for name, b := range cases {
		if _, err := DecodeMeta(b); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	// Later versions append fields: trailing bytes are ignored.
	if _, err := DecodeMeta(append(good, 1, 2, 3)); err != nil {
		t.Errorf("trailing bytes: %v", err)
	}
	// A member from before Panics was appended sends none: 0.
	m := sampleMetas()["agent"]
	m.Panics = 0
	older, _ := EncodeMeta(m, 0)
	if got, err := DecodeMeta(older[:len(older)-1]); err != nil || got.Panics != 0 || got.Waiting != 5 || len(got.Models) != 2 {
		t.Errorf("an encoding without panics: %+v, %v", got, err)
	}
}

func TestMetaSignificant(t *testing.T) {
	base := NodeMeta{Role: NodeRoleAgent, Name: "a", Models: []string{"m"}, Capacity: 8, InFlight: 10, Running: 1, KVCacheUsage: 0.5}
	cases := []struct {
		name string
		edit func(*NodeMeta)
		want bool
	}{
		{"same", func(*NodeMeta) {}, false},
		{"inflight +1 of 10", func(m *NodeMeta) { m.InFlight = 11 }, false},
		{"inflight +2", func(m *NodeMeta) { m.InFlight = 12 }, true},
		{"running 1 to 0", func(m *NodeMeta) { m.Running = 0 }, true},
		{"kv +0.01", func(m *NodeMeta) { m.KVCacheUsage = 0.51 }, false},
		{"kv +0.05", func(m *NodeMeta) { m.KVCacheUsage = 0.56 }, true},
		{"draining", func(m *NodeMeta) { m.Draining = true }, true},
		{"load unknown", func(m *NodeMeta) { m.LoadUnknown = true }, true},
		{"models", func(m *NodeMeta) { m.Models = []string{"m", "n"} }, true},
		{"models reordered", func(m *NodeMeta) { m.Models = []string{"m", "m"} }, false},
		{"capacity", func(m *NodeMeta) { m.Capacity = 9 }, true},
		{"a panic", func(m *NodeMeta) { m.Panics = 1 }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			next := base
			c.edit(&next)
			if got := metaSignificant(base, next); got != c.want {
				t.Fatalf("metaSignificant = %v, want %v", got, c.want)
			}
		})
	}
}

func FuzzDecodeMeta(f *testing.F) {
	for _, m := range sampleMetas() {
		b, err := EncodeMeta(m, 0)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	long := NodeMeta{Role: NodeRoleAgent, Name: "big"}
	for i := range 100 {
		long.Models = append(long.Models, fmt.Sprintf("model-%d-with-a-long-suffix", i))
	}
	if b, err := EncodeMeta(long, 0); err == nil {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeMeta(b)
		if err != nil {
			return
		}
		// Whatever decodes must re-encode within the limit and decode to the same value.
		if m.ModelsTruncated {
			return // the list itself is not on the wire
		}
		if len(appendMeta(nil, m, m.Models, false)) > MetaMaxSize {
			return // an encoding from before Panics, at the limit: its count no longer fits beside the list
		}
		// +1: an encoding from before Panics lacks its byte.
		again, err := EncodeMeta(m, len(b)+1)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		m2, err := DecodeMeta(again)
		if err != nil {
			t.Fatalf("decode re-encoding: %v", err)
		}
		if !reflect.DeepEqual(m, m2) {
			t.Fatalf("unstable:\n%+v\n%+v", m, m2)
		}
	})
}
