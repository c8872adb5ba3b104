package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
	"sync"

	"github.com/computeflux/computeflux/transport"
)

// servedPaths are the OpenAI endpoints forwarded to the engine, with their
// method. Nothing else is: the agent is not a proxy into the home network.
var servedPaths = map[string]string{
	"/v1/chat/completions": http.MethodPost,
	"/v1/completions":      http.MethodPost,
	"/v1/embeddings":       http.MethodPost,
	"/v1/models":           http.MethodGet,
}

// copyBuffers are the answer copy buffers, shared by all agents of the
// process.
var copyBuffers = &bufferPool{}

// bufferPool is a sync.Pool of 32 KiB buffers (httputil.ReverseProxy's
// size). Without it the agent allocated a 32 KiB buffer per request: under
// load that was most of its allocation and its GC most of its CPU beyond
// the network itself.
type bufferPool struct{ p sync.Pool }

// copyBufferSize is the size of copyBuffers' buffers.
const copyBufferSize = 32 << 10

// get returns a 32 KiB buffer.
func (b *bufferPool) get() *[]byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return v
	}
	buf := make([]byte, copyBufferSize)
	return &buf
}

// put returns a buffer from get.
func (b *bufferPool) put(buf *[]byte) { b.p.Put(buf) }

// The forwarder is written here rather than taken from
// httputil.ReverseProxy, which served until the per-request cost of the
// relay path was measured (BenchmarkServeHTTP, pprof): the agent forwards
// only the few endpoints of servedPaths to one engine, with a body already
// in memory, so most of ReverseProxy's generality was cost on every
// request: cloning the request and its header, a client trace and its
// closures for 1xx answers, a second context, MIME parsing of every
// Content-Type to decide on flushing, wrapping the body. About a third of
// the agent's allocations per request went there. What the agent needs of
// it is kept, and tested by the agent's tests: hop-by-hop headers dropped
// both ways (RFC 9110 7.6.1, and those the Connection header names),
// X-Forwarded-*/Forwarded not passed (as ReverseProxy with Rewrite),
// server-sent events flushed per write, the request context reaching the
// engine (cancellation), an engine error as 502 engine_unreachable, and a
// copy that fails after the head went out aborting the answer
// (http.ErrAbortHandler) rather than ending it as if complete. Left out:
// protocol upgrades (no servedPath needs one) and passing on an engine's
// informational (1xx) answers, which needed a client trace per request and
// which the relay ignores anyway (it reads only the stream server's own
// acknowledgement, transport.WithAck). The connection pooling itself stays
// in the round tripper (Config.UpstreamTransport).

// forward sends r to the engine and copies its answer to w; st is the
// request's prefix state (nil when not indexed).
func (a *Agent) forward(w http.ResponseWriter, r *http.Request, st *servedReq, unknownAPI bool) {
	ctx := r.Context()
	out := (&http.Request{
		Method:     r.Method,
		URL:        a.upstreamURL(r.URL.Path),
		Proto:      "HTTP/1.1",
		ProtoMajor: 1,
		ProtoMinor: 1,
		Header:     a.outHeader(r.Header),
		Host:       a.upstream.Host,
	}).WithContext(ctx)
	if r.ContentLength != 0 && r.Body != nil && r.Body != http.NoBody {
		out.Body, out.ContentLength = r.Body, r.ContentLength
	}
	res, err := a.cfg.UpstreamTransport.RoundTrip(out)
	if err == nil && res.StatusCode == http.StatusSwitchingProtocols {
		// No Upgrade header is forwarded, so the engine has no business
		// switching protocols.
		res.Body.Close()
		err = errors.New("agent: engine switched protocols unasked")
	}
	if err != nil {
		if errors.Is(err, context.Canceled) || ctx.Err() != nil {
			return // the relay went away; nobody reads an answer
		}
		a.log.Warn().Err(err).Str("path", r.URL.Path).Msg("engine request failed")
		a.kickRefresh() // is the engine down? then drain until it answers
		writeError(w, http.StatusBadGateway, "engine_unreachable", "the agent could not reach its engine")
		return
	}
	if unknownAPI {
		a.settleAPI(w, r.URL.Path, res) // engine.go
	}
	sse := isEventStream(res.Header.Get("Content-Type"))
	a.observeResponse(res, st, sse) // prefix index (usage.go)
	transport.RemoveHopHeaders(res.Header)
	h := w.Header()
	for k, vv := range res.Header {
		if old := h[k]; old != nil {
			h[k] = append(old, vv...)
		} else {
			h[k] = vv // res.Header is ours: share its values
		}
	}
	// Server-sent events, and any answer of unknown length, are flushed
	// per write (ReverseProxy's rule, without its MIME parse).
	flush := res.ContentLength == -1 || sse
	w.WriteHeader(res.StatusCode)
	if flush {
		flushResponse(w)
	}
	err = copyAnswer(w, res.Body, flush)
	res.Body.Close()
	if err != nil {
		if r.Context().Value(http.ServerContextKey) != nil {
			// Abort the answer, so the relay sees it cut short.
			panic(http.ErrAbortHandler)
		}
		return
	}
	for k, vv := range res.Trailer {
		h[http.TrailerPrefix+k] = vv
	}
}

// copyAnswer copies the engine's answer to w, flushing after every write
// when flush is set. It returns the first read (other than io.EOF) or
// write error.
func copyAnswer(w http.ResponseWriter, body io.Reader, flush bool) error {
	buf := copyBuffers.get()
	defer copyBuffers.put(buf)
	for {
		n, rerr := body.Read(*buf)
		if n > 0 {
			if _, werr := w.Write((*buf)[:n]); werr != nil {
				return werr
			}
			if flush {
				flushResponse(w)
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}

// flushResponse flushes w if it can.
func flushResponse(w http.ResponseWriter) {
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
		return
	}
	_ = http.NewResponseController(w).Flush()
}

// emptyUserAgent keeps net/http from sending its own User-Agent when the
// request had none.
var emptyUserAgent = []string{""}

// outHeader turns h, the relay's request header, into the header for the
// engine, in place: without hop-by-hop headers, forwarding headers,
// credentials and Content-Length (the request's ContentLength is sent, and
// a rewritten body has another), with the engine's key. It used to build a
// new map per request; the relay's request is the agent's own, and net/http
// lets a handler change its request's header (it reads what it needs of it
// before the handler runs).
func (a *Agent) outHeader(h http.Header) http.Header {
	te := false
	for _, v := range h["Te"] {
		if strings.EqualFold(textproto.TrimString(v), "trailers") {
			te = true // as ReverseProxy: the one Te that passes
			break
		}
	}
	transport.RemoveConnectionNamed(h)
	for k := range h {
		switch {
		case transport.HopHeader(k), k == "Authorization", k == "Forwarded",
			k == "X-Forwarded-For", k == "X-Forwarded-Host", k == "X-Forwarded-Proto",
			k == "Content-Length": // the request's field is what is sent
			delete(h, k)
		}
	}
	if te {
		h["Te"] = teTrailers
	}
	if a.authValue != nil {
		h["Authorization"] = a.authValue
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = emptyUserAgent
	}
	return h
}

var teTrailers = []string{"trailers"}

// upstreamURL returns the engine's URL for path (the upstream URL's path
// joined with it, without query), from a table for servedPaths and
// optionalAPIs. The returned URL is shared and must not be changed.
func (a *Agent) upstreamURL(path string) *url.URL {
	if u, ok := a.urls[path]; ok {
		return u
	}
	return joinUpstream(a.upstream, path)
}

// joinUpstream returns upstream with path appended to its path, as
// httputil.ProxyRequest.SetURL joins them (path has no escapes of its own:
// ServeHTTP refuses a RawPath).
func joinUpstream(upstream *url.URL, path string) *url.URL {
	u := *upstream
	u.RawQuery, u.Fragment, u.RawFragment, u.User = "", "", "", nil
	u.Path = singleJoiningSlash(upstream.Path, path)
	if upstream.RawPath != "" {
		u.RawPath = singleJoiningSlash(upstream.EscapedPath(), (&url.URL{Path: path}).EscapedPath())
	}
	return &u
}

// singleJoiningSlash joins a and b with one slash between them
// (httputil's rule).
func singleJoiningSlash(a, b string) string {
	aslash, bslash := strings.HasSuffix(a, "/"), strings.HasPrefix(b, "/")
	switch {
	case aslash && bslash:
		return a + b[1:]
	case !aslash && !bslash:
		return a + "/" + b
	}
	return a + b
}

// ServeHTTP serves the relay's requests: the OpenAI endpoints listed in
// servedPaths go to the engine with the upstream API key; anything else is
// 404. The agent is the handler given to transport.ServeHTTP, which calls
// ServeHTTPBody.
func (a *Agent) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.serve(w, r, nil)
}

// ServeHTTPBody is ServeHTTP for a request whose body the stream server
// read already (transport.BodyHandler): the prompt is hashed from body
// rather than from a copy of it.
func (a *Agent) ServeHTTPBody(w http.ResponseWriter, r *http.Request, body []byte) {
	if body == nil {
		body = []byte{} // read already, and empty
	}
	a.serve(w, r, body)
}

// serve serves r; body is its body when read already (non-nil), else nil.
func (a *Agent) serve(w http.ResponseWriter, r *http.Request, body []byte) {
	method, ok := servedPaths[r.URL.Path]
	unknownAPI := false
	if !ok {
		method, unknownAPI, ok = a.optionalRoute(r.URL.Path, r.Method) // engine.go
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
	flow := r.Header.Get(transport.HeaderFlow)
	r.Header.Del(transport.HeaderFlow)
	if method == http.MethodPost {
		release, err := a.gate.enter(r.Context(), transport.ParseFlow(flow))
		if err != nil {
			if r.Context().Err() == nil {
				gateError(w, err)
			}
			return
		}
		defer release()
	}
	var st *servedReq
	if method == http.MethodPost && r.URL.Path != "/v1/embeddings" {
		st = a.indexRequest(r, body) // prefix index (usage.go)
	}
	a.forward(w, r, st, unknownAPI)
}

// writeError answers in OpenAI's error shape.
func writeError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(map[string]any{
		"error": map[string]any{"message": msg, "type": "agent_error", "code": code},
	})
}
