package agent

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/scheduler/jsonscan"
	"github.com/computeflux/computeflux/transport/usage"
)

func TestAskUsage(t *testing.T) {
	cases := []struct {
		name string
		in   string
		ask  bool
		opts string // stream_options after the rewrite
	}{
		{"stream without options", `{"model":"m","stream":true,"messages":[]}`, true, `{"include_usage":true}`},
		{"stream with null options", `{"model":"m","stream":true,"stream_options":null}`, true, `{"include_usage":true}`},
		{"other options kept", `{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":false}}`, true, `{"continuous_usage_stats":false,"include_usage":true}`},
		{"usage off", `{"model":"m","stream":true,"stream_options":{"include_usage":false}}`, true, `{"include_usage":true}`},
		{"already asked", `{"model":"m","stream":true,"stream_options":{"include_usage":true}}`, false, ""},
		{"not a stream", `{"model":"m","stream":false}`, false, ""},
		{"no stream field", `{"model":"m"}`, false, ""},
		{"not JSON", `{"model":`, false, ""},
		{"bad options", `{"model":"m","stream":true,"stream_options":[1]}`, false, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, ok := askUsage([]byte(tc.in))
			if ok != tc.ask {
				t.Fatalf("asked %v, want %v (%s)", ok, tc.ask, out)
			}
			if !ok {
				return
			}
			var f map[string]json.RawMessage
			if err := json.Unmarshal(out, &f); err != nil {
				t.Fatalf("rewritten body %s: %v", out, err)
			}
			if string(f["stream_options"]) != tc.opts {
				t.Fatalf("stream_options %s, want %s", f["stream_options"], tc.opts)
			}
			if string(f["model"]) != `"m"` || string(f["stream"]) != "true" {
				t.Fatalf("other fields changed: %s", out)
			}
		})
	}
}

// usageEngine streams two content chunks, then a usage chunk (as vLLM does
// when asked), or answers one JSON object; it records the bodies it got.
type usageEngine struct {
	prompt, cached int
	mu             sync.Mutex
	bodies         []string
}

func (e *usageEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	e.mu.Lock()
	e.bodies = append(e.bodies, string(b))
	e.mu.Unlock()
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":%d}}`, e.prompt, e.cached)
	if !bytes.Contains(b, []byte(`"stream":true`)) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"choices":[{"message":{"content":"hi"}}],"usage":%s}`, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
	w.(http.Flusher).Flush()
	fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: {\"choices\":[],\"usage\":"+usage+"}\n\n")
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func (e *usageEngine) lastBody() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.bodies[len(e.bodies)-1]
}

func newIndexedAgent(t *testing.T, h http.Handler, kvTokens int) *Agent {
	t.Helper()
	eng := httptest.NewServer(h)
	t.Cleanup(eng.Close)
	a, err := New(Config{
		Relay: "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWDkftGHFMSNsFYC5NV8WDxAcwH1EWPBBSUhuk5FzmHpdu",
		Token: "t", Upstream: eng.URL, Name: "a",
		Index: IndexConfig{KVCapacityTokens: kvTokens},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		a.client.CloseIdleConnections()
		if c, ok := a.cfg.UpstreamTransport.(interface{ CloseIdleConnections() }); ok {
			c.CloseIdleConnections()
		}
	})
	return a
}

func chatReq(system string, stream, includeUsage bool) string {
	m := map[string]any{"model": "m", "stream": stream,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": "q"}}}
	if includeUsage {
		m["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// TestAgentIndexesServedRequests runs the agent's handler as a plain
// handler (ServeHTTP reads the body) and as transport.ServeHTTP calls it
// (ServeHTTPBody, the body read already).
func TestAgentIndexesServedRequests(t *testing.T) {
	t.Run("ServeHTTP", func(t *testing.T) { testAgentIndexes(t, false) })
	t.Run("ServeHTTPBody", func(t *testing.T) { testAgentIndexes(t, true) })
}

func testAgentIndexes(t *testing.T, buffered bool) {
	eng := &usageEngine{prompt: 2000, cached: 0}
	a := newIndexedAgent(t, eng, 64*64)
	system := strings.Repeat("the same long system prompt ", 400) // about 11 KiB
	chain := scheduler.PromptBlocks(nil, []byte(chatReq(system, true, false)), scheduler.PrefixConfig{})
	if len(chain) < 40 {
		t.Fatalf("chain of %d blocks", len(chain))
	}
	serve := func(body string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		if buffered {
			a.ServeHTTPBody(rec, req, []byte(body))
		} else {
			a.ServeHTTP(rec, req)
		}
		rewritten := strings.Contains(body, `"stream":true`) && !strings.Contains(body, `"include_usage"`)
		if got := eng.lastBody(); !rewritten && got != body {
			t.Fatalf("the engine got %q for %q", got, body)
		}
		if rec.Code != http.StatusOK {
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
		return rec
	}

	t.Run("stream without usage asked", func(t *testing.T) {
		rec := serve(chatReq(system, true, false))
		if !strings.Contains(eng.lastBody(), `"include_usage":true`) {
			t.Fatalf("the engine was not asked for usage: %s", eng.lastBody())
		}
		out := rec.Body.String()
		if strings.Contains(out, `"usage"`) {
			t.Fatalf("the client got the usage chunk it did not ask for:\n%s", out)
		}
		if !strings.Contains(out, `"content":"a"`) || !strings.Contains(out, `"content":"b"`) || !strings.HasSuffix(out, "data: [DONE]\n\n") {
			t.Fatalf("stream changed:\n%q", out)
		}
		if st := a.IndexStats(); st.Blocks != len(chain) {
			t.Fatalf("index holds %d blocks, want the chain's %d", st.Blocks, len(chain))
		}
	})
	t.Run("stream with usage asked", func(t *testing.T) {
		rec := serve(chatReq(system, true, true))
		if !strings.Contains(rec.Body.String(), `"cached_tokens":0`) {
			t.Fatalf("the client lost the usage chunk it asked for:\n%s", rec.Body)
		}
	})
	t.Run("correction from cached_tokens", func(t *testing.T) {
		// The index believes the whole chain cached; the engine says none
		// was: the capacity shrinks by the error.
		before := a.IndexStats()
		serve(chatReq(system, false, false))
		st := a.IndexStats()
		if st.Corrections <= before.Corrections || st.Capacity >= before.Capacity {
			t.Fatalf("no correction: before %+v, after %+v", before, st)
		}
	})
	t.Run("prompt shorter than a block", func(t *testing.T) {
		// No chain to correct: the answer passes as it is, but a usage
		// chunk the client did not ask for is still dropped.
		before := a.IndexStats()
		rec := serve(chatReq("s", true, false))
		if out := rec.Body.String(); strings.Contains(out, `"usage"`) || !strings.HasSuffix(out, "data: [DONE]\n\n") {
			t.Fatalf("short stream:\n%q", out)
		}
		rec = serve(chatReq("s", false, false))
		if !strings.Contains(rec.Body.String(), `"cached_tokens":0`) {
			t.Fatalf("short answer changed: %s", rec.Body)
		}
		if st := a.IndexStats(); st.Blocks != before.Blocks || st.Corrections != before.Corrections {
			t.Fatalf("a prompt without a block changed the index: %+v -> %+v", before, st)
		}
	})
	t.Run("embeddings are not indexed", func(t *testing.T) {
		before := a.IndexStats().Blocks
		rec := httptest.NewRecorder()
		a.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/embeddings", strings.NewReader(`{"model":"m","input":"`+strings.Repeat("x", 4096)+`"}`)))
		if got := a.IndexStats().Blocks; got != before {
			t.Fatalf("embeddings changed the index: %d -> %d", before, got)
		}
	})
}

func TestUsageBodyEventsAcrossReads(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\n" +
		"data: [DONE]\n\n"
	for _, strip := range []bool{false, true} {
		for step := 1; step <= 7; step += 3 {
			b := &usageBody{rc: io.NopCloser(&trickle{s: stream, n: step}), sse: true, strip: strip}
			out, err := io.ReadAll(b)
			if err != nil {
				t.Fatal(err)
			}
			got := b.u
			if !got.Seen || got.Prompt != 10 || got.Cached != 7 {
				t.Fatalf("step %d: usage %+v", step, got)
			}
			if strip == strings.Contains(string(out), "usage") || !strings.HasSuffix(string(out), "data: [DONE]\n\n") {
				t.Fatalf("strip %v step %d: %q", strip, step, out)
			}
		}
	}
}

// TestUsageBodyCRLFEvents: events whose lines end in CRLF (sse-starlette's
// default separator, for a server built on it that keeps it) are
// cut as events too: each is passed on as soon as it is complete, not held
// back until the buffer is full or the stream ends, and the usage chunk is
// read and dropped.
func TestUsageBodyCRLFEvents(t *testing.T) {
	first := "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\n"
	pr, pw := io.Pipe()
	defer pr.Close()
	go pw.Write([]byte(first)) // and nothing more until the test ends
	b := &usageBody{rc: pr, sse: true, strip: true}
	got := make(chan string, 1)
	go func() {
		p := make([]byte, 4096)
		n, _ := b.Read(p)
		got <- string(p[:n])
	}()
	select {
	case s := <-got:
		if s != first {
			t.Fatalf("first read %q", s)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a complete CRLF event was held back")
	}
	stream := first +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\r\n\r\n" +
		"data: [DONE]\r\n\r\n"
	for step := 1; step <= 9; step += 4 {
		b := &usageBody{rc: io.NopCloser(&trickle{s: stream, n: step}), sse: true, strip: true}
		out, err := io.ReadAll(b)
		if err != nil {
			t.Fatal(err)
		}
		if string(out) != first+"data: [DONE]\r\n\r\n" || b.u.Prompt != 10 || b.u.Cached != 7 {
			t.Fatalf("step %d: %q, usage %+v", step, out, b.u)
		}
	}
}

// TestUsageBodyLongEvents: an event longer than the read buffer is held
// whole (its usage read, dropped when stripping); one longer than
// maxUsageEvent passes through unread.
func TestUsageBodyLongEvents(t *testing.T) {
	usageEv := "data: {\"choices\":[],\"pad\":\"" + strings.Repeat("p", 100<<10) + "\",\"usage\":{\"prompt_tokens\":10}}\n\n"
	huge := "data: {\"choices\":[],\"pad\":\"" + strings.Repeat("p", 2*maxUsageEvent) + "\",\"usage\":{\"prompt_tokens\":11}}\n\n"
	text := "data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("x", 40<<10) + "\"}}]}\n\n"
	for _, tc := range []struct {
		name, stream, want string
		prompt             int64
	}{
		{"long usage chunk", text + usageEv + "data: [DONE]\n\n", text + "data: [DONE]\n\n", 10},
		{"usage chunk past the bound", text + huge + "data: [DONE]\n\n", text + huge + "data: [DONE]\n\n", 0},
	} {
		for _, step := range []int{61, 1000, 70000} {
			b := &usageBody{rc: io.NopCloser(&trickle{s: tc.stream, n: step}), sse: true, strip: true}
			out, err := io.ReadAll(b)
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != tc.want || b.u.Prompt != tc.prompt {
				t.Fatalf("%s, reads of %d: %d bytes out (want %d), usage %+v", tc.name, step, len(out), len(tc.want), b.u)
			}
		}
	}
}

// trickle returns s n bytes at a time.
type trickle struct {
	s string
	n int
}

func (r *trickle) Read(p []byte) (int, error) {
	if r.s == "" {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), r.n)], r.s)
	r.s = r.s[n:]
	return n, nil
}

func TestParseKVCapacity(t *testing.T) {
	cases := []struct {
		name string
		in   string
		want int
		ok   bool
	}{
		{"vllm", "# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"27000\",num_cpu_blocks=\"0\"} 1.0\n", 432000, true},
		{"labels in another order", "vllm:cache_config_info{num_gpu_blocks=\"100\",block_size=\"32\"} 1\n", 3200, true},
		{"missing blocks", "vllm:cache_config_info{block_size=\"16\"} 1\n", 0, false},
		{"none", "vllm:num_requests_running 3\n", 0, false},
		{"garbage", "vllm:cache_config_info{block_size=\"16\n", 0, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, err := ParseEngineMetrics(strings.NewReader(tc.in))
			if err != nil {
				t.Fatal(err)
			}
			got, ok := m.KVCapacityTokens, m.KVCapacityTokens > 0
			if got != tc.want || ok != tc.ok {
				t.Fatalf("got %d %v, want %d %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

// TestEngineKVCapacityLlamaCpp: a llama.cpp without --metrics is sized
// from its /props (total_slots x the per-slot context) at identification,
// and the index takes that size.
func TestEngineKVCapacityLlamaCpp(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"m","owned_by":"llamacpp"}]}`)
	})
	mux.HandleFunc("/props", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"total_slots":4,"default_generation_settings":{"n_ctx":8192}}`)
	})
	a := newIndexedAgent(t, mux, 0)
	if got := a.index.stats().CapacityTokens; got == 4*8192 {
		t.Fatalf("index sized %d tokens before the engine was read", got)
	}
	a.refresh(t.Context())
	if k := a.Engine().Kind; k != EngineLlamaCpp {
		t.Fatalf("engine %q, want llama.cpp", k)
	}
	if got := a.KVCapacityTokens(); got != 4*8192 {
		t.Fatalf("KV capacity %d tokens, want %d", got, 4*8192)
	}
	if got := a.index.stats().CapacityTokens; got != 4*8192 {
		t.Fatalf("index sized %d tokens, want %d", got, 4*8192)
	}
}

// cutEvents is what usageBody makes of a whole stream, whatever its reads:
// its events (cut at blank lines, after "\n" or "\r\n") but the usage
// chunks when strip is set, an unfinished last event as it is, and the
// last usage read.
func cutEvents(data []byte, strip bool) ([]byte, usage.Counts) {
	var b usageBody
	var out []byte
	for {
		end := -1
		for _, sep := range []string{"\n\n", "\n\r\n"} {
			if i := bytes.Index(data, []byte(sep)); i >= 0 && (end < 0 || i+len(sep) < end) {
				end = i + len(sep)
			}
		}
		if end < 0 {
			return append(out, data...), b.u
		}
		ev := data[:end]
		data = data[end:]
		if b.usageOnly(ev) && strip {
			continue
		}
		out = append(out, ev...)
	}
}

// FuzzUsageBody feeds arbitrary streams through the usage reader: it never
// panics, passes everything on unchanged when not stripping, and gives what
// cutting the whole stream at once gives, whatever the size of its reads.
func FuzzUsageBody(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\ndata: [DONE]\n\n"), 3)
	f.Add([]byte("data: {\"choices\":[{}],\"usage\":null}\n\n"), 1)
	f.Add([]byte("data: {\"choices\":[]}\r\n\r\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\r\n\n\r\ndata: [DONE]\n\r\n"), 2)
	f.Add([]byte("\n\n\n\"usage\"\n\n"), 2)
	f.Fuzz(func(t *testing.T, data []byte, step int) {
		step = max(1, step%64+1)
		for _, strip := range []bool{false, true} {
			b := &usageBody{rc: io.NopCloser(&trickle{s: string(data), n: step}), sse: true, strip: strip}
			out, err := io.ReadAll(b)
			if err != nil {
				t.Fatal(err)
			}
			if !strip && !bytes.Equal(out, data) {
				t.Fatalf("changed without stripping: %q -> %q", data, out)
			}
			if want, wantU := cutEvents(data, strip); !bytes.Equal(out, want) || b.u != wantU {
				t.Fatalf("strip %v step %d: %q -> %q (usage %+v), want %q (usage %+v)", strip, step, data, out, b.u, want, wantU)
			}
			if len(out) > len(data) {
				t.Fatalf("output longer than input")
			}
		}
		if out, ok := askUsage(data); ok && json.Valid(data) && !json.Valid(out) {
			t.Fatalf("askUsage made invalid JSON of %q: %q", data, out)
		}
	})
}

// TestIndexCalibratesBytesPerToken: after 32 answers the index is resized
// from the bytes per token its prompts measured.
func TestIndexCalibratesBytesPerToken(t *testing.T) {
	x := newPrefixIndex(IndexConfig{KVCapacityTokens: 64 * 1000}, zerolog.Nop())
	if got := x.stats().Capacity; got != 1000 {
		t.Fatalf("initial capacity %d blocks", got)
	}
	bb := scheduler.PrefixConfig{}.BlockBytes()
	for i := range calibrationAnswers {
		// 10 full blocks: about 10.5 x 256 bytes, for 336 tokens: 8 bytes a token.
		chain := make([]uint64, 10)
		for j := range chain {
			chain[j] = uint64(i*100 + j + 1)
		}
		x.answered(chain, x.served(chain), 21*bb/2/8, 0)
	}
	// 64,000 tokens x 8 bytes / 256 bytes a block.
	if got := x.stats().Capacity; got < 1900 || got > 2100 {
		t.Fatalf("capacity %d blocks after calibration, want about 2,000", got)
	}
}

// usageScanSeeds are answers, chunks and requests for the scans' tests:
// the usual shapes and the corners where a scan could part from
// encoding/json (case, duplicates, escapes, types, nesting).
var usageScanSeeds = []string{
	benchReply,
	`{"choices":[],"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":7}}}`,
	`{"choices":[ ],"usage":{"prompt_tokens":10,"prompt_tokens_details":null}}`,
	`{"choices":[{}],"usage":null}`,
	`{"Usage":{"Prompt_Tokens":3},"CHOICES":null}`,
	`{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}`,
	`{"us\u0061ge":{"prompt_tokens":5}}`,
	`{"usage":{"prompt_tokens":1.5}}`,
	`{"usage":{"prompt_tokens":"1"}}`,
	`{"usage":{"prompt_tokens":-0,"prompt_tokens_details":{"cached_tokens":1e2}}}`,
	`{"usage":[1]}`,
	`{"choices":{},"usage":{"prompt_tokens":1}}`,
	`{"ſtream":true}`,
	`{"model":"m","stream":true,"messages":[]}`,
	`{"model":"m","STREAM":true}`,
	`{"stream":true,"stream":false}`,
	`{"stream":false,"stream":true}`,
	`{"stream":true,"stream_options":null}`,
	`{"stream":true,"stream_options":{"include_usage":true}}`,
	`{"stream":true,"stream_options":{"Include_Usage":true}}`,
	`{"stream":true,"stream_options":{"include_usage":true,"include_usage":false}}`,
	`{"stream":true,"stream_options":{"include\u005fusage":true}}`,
	`{"stream":true,"stream_options":{"continuous_usage_stats":true}}`,
	`{"stream":true,"x":[` + strings.Repeat("[", 300) + strings.Repeat("]", 300) + `]}`,
	`{"stream":true,"x":"\"}"}`,
	`{"stream":true,}`,
	`{"stream":true`,
	`{"usage":{"prompt_tokens":5},"x":tru}`,
	`{"usage":{"prompt_tokens":5},"x":"\q"}`,
	` {"stream" : true } `,
	`[]`,
	``,
}

// TestScansMatchEncodingJSON: askUsage and readUsage decide as their
// encoding/json references on the seeds.
func TestScansMatchEncodingJSON(t *testing.T) {
	for _, s := range usageScanSeeds {
		checkScans(t, []byte(s))
	}
	if u, none, ok := readUsage([]byte(`{"choices":[],"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":7}}}`)); !ok || !none || u != (usage.Counts{Seen: true, Prompt: 10, Cached: 7}) {
		t.Fatalf("readUsage: %+v %v %v", u, none, ok)
	}
}

func checkScans(t *testing.T, data []byte) {
	t.Helper()
	gotB, gotOK := askUsage(data)
	wantB, wantOK := askUsageJSON(data)
	if gotOK != wantOK || !bytes.Equal(gotB, wantB) {
		t.Fatalf("askUsage(%q) = %q, %v; encoding/json: %q, %v", data, gotB, gotOK, wantB, wantOK)
	}
	u, none, ok := readUsage(data)
	wu, wnone, wok := readUsageJSON(data)
	if wok && (!ok || u != wu || none != wnone) {
		t.Fatalf("readUsage(%q) = %+v %v %v; encoding/json: %+v %v %v", data, u, none, ok, wu, wnone, wok)
	}
	// The scan checks structure, not every scalar: JSON it reads that
	// encoding/json refuses must at least have an object's shape.
	if !wok && ok && !jsonscan.Object(data, func(_, _ []byte) {}) {
		t.Fatalf("readUsage(%q) = %+v %v %v; encoding/json: %+v %v %v", data, u, none, ok, wu, wnone, wok)
	}
}

// FuzzUsageScans: the allocation-free scans decide as encoding/json on
// any input.
func FuzzUsageScans(f *testing.F) {
	for _, s := range usageScanSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(checkScans)
}

// BenchmarkUsageBodyLongEvent reads a stream whose one event is 1,000 KiB
// long (under the 1 MiB bound, so it is held back whole) in reads of 64 bytes.
func BenchmarkUsageBodyLongEvent(b *testing.B) {
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("x", 1000<<10) + "\"}}]}\n\ndata: [DONE]\n\n"
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		ub := &usageBody{rc: io.NopCloser(&trickle{s: stream, n: 64}), sse: true, strip: true}
		if n, err := io.Copy(io.Discard, ub); err != nil || n != int64(len(stream)) {
			b.Fatalf("%d bytes, %v", n, err)
		}
		ub.Close()
	}
}
