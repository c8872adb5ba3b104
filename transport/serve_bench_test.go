package transport

import (
	"bytes"
	"io"
	"net/http"
	"net/url"
	"testing"
)

// benchWriter is a ResponseWriter that keeps nothing, as net/http's would
// pass everything on.
type benchWriter struct{ h http.Header }

func (w *benchWriter) Header() http.Header         { return w.h }
func (w *benchWriter) WriteHeader(int)             {}
func (w *benchWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *benchWriter) FlushError() error           { return nil }

// BenchmarkServeHandler is the stream server's own work per request around
// its handler (bufferBody and the ack writer): the body read whole, the
// writer with its ack timer, a head with two header fields and a flushed
// body, at 32 goroutines.
func BenchmarkServeHandler(b *testing.B) {
	body := []byte(`{"model":"m1","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)
	u, _ := url.Parse("/v1/chat/completions")
	answer := []byte(`{"choices":[]}`)
	h := bufferBody(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n, _ := io.Copy(io.Discard, r.Body); n != int64(len(body)) {
			b.Errorf("handler read %d bytes", n)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Request-Id", "r1")
		w.WriteHeader(http.StatusOK)
		w.Write(answer)
		w.(http.Flusher).Flush()
	}))
	b.SetParallelism(16) // 32 goroutines on 2 cores
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		w := &benchWriter{h: make(http.Header)}
		rd := bytes.NewReader(body)
		rc := io.NopCloser(rd)
		r := &http.Request{Method: http.MethodPost, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: http.Header{}}
		for pb.Next() {
			clear(w.h)
			rd.Reset(body)
			r.Body, r.ContentLength = rc, int64(len(body))
			h.ServeHTTP(w, r)
		}
	})
}
