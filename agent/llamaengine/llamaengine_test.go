package llamaengine_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/agent/llamaengine"
	"github.com/computeflux/computeflux/agent/llamaengine/llamatest"
	"github.com/computeflux/computeflux/scheduler/audit"
)

func TestWriteModelHeader(t *testing.T) {
	var a, b, c bytes.Buffer
	if err := llamaengine.WriteModel(&a, llamaengine.ModelConfig{Seed: 1}); err != nil {
		t.Fatal(err)
	}
	if err := llamaengine.WriteModel(&b, llamaengine.ModelConfig{Seed: 1}); err != nil {
		t.Fatal(err)
	}
	if err := llamaengine.WriteModel(&c, llamaengine.ModelConfig{Seed: 2}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("one seed wrote two different files")
	}
	if bytes.Equal(a.Bytes(), c.Bytes()) {
		t.Error("two seeds wrote the same file")
	}
	h, err := llamaengine.ReadHeader(bytes.NewReader(a.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	if h.Version != 3 || h.Metadata["general.architecture"] != "llama" || h.Metadata["tokenizer.ggml.model"] != "llama" {
		t.Errorf("header %d %v %v", h.Version, h.Metadata["general.architecture"], h.Metadata["tokenizer.ggml.model"])
	}
	toks, _ := h.Metadata["tokenizer.ggml.tokens"].([]any)
	types, _ := h.Metadata["tokenizer.ggml.token_type"].([]any)
	// 3 special, 256 bytes, the space and 94 printable characters.
	if len(toks) != 354 || len(types) != 354 || toks[3+0x41] != "<0x41>" || toks[259] != "\u2581" || toks[353] != "~" {
		t.Errorf("vocabulary of %d tokens: %v ... %v", len(toks), toks[:4], toks[len(toks)-2:])
	}
	if h.Metadata["llama.vocab_size"] != uint32(354) || h.Metadata["llama.embedding_length"] != uint32(llamaengine.DefaultEmbed) {
		t.Errorf("shape keys %v %v", h.Metadata["llama.vocab_size"], h.Metadata["llama.embedding_length"])
	}
	// token_embd, output_norm, output, and 9 tensors per layer.
	if want := 3 + 9*llamaengine.DefaultLayers; len(h.Tensors) != want {
		t.Fatalf("%d tensors, want %d", len(h.Tensors), want)
	}
	// Offsets aligned, in order, each after the previous tensor's data;
	// the data section ends the file.
	var next uint64
	for _, ti := range h.Tensors {
		n := uint64(4)
		for _, d := range ti.Dims {
			n *= d
		}
		if ti.Offset%32 != 0 || ti.Offset != next || ti.Type != 0 {
			t.Errorf("%s at %d (type %d), want %d", ti.Name, ti.Offset, ti.Type, next)
		}
		next = (ti.Offset + n + 31) / 32 * 32
	}
	if data := uint64(a.Len()) - next; data%32 != 0 || data > 1<<16 {
		t.Errorf("file of %d bytes, tensor data of %d: header of %d", a.Len(), next, data)
	}
}

func TestWriteModelBadShape(t *testing.T) {
	for _, cfg := range []llamaengine.ModelConfig{{Embed: 60, Heads: 7}, {Embed: 4}} {
		if err := llamaengine.WriteModel(io.Discard, cfg); err == nil {
			t.Errorf("%+v: no error", cfg)
		}
	}
}

func TestReadHeaderRejects(t *testing.T) {
	var good bytes.Buffer
	if err := llamaengine.WriteModel(&good, llamaengine.ModelConfig{}); err != nil {
		t.Fatal(err)
	}
	huge := append([]byte("GGUF\x03\x00\x00\x00"), bytes.Repeat([]byte{0xff}, 16)...)
	for name, b := range map[string][]byte{
		"empty":     nil,
		"not gguf":  []byte("PK\x03\x04 zip file"),
		"version 9": []byte("GGUF\x09\x00\x00\x00"),
		"truncated": good.Bytes()[:200],
		"huge":      huge,
	} {
		if _, err := llamaengine.ReadHeader(bytes.NewReader(b)); err == nil {
			t.Errorf("%s: no error", name)
		} else if name == "not gguf" && !errors.Is(err, llamaengine.ErrNotGGUF) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func FuzzReadHeader(f *testing.F) {
	var good bytes.Buffer
	if err := llamaengine.WriteModel(&good, llamaengine.ModelConfig{Layers: 1, Embed: 8, Heads: 2, FF: 8}); err != nil {
		f.Fatal(err)
	}
	f.Add(good.Bytes()[:4096])
	f.Add([]byte("GGUF\x03\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := llamaengine.ReadHeader(bytes.NewReader(b))
		if err == nil && (h.Version < 2 || h.Version > 3) {
			t.Fatalf("accepted version %d", h.Version)
		}
	})
}

// ask sends one greedy chat request with logprobs and returns the parsed
// answer.
// post sends a chat completion request to e and returns the body of its
// 200 answer.
func post(t *testing.T, e *llamaengine.Engine, req map[string]any) []byte {
	t.Helper()
	body, _ := json.Marshal(req)
	resp, err := http.Post(e.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d: %s (%v)", resp.StatusCode, b, err)
	}
	return b
}

func ask(t *testing.T, e *llamaengine.Engine, prompt string, stream bool) audit.Completion {
	t.Helper()
	b := post(t, e, map[string]any{
		"model": "m1", "messages": []map[string]string{{"role": "user", "content": prompt}},
		"max_tokens": 24, "temperature": 0, "logprobs": true, "top_logprobs": 5, "stream": stream,
		"stream_options": map[string]bool{"include_usage": true},
	})
	if !stream {
		c, err := audit.ParseCompletion(b)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	var c audit.Completion
	for line := range strings.SplitSeq(string(b), "\n") {
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			if err := c.StreamChunk([]byte(data)); err != nil {
				t.Fatal(err)
			}
		}
	}
	return c
}

// TestRealEnginesSameAndDifferentModels serves one GGUF twice and another
// (another seed, the same shape and name) once, on real llama.cpp engines
// at temperature 0, and checks what an audit would see: the same file
// gives the same tokens and logprobs, streamed or not; the other file is
// told apart on every prompt, by tokens and by text alone.
func TestRealEnginesSameAndDifferentModels(t *testing.T) {
	llamatest.Need(t)
	files := llamatest.Models(t, 1, 2)
	engines := llamatest.Engines(t, "m1", files[0], files[0], files[1])
	a, b, c := engines[0], engines[1], engines[2]

	resp, err := http.Get(a.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	models, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(models), `"id":"m1"`) {
		t.Errorf("/v1/models: %s", models)
	}

	prompts := []string{
		"What is the capital of France?",
		"Write a haiku about the sea.",
		"Summarize: the quick brown fox jumps over the lazy dog.",
		"def fib(n):",
	}
	for i, p := range prompts {
		ra, rb, rc := ask(t, a, p, false), ask(t, b, p, i%2 == 1), ask(t, c, p, false)
		t.Logf("%q: same model %q, other model %q", p, ra.Answer.Text, rc.Answer.Text)
		if len(ra.Answer.Tokens) != 24 || ra.Usage == nil || ra.Usage.Completion != 24 || ra.Finish != "length" {
			t.Fatalf("answer of %d tokens, usage %+v, finish %q", len(ra.Answer.Tokens), ra.Usage, ra.Finish)
		}
		if f := audit.CheckAnswer(audit.Observed{Model: "m1", Answered: ra.Model, PromptText: len(p), RequestBytes: 300, Messages: 1, CompletionText: len(ra.Answer.Text), Usage: ra.Usage}, audit.Limits{}); len(f) > 0 {
			t.Errorf("cheap checks on an honest answer: %+v", f)
		}
		same := audit.Compare(ra.Answer, rb.Answer, audit.Tolerance{})
		if same.Outcome != audit.Agree || same.Common != 24 || same.MeanGap > 1e-6 {
			t.Errorf("%q, same model: %v, %d tokens agree, mean gap %v (%s)", p, same.Outcome, same.Common, same.MeanGap, same.Reason)
		}
		diff := audit.Compare(ra.Answer, rc.Answer, audit.Tolerance{})
		if diff.Outcome != audit.Disagree {
			t.Errorf("%q, other model: %v (%s)", p, diff.Outcome, diff.Reason)
		}
		text := audit.Compare(audit.Answer{Text: ra.Answer.Text}, audit.Answer{Text: rc.Answer.Text}, audit.Tolerance{})
		if text.Outcome != audit.Disagree {
			t.Errorf("%q, other model by text: %v (%s)", p, text.Outcome, text.Reason)
		}
	}

	// A round of the three as an auditor would judge it, with the first
	// engine as the operator's reference: the other model is convicted.
	r := ask(t, a, prompts[0], false)
	vs := audit.Judge([]audit.Participant{
		{Agent: "ref", Trusted: true, Answer: r.Answer},
		{Agent: "same", Answer: ask(t, b, prompts[0], false).Answer},
		{Agent: "other", Answer: ask(t, c, prompts[0], false).Answer},
	}, audit.Rules{})
	if len(vs) != 2 || vs[0].Outcome != audit.Agree || vs[1].Outcome != audit.Disagree {
		t.Errorf("verdicts %+v", vs)
	}

	// Bad input gets OpenAI error JSON.
	resp, err = http.Post(a.URL+"/v1/chat/completions", "application/json", strings.NewReader("{not json"))
	if err != nil {
		t.Fatal(err)
	}
	eb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(eb), `"type":"invalid_request_error"`) {
		t.Errorf("bad body: %d %s", resp.StatusCode, eb)
	}
}

// TestRealEngineKill: an engine killed mid-answer ends the connection (no
// answer a comparison could take for the model's), and Close after Kill
// is harmless.
func TestRealEngineKill(t *testing.T) {
	llamatest.Need(t)
	files := llamatest.Models(t, 1)
	e := llamatest.Engines(t, "m1", files[0])[0]
	body := `{"model":"m1","messages":[{"role":"user","content":"hello"}],"max_tokens":1500,"stream":true}`
	resp, err := http.Post(e.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 64)
	if _, err := io.ReadAtLeast(resp.Body, buf, 1); err != nil {
		t.Fatal(err)
	}
	e.Kill()
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Error("a stream cut by the engine's death read to a clean end")
	}
	e.Close()
	if _, err := os.Stat(files[0]); err != nil {
		t.Error(err)
	}
}

// chat sends a conversation to e and returns the answer with its usage.
func chat(t *testing.T, e *llamaengine.Engine, msgs []map[string]string, cache bool) audit.Completion {
	t.Helper()
	b := post(t, e, map[string]any{
		"model": "m1", "messages": msgs, "max_tokens": 16, "temperature": 0,
		"logprobs": true, "top_logprobs": 3, "cache_prompt": cache,
	})
	c, err := audit.ParseCompletion(b)
	if err != nil {
		t.Fatal(err)
	}
	if c.Usage == nil {
		t.Fatalf("no usage: %s", b)
	}
	return c
}

// TestRealEnginePromptCache: a conversation's next turn reuses what its
// engine evaluated for the last one, prompt and answer (reported as cached
// tokens), and the answer is the one a whole evaluation gives, tokens and
// logprobs; "cache_prompt": false evaluates the prompt whole.
func TestRealEnginePromptCache(t *testing.T) {
	llamatest.Need(t)
	e := llamatest.Engines(t, "m1", llamatest.Models(t, 1)...)[0]
	system := strings.Repeat("You are a careful assistant who answers briefly. ", 8)
	msgs := []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}}
	first := chat(t, e, msgs, true)
	if first.Usage.Cached != 0 {
		t.Errorf("first turn: %d cached tokens on a fresh engine", first.Usage.Cached)
	}
	// The next turn holds the whole first prompt ("ROLE: CONTENT\n" per
	// message, then "assistant:"; one token a character). The answer is
	// not reused: it was generated right after "assistant:", and the
	// template renders it after "assistant: ".
	msgs = append(msgs, map[string]string{"role": "assistant", "content": first.Answer.Text},
		map[string]string{"role": "user", "content": "And of Italy?"})
	next := chat(t, e, msgs, true)
	if next.Usage.Cached < first.Usage.Prompt || next.Usage.Cached >= next.Usage.Prompt {
		t.Errorf("next turn: %d of %d prompt tokens cached, want at least the first turn's %d", next.Usage.Cached, next.Usage.Prompt, first.Usage.Prompt)
	}
	whole := chat(t, e, msgs, false)
	if whole.Usage.Cached != 0 || whole.Usage.Prompt != next.Usage.Prompt {
		t.Errorf("cache_prompt false: %d of %d prompt tokens cached", whole.Usage.Cached, whole.Usage.Prompt)
	}
	// Evaluated in two batches, not one, the logprobs move by float
	// rounding (a mean gap of about 4e-4 here): within what an audit takes
	// as the same model.
	if c := audit.Compare(next.Answer, whole.Answer, audit.Tolerance{}); c.Outcome != audit.Agree || c.Common != len(whole.Answer.Tokens) {
		t.Errorf("cached and whole evaluations differ: %v, %d tokens agree, mean gap %v (%s)", c.Outcome, c.Common, c.MeanGap, c.Reason)
	}
}
