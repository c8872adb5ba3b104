package simengine

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func seqTokens(base, n int) []Token {
	out := make([]Token, n)
	for i := range out {
		out[i] = Token(base + i)
	}
	return out
}

func newTestEngine(t *testing.T, cfg EngineConfig) *Engine {
	t.Helper()
	e, err := NewEngine(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// run drives e until it is idle and returns its events.
func run(t *testing.T, e *Engine) []Event {
	t.Helper()
	var evs []Event
	for range 100000 {
		at, ok := e.Next()
		if !ok {
			return e.Advance(e.Now(), evs)
		}
		evs = e.Advance(at, evs)
	}
	t.Fatal("engine did not become idle")
	return nil
}

func find(evs []Event, id uint64, k EventKind) Event {
	for _, ev := range evs {
		if ev.ID == id && ev.Kind == k {
			return ev
		}
	}
	return Event{}
}

func TestTokenizeDeterministic(t *testing.T) {
	text := "<|im_start|>user\nHello, world! Tokenization   is fun.<|im_end|>\n"
	a, b := Tokenize(nil, text), Tokenize(nil, text)
	if !slices.Equal(a, b) {
		t.Fatal("same text, different tokens")
	}
	// <|im_start|> | user\n | Hello | , | world | ! | Token | izati | on | is | fun | . | <|im_end|>\n
	if len(a) != 13 || CountTokens(text) != 13 {
		t.Fatalf("got %d tokens (count %d), want 13", len(a), CountTokens(text))
	}
	if a[0] != tokenID("<|im_start|>") || a[1] != tokenID("user\n") || a[7] != tokenID("izati") {
		t.Fatalf("unexpected ids %v", a)
	}
	if got := Tokenize(nil, "  lead"); len(got) != 2 || got[0] != tokenID("  ") {
		t.Fatalf("leading whitespace: %v", got)
	}
	if got := Tokenize(nil, "<|not special"); len(got) != 5 {
		t.Fatalf("unterminated special: %d tokens", len(got))
	}
	for _, n := range []int{0, 1, 16, 517} {
		f := Filler(uint64(n), n)
		if CountTokens(f) != n || CountTokens(f+Filler(9, 3)) != n+3 {
			t.Fatalf("Filler(%d) has %d tokens", n, CountTokens(f))
		}
	}
}

func TestAnswerRetokenizes(t *testing.T) {
	e := newTestEngine(t, EngineConfig{Seed: 7})
	r := &Request{Tokens: Tokenize(nil, "why is the sky blue?"), MaxTokens: 40}
	text := strings.Join(e.AnswerText(r), "")
	if got := Tokenize(nil, text); !slices.Equal(got, e.Answer(r)) {
		t.Fatalf("answer %q does not tokenize back to its tokens", text)
	}
	r2 := &Request{Tokens: Tokenize(nil, "why is the sky green?"), MaxTokens: 40}
	if slices.Equal(e.Answer(r), e.Answer(r2)) {
		t.Fatal("different prompts, same answer")
	}
}

func TestBlockChaining(t *testing.T) {
	e := newTestEngine(t, EngineConfig{})
	suffix := seqTokens(1000, 32)
	a := append(seqTokens(0, 16), suffix...)
	b := append(seqTokens(500, 16), suffix...)
	ha, hb := BlockHashes(nil, a, 16), BlockHashes(nil, b, 16)
	if ha[1] == hb[1] || ha[2] == hb[2] {
		t.Fatal("equal blocks after different prefixes hash alike")
	}
	if ext := BlockHashes(ha[:1:1], a, 16); !slices.Equal(ext, ha) {
		t.Fatal("extending a chain differs from hashing it whole")
	}
	if err := e.Submit(t0, &Request{ID: 1, Tokens: a, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	run(t, e)
	if err := e.Submit(e.Now(), &Request{ID: 2, Tokens: append(b, 1), MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	if ev := find(run(t, e), 2, EventDone); ev.Usage.CachedTokens != 0 {
		t.Fatalf("suffix after another prefix hit %d tokens", ev.Usage.CachedTokens)
	}
	if got := e.Lookup(ha); got != 48 {
		t.Fatalf("lookup of the first prompt: %d tokens, want 48", got)
	}
}

func TestOnlyFullBlocksCached(t *testing.T) {
	e := newTestEngine(t, EngineConfig{})
	p := seqTokens(0, 40) // 2 full blocks + 8
	if err := e.Submit(t0, &Request{ID: 1, Tokens: p, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	run(t, e)
	if st := e.Stats(); st.CachedBlocks != 2 {
		t.Fatalf("cached %d blocks for 40 prompt + 1 answer tokens, want 2", st.CachedBlocks)
	}
	cases := []struct {
		name   string
		n      int
		cached int
	}{
		{"same prompt again, last token recomputed", 40, 32},
		{"exact block multiple keeps last block uncached", 32, 16},
		{"longer prompt", 60, 32},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := uint64(10 + i)
			if err := e.Submit(e.Now(), &Request{ID: id, Tokens: seqTokens(0, c.n), MaxTokens: 1}); err != nil {
				t.Fatal(err)
			}
			if ev := find(run(t, e), id, EventFirstToken); ev.Usage.CachedTokens != c.cached {
				t.Fatalf("cached %d, want %d", ev.Usage.CachedTokens, c.cached)
			}
		})
	}
}

func TestLRUEvictionOrder(t *testing.T) {
	c := newBlockCache(4)
	c.touch([]BlockHash{1, 2})
	c.touch([]BlockHash{3, 4})
	if got := c.order(); !slices.Equal(got, []BlockHash{3, 4, 1, 2}) {
		t.Fatalf("order %v: a chain's head must be most recent", got)
	}
	c.touch([]BlockHash{1})    // 1 3 4 2
	c.touch([]BlockHash{5, 6}) // evicts 2 then 4
	if got := c.order(); !slices.Equal(got, []BlockHash{5, 6, 1, 3}) {
		t.Fatalf("order %v, want [5 6 1 3]", got)
	}
	if c.lookup([]BlockHash{1, 2}) != 1 || c.lookup([]BlockHash{5, 6}) != 2 {
		t.Fatal("lookup after eviction")
	}
	c.touch([]BlockHash{7, 8, 9, 10, 11, 12}) // longer than the cache: keeps the head
	if got := c.order(); !slices.Equal(got, []BlockHash{7, 8, 9, 10}) {
		t.Fatalf("order %v, want [7 8 9 10]", got)
	}
}

func TestEngineEvictsAcrossConversations(t *testing.T) {
	e := newTestEngine(t, EngineConfig{CacheBlocks: 8})
	for i := range 3 { // three 4-block prompts through an 8-block cache
		if err := e.Submit(e.Now(), &Request{ID: uint64(i), Tokens: seqTokens(i*1000, 64), MaxTokens: 1}); err != nil {
			t.Fatal(err)
		}
		run(t, e)
	}
	for i, want := range []int{0, 64, 64} {
		if got := e.Lookup(BlockHashes(nil, seqTokens(i*1000, 64), 16)); got != want {
			t.Errorf("conversation %d: %d tokens cached, want %d", i, got, want)
		}
	}
}

func TestFollowUpTurnHitsPromptAndAnswer(t *testing.T) {
	e := newTestEngine(t, EngineConfig{})
	p1 := Tokenize(nil, Filler(1, 100))
	r1 := &Request{ID: 1, Tokens: p1, MaxTokens: 37}
	if err := e.Submit(t0, r1); err != nil {
		t.Fatal(err)
	}
	done := find(run(t, e), 1, EventDone)
	p2 := append(append(slices.Clone(p1), done.Output...), Tokenize(nil, "and then?")...)
	if err := e.Submit(e.Now(), &Request{ID: 2, Tokens: p2, MaxTokens: 5}); err != nil {
		t.Fatal(err)
	}
	ev := find(run(t, e), 2, EventFirstToken)
	if want := (100 + 37) / 16 * 16; ev.Usage.CachedTokens != want {
		t.Fatalf("follow-up cached %d tokens, want %d", ev.Usage.CachedTokens, want)
	}
	if st := e.Stats(); st.PrefixQueries != uint64(len(p1)+len(p2)) || st.PrefixHits != 128 {
		t.Fatalf("prefix stats %d/%d", st.PrefixHits, st.PrefixQueries)
	}
}

func near(a, b time.Duration) bool { return math.Abs(float64(a-b)) <= float64(time.Microsecond) }

func TestPrefillProportionalToUncached(t *testing.T) {
	cfg := EngineConfig{PrefillTokensPerSec: 1000, DecodeTimePerToken: time.Millisecond}
	for _, n := range []int{100, 1000, 4000} {
		e := newTestEngine(t, cfg)
		if err := e.Submit(t0, &Request{ID: 1, Tokens: seqTokens(0, n), MaxTokens: 1}); err != nil {
			t.Fatal(err)
		}
		ttft := find(run(t, e), 1, EventFirstToken).At.Sub(t0)
		if want := time.Duration(n) * time.Millisecond; !near(ttft, want) {
			t.Errorf("%d cold tokens: first token after %v, want %v", n, ttft, want)
		}
		// same prompt plus 8 tokens: only the last partial block and the new tokens are computed
		p := seqTokens(0, n+8)
		start := e.Now()
		if err := e.Submit(start, &Request{ID: 2, Tokens: p, MaxTokens: 1}); err != nil {
			t.Fatal(err)
		}
		ttft = find(run(t, e), 2, EventFirstToken).At.Sub(start)
		if want := time.Duration(n+8-n/16*16) * time.Millisecond; !near(ttft, want) {
			t.Errorf("%d cached tokens: first token after %v, want %v", n, ttft, want)
		}
	}
}

func TestDefaultsMeetTarget(t *testing.T) {
	e := newTestEngine(t, EngineConfig{})
	p := seqTokens(0, 128*1024)
	if err := e.Submit(t0, &Request{ID: 1, Tokens: p, MaxTokens: 50}); err != nil {
		t.Fatal(err)
	}
	evs := run(t, e)
	cold := find(evs, 1, EventFirstToken).At.Sub(t0)
	if cold < 3*time.Second || cold > 8*time.Second {
		t.Fatalf("cold 128K prefill %v, want 3-8 s", cold)
	}
	start := e.Now()
	if err := e.Submit(start, &Request{ID: 2, Tokens: append(slices.Clone(p), 1, 2, 3), MaxTokens: 50}); err != nil {
		t.Fatal(err)
	}
	warm := find(run(t, e), 2, EventFirstToken).At.Sub(start)
	if warm > 10*time.Millisecond {
		t.Fatalf("cached 128K prefill %v, want almost none", warm)
	}
}

func TestBatchingSlowsDecode(t *testing.T) {
	cfg := EngineConfig{PrefillTokensPerSec: 1e6, DecodeTimePerToken: 10 * time.Millisecond, DecodeTimePerSeq: 2 * time.Millisecond}
	decode := func(n int) time.Duration {
		e := newTestEngine(t, cfg)
		for i := range n {
			if err := e.Submit(t0, &Request{ID: uint64(i), Tokens: seqTokens(i*100, 10), MaxTokens: 101}); err != nil {
				t.Fatal(err)
			}
		}
		evs := run(t, e)
		return find(evs, 0, EventDone).At.Sub(find(evs, 0, EventFirstToken).At)
	}
	one, four := decode(1), decode(4)
	if !near(one, time.Second) {
		t.Errorf("alone: 100 decode steps took %v, want 1s", one)
	}
	// prefills end 10 us apart; after that four sequences step every 16 ms
	if four < 1550*time.Millisecond || four > 1600*time.Millisecond {
		t.Errorf("four together: %v, want about 1.6s", four)
	}
}

func TestQueueBeyondMaxRunning(t *testing.T) {
	e := newTestEngine(t, EngineConfig{MaxRunning: 2, MaxQueue: 1, PrefillTokensPerSec: 1000, DecodeTimePerSeq: -1})
	for i := range 3 {
		if err := e.Submit(t0, &Request{ID: uint64(i), Tokens: seqTokens(i*100, 10), MaxTokens: 11}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Submit(t0, &Request{ID: 9, Tokens: seqTokens(0, 10), MaxTokens: 1}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("fourth request: %v, want ErrQueueFull", err)
	}
	if st := e.Stats(); st.Running != 2 || st.Waiting != 1 || st.Rejected != 1 {
		t.Fatalf("stats %+v", st)
	}
	evs := run(t, e)
	done0 := find(evs, 0, EventDone).At
	first2 := find(evs, 2, EventFirstToken).At
	// request 2 starts when request 0 leaves, then needs its own 10 ms prefill
	if want := done0.Add(10 * time.Millisecond); !near(first2.Sub(t0), want.Sub(t0)) {
		t.Fatalf("queued request's first token at %v, want %v", first2.Sub(t0), want.Sub(t0))
	}
	if st := e.Stats(); st.Running != 0 || st.Waiting != 0 || st.Finished != 3 {
		t.Fatalf("stats after run %+v", st)
	}
}

func TestCancelFreesSlot(t *testing.T) {
	e := newTestEngine(t, EngineConfig{MaxRunning: 1})
	for i := range 2 {
		if err := e.Submit(t0, &Request{ID: uint64(i), Tokens: seqTokens(0, 40), MaxTokens: 1000}); err != nil {
			t.Fatal(err)
		}
	}
	evs := e.Advance(t0.Add(time.Second), nil)
	if g, ok := e.Generated(0); !ok || g < 2 {
		t.Fatalf("generated %d %v", g, ok)
	}
	if len(evs) != 1 || evs[0].Kind != EventFirstToken {
		t.Fatalf("events %v", evs)
	}
	if !e.Cancel(t0.Add(time.Second), 0) || e.Cancel(t0.Add(time.Second), 0) {
		t.Fatal("cancel should succeed once")
	}
	if st := e.Stats(); st.Running != 1 || st.Waiting != 0 || st.Cancelled != 1 {
		t.Fatalf("stats %+v", st)
	}
	// the cancelled request's prompt and partial answer were cached: the next one hits 32
	if ev := find(e.Advance(t0.Add(2*time.Second), nil), 1, EventFirstToken); ev.Usage.CachedTokens != 32 {
		t.Fatalf("queued request: %+v", ev)
	}
}

func TestSlowdown(t *testing.T) {
	e := newTestEngine(t, EngineConfig{PrefillTokensPerSec: 1000})
	if err := e.SetSlowdown(t0, 5); err != nil {
		t.Fatal(err)
	}
	if err := e.Submit(t0, &Request{ID: 1, Tokens: seqTokens(0, 100), MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	if got := find(run(t, e), 1, EventFirstToken).At.Sub(t0); !near(got, 500*time.Millisecond) {
		t.Fatalf("5x slower prefill of 100 tokens at 1000/s took %v", got)
	}
	if e.SetSlowdown(t0, 0) == nil || e.SetSlowdown(t0, math.Inf(1)) == nil {
		t.Fatal("bad factors accepted")
	}
}

func TestSubmitValidation(t *testing.T) {
	e := newTestEngine(t, EngineConfig{MaxModelLen: 100})
	cases := []struct {
		name string
		r    Request
		want error
	}{
		{"empty", Request{MaxTokens: 1}, ErrBadRequest},
		{"no tokens to generate", Request{Tokens: seqTokens(0, 3)}, ErrBadRequest},
		{"too long", Request{Tokens: seqTokens(0, 90), MaxTokens: 11}, ErrContextLength},
		{"wrong hashes", Request{Tokens: seqTokens(0, 40), Hashes: []BlockHash{1}, MaxTokens: 1}, ErrBadRequest},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := e.Submit(t0, &c.r); !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
		})
	}
	if err := e.Submit(t0, &Request{ID: 5, Tokens: seqTokens(0, 3), MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	if err := e.Submit(t0, &Request{ID: 5, Tokens: seqTokens(0, 3), MaxTokens: 1}); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("duplicate id: %v", err)
	}
}

func BenchmarkCacheLookupInsert2000(b *testing.B) {
	c := newBlockCache(DefaultCacheBlocks)
	prompts := make([][]Token, 64)
	for i := range prompts {
		prompts[i] = Tokenize(nil, Filler(uint64(i%8), 1000)+Filler(uint64(i), 1000))
	}
	var hs []BlockHash
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		hs = BlockHashes(hs[:0], prompts[i%len(prompts)], DefaultBlockSize)
		hit := c.lookup(hs)
		c.touch(hs[:hit])
		c.touch(hs)
	}
}

func BenchmarkEngineRequest2000(b *testing.B) {
	e, _ := NewEngine(EngineConfig{})
	prompts := make([][]Token, 64)
	for i := range prompts {
		prompts[i] = Tokenize(nil, Filler(uint64(i%8), 1000)+Filler(uint64(i), 1000))
	}
	now := t0
	var evs []Event
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if err := e.Submit(now, &Request{ID: uint64(i), Tokens: prompts[i%len(prompts)], MaxTokens: 100}); err != nil {
			b.Fatal(err)
		}
		for {
			at, ok := e.Next()
			if !ok {
				break
			}
			now = at
			evs = e.Advance(now, evs[:0])
		}
	}
}

func BenchmarkTokenize2000(b *testing.B) {
	text := Filler(1, 2000)
	var toks []Token
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		toks = Tokenize(toks[:0], text)
	}
}

func TestCancelDuringDecodeCachesPartialAnswer(t *testing.T) {
	e := newTestEngine(t, EngineConfig{})
	r := &Request{ID: 1, Tokens: seqTokens(0, 16), MaxTokens: 100}
	if err := e.Submit(t0, r); err != nil {
		t.Fatal(err)
	}
	now := t0
	for g := 0; g != 16; g, _ = e.Generated(1) {
		if g > 16 {
			t.Fatal("stepped past 16 generated tokens")
		}
		now = now.Add(time.Millisecond)
		e.Advance(now, nil)
	}
	e.Cancel(now, 1)
	full := append(seqTokens(0, 16), e.Answer(r)[:16]...)
	if got := e.Lookup(BlockHashes(nil, full, 16)); got != 32 {
		t.Fatalf("after cancel, prompt plus 16 answer tokens: %d cached, want 32", got)
	}
}
