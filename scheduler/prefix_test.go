package scheduler

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
)

func chatBody(t testing.TB, msgs ...string) []byte {
	t.Helper()
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	var ms []msg
	for i := 0; i+1 < len(msgs); i += 2 {
		ms = append(ms, msg{msgs[i], msgs[i+1]})
	}
	b, err := json.Marshal(map[string]any{"model": "m", "messages": ms, "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// canonical renders messages as PromptBlocks documents it.
func canonical(msgs ...string) []byte {
	var b []byte
	for i := 0; i+1 < len(msgs); i += 2 {
		b = append(b, MarkRole)
		b = append(b, msgs[i]...)
		b = append(b, MarkContent)
		b = append(b, msgs[i+1]...)
		b = append(b, MarkEnd)
	}
	return b
}

func TestPromptBlocksMatchesCanonicalText(t *testing.T) {
	long := strings.Repeat("the quick brown fox \"jumps\"\n over é 😀 <&> ", 200)
	for _, cfg := range []PrefixConfig{{}, {BlockTokens: 4, BytesPerToken: 1}, {BlockTokens: 1000, BytesPerToken: 1000}, {MaxBlocks: 3}} {
		body := chatBody(t, "system", long, "user", "hello "+long)
		got := PromptBlocks(nil, body, cfg)
		want := TextBlocks(nil, canonical("system", long, "user", "hello "+long), cfg)
		if len(want) == 0 || !slices.Equal(got, want) {
			t.Fatalf("cfg %+v: PromptBlocks gave %d blocks, canonical text %d (equal %v)", cfg, len(got), len(want), slices.Equal(got, want))
		}
	}
}

func TestPromptBlocksChatPrefixGrows(t *testing.T) {
	sys := strings.Repeat("You are a helpful assistant. ", 30)
	q1 := strings.Repeat("What is a KV cache? ", 10)
	a1 := strings.Repeat("It keeps attention keys and values. ", 10)
	small := PrefixConfig{BlockTokens: 16}
	t1 := PromptBlocks(nil, chatBody(t, "system", sys, "user", q1), small)
	t2 := PromptBlocks(nil, chatBody(t, "system", sys, "user", q1, "assistant", a1, "user", "more?"), small)
	if len(t1) < 10 || len(t2) <= len(t1) || !slices.Equal(t2[:len(t1)], t1) {
		t.Fatalf("turn 2 (%d blocks) does not extend turn 1 (%d blocks)", len(t2), len(t1))
	}
	other := PromptBlocks(nil, chatBody(t, "system", sys, "user", "something else entirely, and long enough to fill blocks"), small)
	common := 0
	for common < min(len(other), len(t1)) && other[common] == t1[common] {
		common++
	}
	if common == 0 || common >= len(t1) {
		t.Fatalf("another conversation with the same system prompt shares %d of %d blocks", common, len(t1))
	}
}

func TestPromptBlocksShapes(t *testing.T) {
	text := strings.Repeat("0123456789", 20)
	small := PrefixConfig{BlockTokens: 16}
	want := TextBlocks(nil, []byte(text), small)
	cases := []struct {
		name string
		body string
		want int // -1: same as want; 0: none; n: at least n blocks
	}{
		{"completion string", `{"prompt":"` + text + `"}`, -1},
		{"completion array of one string", `{"prompt":["` + text + `"]}`, -1},
		{"completion token ids", `{"prompt":[` + strings.Repeat("1234,", 40) + `1]}`, 2},
		{"responses input string", `{"input":"` + text + `"}`, 2},
		{"responses input items", `{"input":[{"role":"user","content":[{"type":"input_text","text":"` + text + `"}]}]}`, 2},
		{"content parts", `{"messages":[{"role":"user","content":[{"type":"text","text":"` + text + `"},{"type":"image_url","image_url":{"url":"data:x"}}]}]}`, 2},
		{"tools", `{"tools":[{"type":"function","function":{"name":"f","description":"` + text + `"}}],"messages":[{"role":"user","content":"hi"}]}`, 2},
		{"escapes", `{"messages":[{"role":"user","content":"` + strings.Repeat(`\u00e9\ud83d\ude00\n\t\"\\`, 30) + `"}]}`, 2},
		{"empty", ``, 0},
		{"not json", `hello`, 0},
		{"no prompt", `{"model":"m"}`, 0},
		{"truncated", `{"messages":[{"role":"user","content":"` + text, 0},
		{"bad escape", `{"messages":[{"role":"user","content":"` + text + `\x"}]}`, 0},
		{"messages not array", `{"messages":"` + text + `"}`, 0},
		{"deep nesting", `{"messages":` + strings.Repeat("[", 1000) + strings.Repeat("]", 1000) + `}`, 0},
		{"trailing garbage", `{"prompt":"` + text + `"} x`, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dst := []uint64{42}
			got := PromptBlocks(dst, []byte(c.body), small)
			if got[0] != 42 {
				t.Fatal("dst's contents changed")
			}
			got = got[1:]
			switch {
			case c.want == -1 && !slices.Equal(got, want):
				t.Fatalf("got %d blocks, want the text's %d", len(got), len(want))
			case c.want == 0 && len(got) != 0:
				t.Fatalf("got %d blocks, want none", len(got))
			case c.want > 0 && len(got) < c.want:
				t.Fatalf("got %d blocks, want at least %d", len(got), c.want)
			}
		})
	}
}

const goldenXChain = "026c8b9bc5af4750 8a8bc4817d4e0290"

func TestPromptBlocksKeyOrderAndDeterminism(t *testing.T) {
	text := strings.Repeat("abcdefgh", 128)
	a := PromptBlocks(nil, []byte(`{"model":"m","messages":[{"role":"user","content":"`+text+`"}],"tools":[{"x":1}]}`), PrefixConfig{})
	b := PromptBlocks(nil, []byte(`{"tools":[{"x":1}],"messages":[{"content":"`+text+`","role":"user"}],"model":"m"}`), PrefixConfig{})
	if len(a) == 0 || !slices.Equal(a, b) {
		t.Fatal("field order changed the chain")
	}
	// A fixed value: the chain must be the same in every process, build
	// and version, or relays and agents would not agree.
	got := TextBlocks(nil, []byte(strings.Repeat("x", 512)), PrefixConfig{})
	if s := fmt.Sprintf("%016x %016x", got[0], got[1]); s != goldenXChain {
		t.Fatalf("chain of 512 x's: %s, want %s", s, goldenXChain)
	}
}

func TestPromptBlocksBounded(t *testing.T) {
	big := bytes.Repeat([]byte("word "), 32<<20/5)
	body := append(append([]byte(`{"messages":[{"role":"user","content":"`), big...), `"}]}`...)
	got := PromptBlocks(nil, body, PrefixConfig{})
	if len(got) != DefaultMaxBlocks {
		t.Fatalf("32 MiB prompt: %d blocks, want the cap %d", len(got), DefaultMaxBlocks)
	}
	if n := len(PromptBlocks(nil, body, PrefixConfig{MaxBlocks: 10})); n != 10 {
		t.Fatalf("MaxBlocks 10: %d blocks", n)
	}
}

func TestPromptBlocksNoAlloc(t *testing.T) {
	body := chatBody(t, "system", strings.Repeat("s", 2000), "user", strings.Repeat("q\\\"", 10000))
	dst := make([]uint64, 0, 4096)
	if n := testing.AllocsPerRun(20, func() { dst = PromptBlocks(dst[:0], body, PrefixConfig{}) }); n != 0 {
		t.Fatalf("%v allocations per call", n)
	}
}

func TestCachedBlocks(t *testing.T) {
	for _, c := range []struct{ chain, prompt, cached, want int }{
		{10, 100, 0, 0}, {10, 100, 100, 10}, {10, 100, 50, 5}, {0, 100, 50, 0}, {10, 0, 5, 0}, {10, 100, 200, 10},
	} {
		if got := CachedBlocks(c.chain, c.prompt, c.cached); got != c.want {
			t.Errorf("CachedBlocks(%d, %d, %d) = %d, want %d", c.chain, c.prompt, c.cached, got, c.want)
		}
	}
}

// FuzzPromptBlocks: any body hashes without panicking, within the cap, the
// same twice, and appends to dst without touching its contents.
func FuzzPromptBlocks(f *testing.F) {
	f.Add([]byte(`{"messages":[{"role":"user","content":"hello world, a prompt long enough for a block or two of text"}]}`))
	f.Add([]byte(`{"prompt":["abc"],"tools":[{"type":"function"}]}`))
	f.Add([]byte(`{"input":[{"role":"user","content":[{"type":"input_text","text":"\u00e9\ud83d"},{"type":"input_image"}]}]}`))
	f.Add([]byte(`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","content":"ok"}]}`))
	f.Add([]byte(`[[[[{"a":1}]]]]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		cfg := PrefixConfig{BlockTokens: 2, BytesPerToken: 2, MaxBlocks: 64}
		dst := []uint64{7}
		a := PromptBlocks(dst, body, cfg)
		b := PromptBlocks(nil, body, cfg)
		if a[0] != 7 || len(a)-1 > 64 || !slices.Equal(a[1:], b) {
			t.Fatalf("unstable or unbounded: %d vs %d blocks", len(a)-1, len(b))
		}
		if json.Valid(body) && len(b) == 0 {
			var v struct {
				Messages []struct {
					Role    string `json:"role"`
					Content string `json:"content"`
				} `json:"messages"`
			}
			if json.Unmarshal(body, &v) == nil && len(v.Messages) > 0 {
				n := 0
				for _, m := range v.Messages {
					n += len(m.Role) + len(m.Content) + 3
				}
				if n >= 4*64 && len(v.Messages) == 1 {
					t.Fatalf("valid chat body of %d canonical bytes gave no blocks", n)
				}
			}
		}
	})
}

// BenchmarkPromptBlocks hashes a 32 KiB chat request body.
func BenchmarkPromptBlocks(b *testing.B) {
	body := chatBody(b, "system", strings.Repeat("You are a careful assistant. ", 80), "user", strings.Repeat("tell me about caches and paging. ", 32<<10/33))
	dst := make([]uint64, 0, DefaultMaxBlocks)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		dst = PromptBlocks(dst[:0], body, PrefixConfig{})
	}
}
