package transport

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// ackRequest sends one request to srv's handler and reports whether the
// AckStatus came before the response, with the response's body.
func ackRequest(t *testing.T, client *http.Client, url string) (acked bool, body string) {
	t.Helper()
	acked, body, _ = ackRequestHeader(t, client, url)
	return acked, body
}

// ackRequestHeader is ackRequest that also returns the response's header.
func ackRequestHeader(t *testing.T, client *http.Client, url string) (acked bool, body string, h http.Header) {
	t.Helper()
	var got atomic.Bool
	ctx := ackTrace(context.Background(), &got)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"a":1}`))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return got.Load(), string(b), resp.Header
}

// ackTrace returns a context on which an AckStatus sets got.
func ackTrace(ctx context.Context, got *atomic.Bool) context.Context {
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
			if code == AckStatus {
				got.Store(true)
			}
			return nil
		},
	})
}

// TestWithAck: onSent comes once the request is written, then onAck with
// the answer's first byte, an AckStatus or the response itself.
func TestWithAck(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			time.Sleep(5 * AckDelay)
		}
		io.WriteString(w, "answer")
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	for _, path := range []string{"/fast", "/slow"} {
		var sent, acked atomic.Int32
		ctx := WithAck(context.Background(), func() { sent.Add(1) }, func() {
			if sent.Load() == 0 {
				t.Errorf("%s: acknowledged before the request was sent", path)
			}
			acked.Add(1)
		})
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+srv.ID().String()+path, strings.NewReader("x"))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if sent.Load() != 1 || acked.Load() == 0 {
			t.Errorf("%s: sent reported %d times, acknowledged %d", path, sent.Load(), acked.Load())
		}
	}
}

func TestAckOnlyForSlowAnswers(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			time.Sleep(5 * AckDelay)
		}
		w.Header().Set("Content-Type", "text/plain")
		io.WriteString(w, "answer "+r.URL.Path)
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	base := "http://" + srv.ID().String()

	// A handler that answers within AckDelay sends no ack: the response
	// head is the acknowledgement. Its timer is stopped with the head, so
	// no ack can trail the answer into the next request on the stream.
	fast := 0
	for i := 0; i < 20; i++ {
		acked, body := ackRequest(t, client, base+"/fast")
		if body != "answer /fast" {
			t.Fatalf("body %q", body)
		}
		if !acked {
			fast++
		}
	}
	// The machine may stall some requests past AckDelay; not most of them.
	if fast < 10 {
		t.Fatalf("only %d of 20 immediate answers came without an ack", fast)
	}
	// A slow handler's request is acknowledged before its answer.
	for i := 0; i < 3; i++ {
		acked, body := ackRequest(t, client, base+"/slow")
		if !acked || body != "answer /slow" {
			t.Fatalf("slow request: acked %v, body %q", acked, body)
		}
	}
}

// TestAckWhileHandlerSetsHeaders runs the ack's timer against a handler that
// is filling its header map and writing when it fires (run with -race).
func TestAckWhileHandlerSetsHeaders(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		deadline := time.Now().Add(3 * AckDelay)
		for i := 0; time.Now().Before(deadline); i++ {
			w.Header().Set("X-Count", strings.Repeat("x", i%7+1))
			w.Header().Add("X-List", "v")
			w.Header().Del("X-List")
		}
		w.Header().Set("X-Done", "1")
		w.WriteHeader(http.StatusAccepted)
		io.WriteString(w, "done")
		w.(http.Flusher).Flush()
		w.Header().Set("X-After", "ignored") // after the head: not sent
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	for i := 0; i < 3; i++ {
		var got atomic.Bool
		ctx := ackTrace(context.Background(), &got)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+srv.ID().String()+"/h", strings.NewReader("x"))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted || string(b) != "done" || resp.Header.Get("X-Done") != "1" || resp.Header.Get("X-After") != "" {
			t.Fatalf("got %d %q %v", resp.StatusCode, b, resp.Header)
		}
		if !got.Load() {
			t.Fatal("no ack before a head written after 3 AckDelays")
		}
	}
}

// TestHandlerInformationalPassesThrough checks that a handler's own 1xx
// (an engine's 103 Early Hints passed on) carries its header, and that the
// header does not leak into the final answer.
func TestHandlerInformationalPassesThrough(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		io.WriteString(w, "ok")
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	var hints []string
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			hints = append(hints, fmt.Sprintf("%d %s", code, h.Get("Link")))
			return nil
		},
	})
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+srv.ID().String()+"/x", nil)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "ok" || resp.Header.Get("Link") != "" {
		t.Fatalf("answer %q, header %v", b, resp.Header)
	}
	if len(hints) != 1 || hints[0] != "103 </style.css>; rel=preload" {
		t.Fatalf("informational answers %q", hints)
	}
}

// TestReadBodyTrustsNoDeclaredLength: a peer announcing a body near the
// limit holds memory only for the bytes it sent.
func TestReadBodyTrustsNoDeclaredLength(t *testing.T) {
	const declared, sent = 60 << 20, 10
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(strings.Repeat("x", sent)))
	r.ContentLength = declared
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b, _ := readBody(httptest.NewRecorder(), r)
	runtime.ReadMemStats(&after)
	if len(b) != sent {
		t.Fatalf("read %d bytes, want %d", len(b), sent)
	}
	// The process's measure, other goroutines included: far below the
	// declared length, not tight.
	if got := after.TotalAlloc - before.TotalAlloc; got > 8<<20 {
		t.Errorf("allocated %d bytes for a %d-byte body announced as %d", got, sent, declared)
	}
}

// TestAckWritersReused alternates slow and fast requests on one stream, so
// that writers come back from the pool after an ack and after a stopped
// timer: a fast answer still gets no ack, and no header of an earlier
// request reaches a later one.
func TestAckWritersReused(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			w.Header().Set("X-Slow", "1")
			time.Sleep(3 * AckDelay)
		}
		io.WriteString(w, "answer "+r.URL.Path)
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	base := "http://" + srv.ID().String()
	fastAcked := 0
	for i := 0; i < 8; i++ {
		for _, path := range []string{"/slow", "/fast", "/fast"} {
			acked, body, h := ackRequestHeader(t, client, base+path)
			if body != "answer "+path {
				t.Fatalf("%s: body %q", path, body)
			}
			slowHeader := h.Get("X-Slow") != ""
			switch {
			case path == "/slow" && (!acked || !slowHeader):
				t.Fatalf("slow request: acked %v, header %v", acked, h)
			case path == "/fast" && slowHeader:
				t.Fatalf("a fast answer carries an earlier request's header: %v", h)
			case path == "/fast" && acked:
				fastAcked++
			}
		}
	}
	// The machine may stall a request past AckDelay; not most of them.
	if fastAcked > 8 {
		t.Fatalf("%d of 16 immediate answers came with an ack", fastAcked)
	}
}

// TestAckWriterHeaderSemantics: the stream server's writer keeps net/http's
// header rules although the handler fills a map of its own until its head:
// a header set by a handler that returns without writing is sent (with the
// implicit 200), and trailers set after the head through the map Header
// returned before it (a handler that kept it, as net/http allows: its map
// is the same throughout) are sent too, whether the ack went out or not.
func TestAckWriterHeaderSemantics(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("slow") != "" {
			time.Sleep(3 * AckDelay)
		}
		h := w.Header()
		switch r.URL.Path {
		case "/unwritten":
			h.Set("X-Set", "1")
		case "/trailer":
			h.Set("Trailer", "X-Declared")
			w.WriteHeader(http.StatusOK)
			io.WriteString(w, "body")
			w.(http.Flusher).Flush()
			h.Set("X-Declared", "d")
			h.Set(http.TrailerPrefix+"X-Undeclared", "u")
		}
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	base := "http://" + srv.ID().String()
	for _, slow := range []string{"", "?slow=1"} {
		resp, err := client.Get(base + "/unwritten" + slow)
		if err != nil {
			t.Fatal(err)
		}
		io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Set") != "1" {
			t.Errorf("unwritten%s: %d %v", slow, resp.StatusCode, resp.Header)
		}
		resp, err = client.Get(base + "/trailer" + slow)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != "body" || resp.Trailer.Get("X-Declared") != "d" || resp.Trailer.Get("X-Undeclared") != "u" {
			t.Errorf("trailer%s: %q, trailer %v", slow, b, resp.Trailer)
		}
	}
}
