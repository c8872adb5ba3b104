package agent

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/computeflux/computeflux/transport"
)

// benchReply is the answer of the load tests' stub engine.
const benchReply = `{"id":"cmpl-1","object":"chat.completion","created":1,"model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`

// benchStream is a short stream with the usage chunk the agent asks for.
const benchStream = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hel\"}}]}\n\n" +
	"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\n" +
	"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"total_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n" +
	"data: [DONE]\n\n"

// rawEngine is an HTTP/1.1 engine stub over a bare TCP listener that
// answers at once with canned bytes: it allocates next to nothing, so a
// benchmark's allocations are the agent's own.
type rawEngine struct {
	ln net.Listener
	wg sync.WaitGroup

	mu    sync.Mutex // guards conns
	conns []net.Conn
}

func newRawEngine(tb testing.TB) *rawEngine {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	e := &rawEngine{ln: ln}
	plain := []byte("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(benchReply)) + "\r\n\r\n" + benchReply)
	sse := []byte("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
		strconv.FormatInt(int64(len(benchStream)), 16) + "\r\n" + benchStream + "\r\n0\r\n\r\n")
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.mu.Lock()
			e.conns = append(e.conns, c)
			e.mu.Unlock()
			e.wg.Add(1)
			go func() {
				defer e.wg.Done()
				e.serve(c, plain, sse)
			}()
		}
	}()
	tb.Cleanup(e.close)
	return e
}

func (e *rawEngine) serve(c net.Conn, plain, sse []byte) {
	defer c.Close()
	br := bufio.NewReader(c)
	body := make([]byte, 64<<10)
	for {
		n := 0
		for {
			line, err := br.ReadSlice('\n')
			if err != nil {
				return
			}
			if len(line) <= 2 {
				break
			}
			if k, v, ok := bytes.Cut(line, []byte(":")); ok && strings.EqualFold(string(k), "Content-Length") {
				n, _ = strconv.Atoi(string(bytes.TrimSpace(v)))
			}
		}
		if n > len(body) {
			body = make([]byte, n)
		}
		if _, err := io.ReadFull(br, body[:n]); err != nil {
			return
		}
		out := plain
		if bytes.Contains(body[:n], []byte(`"stream":true`)) {
			out = sse
		}
		if _, err := c.Write(out); err != nil {
			return
		}
	}
}

func (e *rawEngine) close() {
	e.ln.Close()
	e.mu.Lock()
	for _, c := range e.conns {
		c.Close()
	}
	e.mu.Unlock()
	e.wg.Wait()
}

// discardWriter is a ResponseWriter that keeps only the status, as the
// stream server's writer would pass everything on.
type discardWriter struct {
	h    http.Header
	code int
	n    int
}

func (w *discardWriter) Header() http.Header { return w.h }
func (w *discardWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}
func (w *discardWriter) Write(p []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	w.n += len(p)
	return len(p), nil
}
func (w *discardWriter) Flush() {}

// benchCases are BenchmarkServeHTTP's requests, with the Content-Type the
// answer must have. "small" and "stream" have a prompt shorter than a
// prefix block: the index hashes nothing, and the small answer passes
// unwrapped. "chat" has a system prompt of a few blocks, as a client's chat
// request does: its prompt is indexed and its answer's usage read.
var benchCases = []struct{ name, body, want string }{
	{"small", `{"model":"m1","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`, ""},
	{"stream", `{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}`, "text/event-stream"},
	{"chat", `{"model":"m1","messages":[{"role":"system","content":"` +
		strings.Repeat("You are a careful assistant who answers in plain words. ", 24) +
		`"},{"role":"user","content":"hi"}],"max_tokens":4}`, ""},
}

// BenchmarkServeHTTP runs the agent's handler against an engine on
// loopback, the request handed over as transport.ServeHTTP does (body in
// memory, given to ServeHTTPBody), at 32 goroutines: allocations per
// request are the agent's (the stub allocates none per request).
// BenchmarkServeHTTPFloor is the same load through a bare forwarder.
func BenchmarkServeHTTP(b *testing.B) {
	for _, bc := range benchCases {
		b.Run(bc.name, func(b *testing.B) {
			eng := newRawEngine(b)
			a, err := New(Config{
				Relay: "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWDkftGHFMSNsFYC5NV8WDxAcwH1EWPBBSUhuk5FzmHpdu",
				Token: "t", Upstream: "http://" + eng.ln.Addr().String(), Name: "a",
				Index: IndexConfig{KVCapacityTokens: 1 << 20},
			})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				if c, ok := a.cfg.UpstreamTransport.(interface{ CloseIdleConnections() }); ok {
					c.CloseIdleConnections()
				}
			})
			benchServe(b, bc.body, bc.want, a.ServeHTTPBody) // as transport.ServeHTTP calls it
		})
	}
}

// BenchmarkServeHTTPFloor is BenchmarkServeHTTP's load through the
// smallest forwarder of the same parts: the request sent on as it came
// with transport.NewHTTP1RoundTripper, the answer copied back with a
// pooled buffer, flushed per write when its length is unknown. No paths,
// headers, index, usage or errors of the agent's: what BenchmarkServeHTTP
// costs above it is the agent's own work.
func BenchmarkServeHTTPFloor(b *testing.B) {
	for _, bc := range benchCases {
		b.Run(bc.name, func(b *testing.B) {
			eng := newRawEngine(b)
			rt := transport.NewHTTP1RoundTripper(nil)
			b.Cleanup(rt.(interface{ CloseIdleConnections() }).CloseIdleConnections)
			upstream, _ := url.Parse("http://" + eng.ln.Addr().String() + "/v1/chat/completions")
			benchServe(b, bc.body, bc.want, func(w http.ResponseWriter, r *http.Request, _ []byte) {
				out := (&http.Request{
					Method: r.Method, URL: upstream, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
					Header: r.Header, Body: r.Body, ContentLength: r.ContentLength, Host: upstream.Host,
				}).WithContext(r.Context())
				res, err := rt.RoundTrip(out)
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				for k, vv := range res.Header {
					w.Header()[k] = vv
				}
				w.WriteHeader(res.StatusCode)
				buf := copyBuffers.get()
				defer copyBuffers.put(buf)
				for {
					n, err := res.Body.Read(*buf)
					if n > 0 {
						w.Write((*buf)[:n])
						if res.ContentLength < 0 {
							flushResponse(w)
						}
					}
					if err != nil {
						break
					}
				}
				res.Body.Close()
			})
		})
	}
}

// benchServe runs serve over requests of body at 32 goroutines; each answer
// must be a 200 with a body and the Content-Type want (if any).
func benchServe(b *testing.B, body, want string, serve func(http.ResponseWriter, *http.Request, []byte)) {
	u, _ := url.Parse("/v1/chat/completions")
	in := []byte(body)
	b.SetParallelism(16) // 32 goroutines on 2 cores
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		w := &discardWriter{h: make(http.Header)}
		for pb.Next() {
			clear(w.h)
			w.code, w.n = 0, 0
			r := &http.Request{
				Method: http.MethodPost, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
				Header:        http.Header{"Content-Type": {"application/json"}},
				Body:          io.NopCloser(bytes.NewReader(in)),
				ContentLength: int64(len(in)),
				Host:          "relay", RemoteAddr: "relay:1", RequestURI: u.Path,
			}
			serve(w, r, in)
			if w.code != http.StatusOK || w.n == 0 || (want != "" && w.h.Get("Content-Type") != want) {
				b.Errorf("status %d, %d bytes, %v", w.code, w.n, w.h)
				return
			}
		}
	})
}
