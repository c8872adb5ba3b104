package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httputil"
	"reflect"
	"strconv"
	"sync"
)

// servedPaths are the OpenAI endpoints forwarded to the engine, with their
// method. Nothing else is: the agent is not a proxy into the home network.
var servedPaths = map[string]string{
	"/v1/chat/completions": http.MethodPost,
	"/v1/completions":      http.MethodPost,
	"/v1/embeddings":       http.MethodPost,
	"/v1/models":           http.MethodGet,
}

// bufferedBodyType is the type of the request bodies transport.ServeHTTP
// hands its handler: an io.NopCloser over a bytes.Reader.
var bufferedBodyType = reflect.TypeOf(io.NopCloser(bytes.NewReader(nil)))

// copyBuffers are ReverseProxy's response copy buffers, shared by all
// agents of the process.
var copyBuffers = &bufferPool{}

// bufferPool is an httputil.BufferPool over a sync.Pool of 32 KiB buffers
// (ReverseProxy's own size).
type bufferPool struct{ p sync.Pool }

// get returns a 32 KiB buffer.
func (b *bufferPool) get() *[]byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return v
	}
	buf := make([]byte, 32<<10)
	return &buf
}

// put returns a buffer from get.
func (b *bufferPool) put(buf *[]byte) { b.p.Put(buf) }

// Get returns a 32 KiB buffer.
func (b *bufferPool) Get() []byte { return *b.get() }

// Put returns a buffer from Get.
func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }

func (a *Agent) newProxy() http.Handler {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(a.upstream)
			pr.Out.URL.RawQuery = ""
			a.authorize(pr.Out.Header)
			if pr.In.ContentLength > 0 && reflect.TypeOf(pr.In.Body) == bufferedBodyType {
				// ReverseProxy hides the body behind its own no-op Close
				// wrapper, so net/http no longer sees that it is in
				// memory and writes the request head and the body to the
				// engine in two writes. The body buffered by
				// transport.ServeHTTP has a no-op Close already: pass it
				// as it is, and the request goes out in one.
				pr.Out.Body = pr.In.Body
			}
		},
		Transport: a.cfg.UpstreamTransport,
		// Without a pool, ReverseProxy allocates a 32 KiB copy buffer per
		// request: under load that was most of the agent's allocation and
		// its GC most of the agent's CPU beyond the network itself.
		BufferPool: copyBuffers,
		ModifyResponse: func(resp *http.Response) error {
			st, _ := resp.Request.Context().Value(servedKey{}).(*servedReq)
			a.observeResponse(resp, st) // prefix index (usage.go)
			return nil
		},
		// Server-sent events are flushed per write by ReverseProxy itself
		// (it recognises text/event-stream and unknown lengths).
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, context.Canceled) || r.Context().Err() != nil {
				// The relay went away; nobody reads an answer.
				return
			}
			a.log.Warn().Err(err).Str("path", r.URL.Path).Msg("engine request failed")
			a.kickRefresh() // is the engine down? then drain until it answers
			writeError(w, http.StatusBadGateway, "engine_unreachable", "the agent could not reach its engine")
		},
	}
}

// ServeHTTP serves the relay's requests: the OpenAI endpoints listed in
// servedPaths go to the engine with the upstream API key; anything else is
// 404. It is the handler given to transport.ServeHTTP.
func (a *Agent) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	method, ok := servedPaths[r.URL.Path]
	if !ok {
		method, ok = a.optionalRoute(r.URL.Path, r.Method) // engine.go
	}
	if !ok || r.URL.RawPath != "" {
		writeError(w, http.StatusNotFound, "not_found", "this agent serves only the OpenAI inference endpoints")
		return
	}
	if r.Method != method {
		w.Header().Set("Allow", method)
		writeError(w, http.StatusMethodNotAllowed, "method_not_allowed", "use "+method)
		return
	}
	if a.draining.Load() {
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "draining", "this agent is shutting down")
		return
	}
	n := a.inflight.Add(1)
	defer a.inflight.Add(-1)
	if max := a.cfg.MaxConcurrency; max > 0 && n > int64(max) {
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusTooManyRequests, "agent_busy", "this agent is at its concurrency limit of "+strconv.Itoa(max))
		return
	}
	if method == http.MethodPost && r.URL.Path != "/v1/embeddings" {
		r = a.indexRequest(r) // prefix index (usage.go)
	}
	a.proxy.ServeHTTP(w, r)
}

// writeError answers in OpenAI's error shape.
func writeError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(map[string]any{
		"error": map[string]any{"message": msg, "type": "agent_error", "code": code},
	})
}
