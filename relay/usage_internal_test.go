package relay

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/internal/threadcpu"
	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/transport"
	"github.com/computeflux/computeflux/transport/usage"
)

func TestScanTail(t *testing.T) {
	for _, tc := range []struct {
		name string
		body string
		want tokenUsage
	}{
		{"chat", `{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19,"prompt_tokens_details":{"cached_tokens":8}}}`,
			tokenUsage{usage.Counts{Seen: true, Prompt: 12, Cached: 8, Completion: 7}}},
		{"keys after usage", `{"usage": {"prompt_tokens": 3, "completion_tokens": 4} , "kv_transfer_params": null}`,
			tokenUsage{usage.Counts{Seen: true, Prompt: 3, Completion: 4}}},
		{"embeddings", `{"data":[],"usage":{"prompt_tokens":5,"total_tokens":5}}`,
			tokenUsage{usage.Counts{Seen: true, Prompt: 5}}},
		{"responses", `{"object":"response","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":4},"output_tokens":2}}`,
			tokenUsage{usage.Counts{Seen: true, Prompt: 9, Cached: 4, Completion: 2}}},
		{"quoted in content", `{"choices":[{"message":{"content":"say \"usage\": {\"prompt_tokens\": 99}"}}],"usage":{"prompt_tokens":1,"completion_tokens":2}}`,
			tokenUsage{usage.Counts{Seen: true, Prompt: 1, Completion: 2}}},
		{"only quoted", `{"choices":[{"message":{"content":"\"usage\":{\"prompt_tokens\":99}"}}]}`, tokenUsage{}},
		{"null", `{"choices":[],"usage":null}`, tokenUsage{}},
		{"none", `{"choices":[]}`, tokenUsage{}},
		{"negative", `{"usage":{"prompt_tokens":-3,"completion_tokens":2}}`, tokenUsage{usage.Counts{Seen: true, Completion: 2}}},
		{"truncated", `{"usage":{"prompt_tokens":3,"completion_tok`, tokenUsage{}},
		{"string count", `{"usage":{"prompt_tokens":"3"}}`, tokenUsage{}},
		{"long answer", `{"choices":[{"message":{"content":"` + strings.Repeat("long ", 20000) + `"}}],"usage":{"prompt_tokens":7,"completion_tokens":20000}}`,
			tokenUsage{usage.Counts{Seen: true, Prompt: 7, Completion: 20000}}},
		{"usage far from the end", `{"usage":{"prompt_tokens":7},"tail":"` + strings.Repeat("x", usageTail) + `"}`, tokenUsage{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var u tokenUsage
			u.scanTail([]byte(tc.body))
			if u != tc.want {
				t.Fatalf("got %+v, want %+v", u, tc.want)
			}
		})
	}
}

// A stream's usage chunk is read; it is dropped only when the agent says
// the client did not ask for it.
func TestFramerUsage(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n" +
		"data: [DONE]\n\n"
	want := tokenUsage{usage.Counts{Seen: true, Prompt: 20, Cached: 16, Completion: 3}}
	for _, drop := range []bool{false, true} {
		f := &sseFramer{dropUsage: drop}
		out, err := f.feed(nil, []byte(stream))
		if err != nil {
			t.Fatal(err)
		}
		if f.usage != want {
			t.Errorf("drop=%v: usage %+v, want %+v", drop, f.usage, want)
		}
		if got := strings.Contains(string(out), "prompt_tokens"); got == drop {
			t.Errorf("drop=%v: usage chunk passed on: %v\n%s", drop, got, out)
		}
		if want := map[bool]int64{false: 2, true: 1}[drop]; f.chunks != want {
			t.Errorf("drop=%v: %d chunks counted, want %d", drop, f.chunks, want)
		}
		if !strings.HasSuffix(string(out), "data: [DONE]\n\n") {
			t.Errorf("drop=%v: stream lost its end:\n%s", drop, out)
		}
	}
}

func TestScanTailAllocs(t *testing.T) {
	body := []byte(`{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":8}}}`)
	if n := testing.AllocsPerRun(100, func() {
		var u tokenUsage
		u.scanTail(body)
	}); n != 0 {
		t.Fatalf("scanTail allocates %v times", n)
	}
}

// A Responses stream's last event carries its usage inside the response:
// it is read, and passed on even when the agent added a usage chunk.
func TestFramerKeepsResponsesUsage(t *testing.T) {
	ev := "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":2}}}\n\n"
	f := &sseFramer{dropUsage: true}
	out, err := f.feed(nil, []byte(ev))
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != ev {
		t.Fatalf("passed on %q, want the event as it was", out)
	}
	if want := (tokenUsage{usage.Counts{Seen: true, Prompt: 9, Completion: 2}}); f.usage != want {
		t.Fatalf("usage %+v, want %+v", f.usage, want)
	}
}

// BenchmarkRecordUsage is what the request path adds for the ledger once a
// request finished: reading the usage at the end of a non-streamed answer
// (scan) and recording it (record).
//
//	go test ./relay -run '^$' -bench RecordUsage -benchmem -count 5
func BenchmarkRecordUsage(b *testing.B) {
	l, err := ledger.Open(ledger.Config{Path: filepath.Join(b.TempDir(), "usage.db")})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	r, err := New(Config{NoP2P: true, NoAuth: true, Transport: http.DefaultTransport, Ledger: l})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	answer := []byte(`{"id":"chatcmpl-1","object":"chat.completion","model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"` +
		strings.Repeat("word ", 200) + `"},"finish_reason":"stop"}],"usage":{"prompt_tokens":120,"completion_tokens":200,"total_tokens":320,"prompt_tokens_details":{"cached_tokens":96}}}`)
	p := &proxied{body: []byte(`{"model":"m1","messages":[{"role":"user","content":"hi"}]}`),
		rl: reqLog{model: "m1", agent: "agent-1", status: 200, answered: true}}
	now := time.Now()
	b.Run("scan", func(b *testing.B) {
		b.ReportAllocs()
		threadcpu.Measure(b, func() {
			for b.Loop() {
				p.rl.usage = tokenUsage{}
				p.rl.usage.scanTail(answer)
			}
		})
	})
	b.Run("record", func(b *testing.B) {
		b.ReportAllocs()
		threadcpu.Measure(b, func() {
			for b.Loop() {
				r.recordUsage(p, now)
			}
		})
	})
}

// cannedRT answers every request with the same JSON body.
type cannedRT []byte

func (c cannedRT) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
	}
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}},
		Body: io.NopCloser(bytes.NewReader(c)), ContentLength: int64(len(c)), Request: req}, nil
}

// BenchmarkRequestPathLedger times the relay's whole request path (to an
// in-memory endpoint) without and with the usage ledger, side by side:
// what recording adds per request, allocations included.
//
//	go test ./relay -run '^$' -bench RequestPathLedger -benchmem -count 5
func BenchmarkRequestPathLedger(b *testing.B) {
	answer := cannedRT(`{"id":"c","object":"chat.completion","model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}}}`)
	body := []byte(`{"model":"m1","messages":[{"role":"user","content":"hi"}]}`)
	for _, on := range []bool{false, true} {
		b.Run(map[bool]string{false: "off", true: "on"}[on], func(b *testing.B) {
			cfg := Config{NoP2P: true, APIKeys: []string{testKey}, Transport: answer, Logger: zerolog.New(io.Discard)}
			if on {
				l, err := ledger.Open(ledger.Config{Path: filepath.Join(b.TempDir(), "usage.db")})
				if err != nil {
					b.Fatal(err)
				}
				defer l.Close()
				cfg.Ledger = l
			}
			r, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			_ = r.Registry().Joined(peer.ID("fake-peer-0"), transport.JoinInfo{Name: "a", Models: []string{"m1"}})
			h := r.Handler()
			req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
			req.Header.Set("Authorization", "Bearer "+testKey)
			req.Header.Set("Content-Type", "application/json")
			rd := bytes.NewReader(body)
			b.ReportAllocs()
			for b.Loop() {
				rd.Reset(body)
				req.Body = io.NopCloser(rd)
				w := httptest.NewRecorder()
				h.ServeHTTP(w, req)
				if w.Code != http.StatusOK {
					b.Fatalf("status %d: %s", w.Code, w.Body)
				}
			}
		})
	}
}

// TestTokenMetrics: every finished request's tokens, as its answer's usage
// says, count for its client and for the agent that served it, without a
// ledger; an agent's series go when it leaves.
func TestTokenMetrics(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, nil)
	for i := range 4 {
		if st, _, body := tb.chat(fmt.Sprintf("s%d", i)); st != http.StatusOK {
			t.Fatalf("chat: %d %s", st, body)
		}
	}
	client := keyClientName(sha256.Sum256([]byte(testKey)))
	// The fake engine's answers say 3 prompt and 3 completion tokens.
	if got := metricValue(t, tb, `computeflux_client_tokens_total{client="`+client+`",kind="prompt"}`); got != 12 {
		t.Fatalf("client prompt tokens %v, want 12", got)
	}
	if got := metricValue(t, tb, `computeflux_endpoint_tokens_total{endpoint="a",kind="completion"}`); got != 12 {
		t.Fatalf("agent a's completion tokens %v, want 12", got)
	}
	tb.relay.forgetAgent("a")
	if got := metricValue(t, tb, `computeflux_endpoint_tokens_total{endpoint="a",kind="completion"}`); got != 0 {
		t.Fatalf("agent a's series outlived it: %v", got)
	}
}
