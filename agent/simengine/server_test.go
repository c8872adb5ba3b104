package simengine

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type testServer struct {
	*Server
	url    string
	client *http.Client
}

func startServer(t *testing.T, cfg Config) *testServer {
	t.Helper()
	cfg.Listen = "127.0.0.1:0"
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1000
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	tr := &http.Transport{}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		tr.CloseIdleConnections()
	})
	return &testServer{Server: s, url: s.URL(), client: &http.Client{Transport: tr}}
}

func (ts *testServer) post(t *testing.T, path string, body any) (*http.Response, []byte) {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case string:
		rd = strings.NewReader(b)
	default:
		js, _ := json.Marshal(b)
		rd = bytes.NewReader(js)
	}
	resp, err := ts.client.Post(ts.url+path, "application/json", rd)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, out
}

type msg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatResp struct {
	Object  string `json:"object"`
	Choices []struct {
		Message      msg    `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage usageJSON `json:"usage"`
}

func TestChatFollowUpHitsCache(t *testing.T) {
	ts := startServer(t, Config{})
	history := []msg{{"system", "You are a terse assistant. " + Filler(3, 300)}, {"user", "Explain prefix caching."}}
	var prevPrompt, prevAnswer int
	for turn := range 4 {
		resp, body := ts.post(t, "/v1/chat/completions", map[string]any{"model": DefaultModel, "messages": history, "max_tokens": 20 + turn})
		if resp.StatusCode != 200 {
			t.Fatalf("turn %d: %d %s", turn, resp.StatusCode, body)
		}
		var cr chatResp
		if err := json.Unmarshal(body, &cr); err != nil {
			t.Fatal(err)
		}
		u := cr.Usage
		var b strings.Builder
		for _, m := range history {
			renderMessage(&b, m.Role, m.Content)
		}
		if want := CountTokens(b.String() + chatGenerationPrompt); u.PromptTokens != want {
			t.Fatalf("turn %d: prompt_tokens %d, want %d", turn, u.PromptTokens, want)
		}
		if u.CompletionTokens != 20+turn || u.TotalTokens != u.PromptTokens+u.CompletionTokens || cr.Choices[0].FinishReason != "length" {
			t.Fatalf("turn %d: usage %+v, finish %q", turn, u, cr.Choices[0].FinishReason)
		}
		want := 0
		if turn > 0 { // the previous prompt and answer, in full blocks
			want = (prevPrompt + prevAnswer) / 16 * 16
		}
		if u.PromptTokensDetails.CachedTokens != want {
			t.Fatalf("turn %d: cached_tokens %d, want %d", turn, u.PromptTokensDetails.CachedTokens, want)
		}
		prevPrompt, prevAnswer = u.PromptTokens, u.CompletionTokens
		history = append(history, cr.Choices[0].Message, msg{"user", fmt.Sprintf("And what about case %d?", turn)})
	}
}

// sse reads a stream's data payloads.
func sse(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20)
	blank := true
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			blank = true
			continue
		}
		if !blank || !strings.HasPrefix(line, "data: ") {
			t.Fatalf("bad SSE line %q", line)
		}
		blank = false
		out = append(out, strings.TrimPrefix(line, "data: "))
	}
	return out
}

func TestStreamFormat(t *testing.T) {
	ts := startServer(t, Config{})
	for _, c := range []struct {
		path, object string
		body         map[string]any
	}{
		{"/v1/chat/completions", "chat.completion.chunk", map[string]any{"messages": []msg{{"user", "hi there"}}, "stream": true, "max_tokens": 7}},
		{"/v1/completions", "text_completion", map[string]any{"prompt": "Once upon a time", "stream": true, "max_tokens": 7}},
	} {
		t.Run(c.path, func(t *testing.T) {
			resp, body := ts.post(t, c.path, c.body)
			if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				t.Fatalf("%d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
			}
			data := sse(t, bytes.NewReader(body))
			if len(data) < 3 || data[len(data)-1] != "[DONE]" {
				t.Fatalf("stream does not end with [DONE]: %q", data)
			}
			var text strings.Builder
			tokens := 0
			for i, d := range data[:len(data)-1] {
				var ch struct {
					ID      string `json:"id"`
					Object  string `json:"object"`
					Model   string `json:"model"`
					Choices []struct {
						Delta *struct {
							Role    string  `json:"role"`
							Content *string `json:"content"`
						} `json:"delta"`
						Text         *string `json:"text"`
						FinishReason *string `json:"finish_reason"`
					} `json:"choices"`
					Usage *usageJSON `json:"usage"`
				}
				if err := json.Unmarshal([]byte(d), &ch); err != nil {
					t.Fatalf("chunk %d: %v: %s", i, err, d)
				}
				if ch.Object != c.object || ch.Model != DefaultModel || ch.ID == "" {
					t.Fatalf("chunk %d: %s", i, d)
				}
				last := i == len(data)-2
				if last != (ch.Usage != nil) {
					t.Fatalf("usage must be in the last chunk only: chunk %d: %s", i, d)
				}
				if last {
					if len(ch.Choices) != 0 || ch.Usage.CompletionTokens != 7 || ch.Usage.PromptTokens == 0 {
						t.Fatalf("usage chunk %s", d)
					}
					continue
				}
				if len(ch.Choices) != 1 {
					t.Fatalf("chunk %d: %s", i, d)
				}
				cc := ch.Choices[0]
				piece := cc.Text
				if cc.Delta != nil {
					piece = cc.Delta.Content
				}
				if piece != nil && *piece != "" {
					tokens++
					text.WriteString(*piece)
				}
				if (cc.FinishReason != nil) != (i == len(data)-3) {
					t.Fatalf("finish_reason in chunk %d of %d: %s", i, len(data), d)
				}
			}
			if tokens != 7 || CountTokens(text.String()) != 7 {
				t.Fatalf("%d token chunks, text %q", tokens, text.String())
			}
			// the same request without streaming gives the same text
			c.body["stream"] = false
			_, whole := ts.post(t, c.path, c.body)
			if !bytes.Contains(whole, []byte(fmt.Sprintf("%q", text.String()))) {
				t.Fatalf("non-streamed answer differs: %s vs %q", whole, text.String())
			}
		})
	}
}

func TestErrors(t *testing.T) {
	ts := startServer(t, Config{Engine: EngineConfig{MaxModelLen: 100}})
	cases := []struct {
		name, path string
		body       string
		status     int
		code       string
	}{
		{"malformed JSON", "/v1/chat/completions", `{"messages": [`, 400, ""},
		{"unknown model", "/v1/chat/completions", `{"model":"gpt-9","messages":[{"role":"user","content":"hi"}]}`, 404, "model_not_found"},
		{"no messages", "/v1/chat/completions", `{"messages":[]}`, 400, ""},
		{"image part", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, 400, ""},
		{"bad max_tokens", "/v1/completions", `{"prompt":"x","max_tokens":0}`, 400, ""},
		{"too long", "/v1/completions", `{"prompt":"x","max_tokens":100}`, 400, "context_length_exceeded"},
		{"no route", "/v1/nothing", `{}`, 404, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp, body := ts.post(t, c.path, c.body)
			var eb errorBody
			if err := json.Unmarshal(body, &eb); err != nil || eb.Error.Message == "" || eb.Error.Type == "" {
				t.Fatalf("not an OpenAI error: %s", body)
			}
			code := ""
			if eb.Error.Code != nil {
				code = *eb.Error.Code
			}
			if resp.StatusCode != c.status || code != c.code {
				t.Fatalf("got %d %q, want %d %q: %s", resp.StatusCode, code, c.status, c.code, body)
			}
		})
	}
}

func TestModelsEmbeddingsAdmin(t *testing.T) {
	ts := startServer(t, Config{Models: []string{"a", "b"}})
	resp, err := ts.client.Get(ts.url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Data []struct{ ID string } `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil || len(list.Data) != 2 || list.Data[1].ID != "b" {
		t.Fatalf("models: %v %+v", err, list)
	}
	_, body := ts.post(t, "/v1/embeddings", map[string]any{"model": "b", "input": []string{"hello world", "hello world"}})
	var er struct {
		Data []struct{ Embedding []float64 } `json:"data"`
	}
	if err := json.Unmarshal(body, &er); err != nil || len(er.Data) != 2 || len(er.Data[0].Embedding) != DefaultEmbeddingDims {
		t.Fatalf("embeddings: %v %s", err, body)
	}
	if fmt.Sprint(er.Data[0].Embedding) != fmt.Sprint(er.Data[1].Embedding) {
		t.Fatal("same input, different embeddings")
	}
	resp, body = ts.post(t, "/admin/slowdown?factor=5", "")
	if resp.StatusCode != 200 || ts.Stats().Slowdown != 5 {
		t.Fatalf("slowdown: %d %s", resp.StatusCode, body)
	}
	if resp, _ = ts.post(t, "/admin/slowdown", `{"factor": -1}`); resp.StatusCode != 400 {
		t.Fatalf("negative factor: %d", resp.StatusCode)
	}
	if isLoopback("192.0.2.1:5000") || !isLoopback("[::1]:5000") {
		t.Fatal("isLoopback")
	}
}

func TestMetrics(t *testing.T) {
	ts := startServer(t, Config{Models: []string{"m1"}})
	ts.post(t, "/v1/completions", map[string]any{"prompt": Filler(1, 100), "max_tokens": 2})
	ts.post(t, "/v1/completions", map[string]any{"prompt": Filler(1, 100) + "more", "max_tokens": 2})
	resp, err := ts.client.Get(ts.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	val := func(name string) float64 {
		f := fams[name]
		if f == nil || len(f.Metric) != 1 {
			t.Fatalf("metric %s missing", name)
		}
		m := f.Metric[0]
		if len(m.Label) != 1 || m.Label[0].GetName() != "model_name" || m.Label[0].GetValue() != "m1" {
			t.Fatalf("%s labels %v", name, m.Label)
		}
		if m.Counter != nil {
			return m.Counter.GetValue()
		}
		return m.Gauge.GetValue()
	}
	if val("vllm:num_requests_running") != 0 || val("vllm:num_requests_waiting") != 0 || val("vllm:kv_cache_usage_perc") != 0 {
		t.Fatal("idle engine reports load")
	}
	if q, h := val("vllm:prefix_cache_queries_total"), val("vllm:prefix_cache_hits_total"); q != 201 || h != 96 {
		t.Fatalf("prefix cache queries %v hits %v, want 201 and 96", q, h)
	}
	if fams["vllm:prefix_cache_hits_total"].GetType().String() != "COUNTER" {
		t.Fatal("hits is not a counter")
	}
}

func TestCancellationFreesSlot(t *testing.T) {
	ts := startServer(t, Config{TimeScale: 1, Engine: EngineConfig{MaxRunning: 1}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	js := `{"messages":[{"role":"user","content":"tell me a long story"}],"stream":true,"max_tokens":100000}`
	req, _ := http.NewRequestWithContext(ctx, "POST", ts.url+"/v1/chat/completions", strings.NewReader(js))
	resp, err := ts.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n') // the first chunk is out
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("%q %v", line, err)
	}
	if st := ts.Stats(); st.Running != 1 {
		t.Fatalf("running %d", st.Running)
	}
	cancel()
	resp.Body.Close()
	deadline := time.Now().Add(10 * time.Second)
	for st := ts.Stats(); st.Running != 0 || st.Cancelled != 1; st = ts.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("slot not freed: %+v", st)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// the slot serves the next request
	resp2, body := ts.post(t, "/v1/completions", map[string]any{"prompt": "next", "max_tokens": 1})
	if resp2.StatusCode != 200 {
		t.Fatalf("%d %s", resp2.StatusCode, body)
	}
}

func TestQueueFullIs503(t *testing.T) {
	ts := startServer(t, Config{TimeScale: 1, Engine: EngineConfig{MaxRunning: 1, MaxQueue: -1}})
	if err := ts.SetSlowdown(1e6); err != nil { // nothing finishes during the test
		t.Fatal(err)
	}
	ts.Server.mu.Lock()
	ts.Server.eng.cfg.MaxQueue = 0 // one running, none may wait
	ts.Server.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", ts.url+"/v1/completions", strings.NewReader(`{"prompt":"a","max_tokens":5}`))
	go func() {
		if resp, err := ts.client.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for ts.Stats().Running != 1 {
		if time.Now().After(deadline) {
			t.Fatal("first request never ran")
		}
		time.Sleep(5 * time.Millisecond)
	}
	resp, body := ts.post(t, "/v1/completions", `{"prompt":"b","max_tokens":5}`)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || !strings.Contains(string(body), "server_overloaded") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	cancel()
}

func TestConfigDefaults(t *testing.T) {
	var c Config
	c.populate()
	if err := c.validate(); err != nil {
		t.Fatal(err)
	}
	if c.Listen != DefaultListen || c.Models[0] != DefaultModel || c.Engine.CacheBlocks != DefaultCacheBlocks || c.Engine.BlockSize != 16 {
		t.Fatalf("%+v", c)
	}
	// explicit values survive defaulting
	c2 := Config{Listen: "x:1", Models: []string{"m"}, TimeScale: 3, DefaultMaxTokens: 9, StreamInterval: 1, MaxBodyBytes: 2, ShutdownTimeout: 4,
		Engine: EngineConfig{BlockSize: 8, CacheBlocks: 7, PrefillTokensPerSec: 6, DecodeTimePerToken: 5, DecodeTimePerSeq: 4, MaxRunning: 3, MaxQueue: 2, MaxModelLen: 99, Seed: 1}}
	c3 := c2
	c3.populate()
	if fmt.Sprint(c2) != fmt.Sprint(c3) {
		t.Fatalf("populate changed explicit values:\n%+v\n%+v", c2, c3)
	}
	if _, err := New(Config{TimeScale: -1}); err == nil {
		t.Fatal("negative time scale accepted")
	}
}

// TestSampledAnswersFollowTheSeed: as engines do, a sampled request's
// answer is the same for the same seed and another for another seed or
// none; a greedy one depends on the prompt alone. A sampled follow-up
// turn still finds its earlier answer cached.
func TestSampledAnswersFollowTheSeed(t *testing.T) {
	ts := startServer(t, Config{})
	answer := func(extra map[string]any) string {
		body := map[string]any{"model": DefaultModel, "max_tokens": 12, "messages": []msg{{"user", "Tell me about rivers."}}}
		for k, v := range extra {
			body[k] = v
		}
		resp, b := ts.post(t, "/v1/chat/completions", body)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		var cr chatResp
		if err := json.Unmarshal(b, &cr); err != nil {
			t.Fatal(err)
		}
		return cr.Choices[0].Message.Content
	}
	greedy := answer(nil)
	s1, s1again, s2 := answer(map[string]any{"temperature": 0.8, "seed": 1}), answer(map[string]any{"temperature": 0.8, "seed": 1}), answer(map[string]any{"temperature": 0.8, "seed": 2})
	if s1 != s1again || s1 == s2 || s1 == greedy {
		t.Errorf("seed 1: %q and %q; seed 2: %q; greedy %q", s1, s1again, s2, greedy)
	}
	if a, b := answer(map[string]any{"temperature": 0.8}), answer(map[string]any{"temperature": 0.8}); a == b {
		t.Errorf("two unseeded sampled answers are the same: %q", a)
	}
	if g := answer(map[string]any{"temperature": 0, "seed": 5}); g != greedy {
		t.Errorf("greedy with a seed %q, without %q", g, greedy)
	}
	// The follow-up turn of a sampled answer hits the cache for it.
	hist := []msg{{"system", Filler(3, 300)}, {"user", "Explain."}}
	resp, b := ts.post(t, "/v1/chat/completions", map[string]any{"model": DefaultModel, "max_tokens": 20, "temperature": 1, "seed": 9, "messages": hist})
	var first chatResp
	if resp.StatusCode != 200 || json.Unmarshal(b, &first) != nil {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	hist = append(hist, first.Choices[0].Message, msg{"user", "More."})
	_, b = ts.post(t, "/v1/chat/completions", map[string]any{"model": DefaultModel, "max_tokens": 5, "temperature": 1, "seed": 10, "messages": hist})
	var second chatResp
	if json.Unmarshal(b, &second) != nil {
		t.Fatal(string(b))
	}
	if want := (first.Usage.PromptTokens + first.Usage.CompletionTokens) / 16 * 16; second.Usage.PromptTokensDetails.CachedTokens != want {
		t.Errorf("sampled follow-up: cached %d, want %d", second.Usage.PromptTokensDetails.CachedTokens, want)
	}
}

// TestToolCalls: offered tools, the answer calls one (the named one, or
// the first) with its required parameters filled by type, streamed or
// not, finish_reason tool_calls; after the tool's result, or with
// tool_choice none, it answers in text.
func TestToolCalls(t *testing.T) {
	ts := startServer(t, Config{})
	tools := `[{"type":"function","function":{"name":"lookup","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}},` +
		`{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},"unit":{"enum":["c","f"]}},"required":["city","unit"]}}}]`
	ask := func(choice, last string, stream bool) []byte {
		body := `{"model":"` + DefaultModel + `","max_tokens":6,"tools":` + tools + `,"messages":[{"role":"user","content":"weather?"}` + last + `]`
		if choice != "" {
			body += `,"tool_choice":` + choice
		}
		if stream {
			body += `,"stream":true`
		}
		resp, b := ts.post(t, "/v1/chat/completions", body+"}")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return b
	}
	var whole struct {
		Choices []struct {
			Message struct {
				Content   *string
				ToolCalls []struct {
					ID       string
					Function struct{ Name, Arguments string }
				} `json:"tool_calls"`
			}
			FinishReason string `json:"finish_reason"`
		}
	}
	if err := json.Unmarshal(ask(`{"type":"function","function":{"name":"get_weather"}}`, "", false), &whole); err != nil {
		t.Fatal(err)
	}
	c := whole.Choices[0]
	if c.FinishReason != "tool_calls" || c.Message.Content != nil || len(c.Message.ToolCalls) != 1 ||
		c.Message.ToolCalls[0].Function.Name != "get_weather" || c.Message.ToolCalls[0].Function.Arguments != `{"city":"city","unit":"c"}` ||
		!strings.HasPrefix(c.Message.ToolCalls[0].ID, "call_") {
		t.Fatalf("named tool: %+v", c)
	}
	// Streamed, auto: the first tool, its arguments in parts.
	var args, name string
	finish := ""
	for _, ev := range sse(t, bytes.NewReader(ask("", "", true))) {
		if ev == "[DONE]" {
			continue
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					ToolCalls []struct {
						Index    int
						Function struct{ Name, Arguments string }
					} `json:"tool_calls"`
				}
				FinishReason *string `json:"finish_reason"`
			}
		}
		if err := json.Unmarshal([]byte(ev), &ch); err != nil {
			t.Fatalf("%q: %v", ev, err)
		}
		for _, c := range ch.Choices {
			for _, tc := range c.Delta.ToolCalls {
				name += tc.Function.Name
				args += tc.Function.Arguments
			}
			if c.FinishReason != nil {
				finish = *c.FinishReason
			}
		}
	}
	if name != "lookup" || args != `{"q":"q"}` || finish != "tool_calls" {
		t.Fatalf("streamed auto call: %q %q %q", name, args, finish)
	}
	// After the tool's result, and with none: text.
	result := `,{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"lookup","arguments":"{}"}}]},{"role":"tool","tool_call_id":"call_1","content":"sunny"}`
	for _, c := range [][2]string{{"", result}, {`"none"`, ""}} {
		whole.Choices = nil
		if err := json.Unmarshal(ask(c[0], c[1], false), &whole); err != nil {
			t.Fatal(err)
		}
		if ch := whole.Choices[0]; ch.Message.Content == nil || *ch.Message.Content == "" || len(ch.Message.ToolCalls) != 0 {
			t.Fatalf("tool_choice %s after %q: %+v", c[0], c[1], ch)
		}
	}
}
