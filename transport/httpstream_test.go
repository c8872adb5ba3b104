package transport

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
)

// serve starts ServeHTTP on srv admitting only the given peers.
func serve(t testing.TB, srv host.Host, handler http.Handler, allowed ...peer.ID) *HTTPServer {
	t.Helper()
	hs, err := ServeHTTP(srv, handler, func(p peer.ID) bool {
		for _, a := range allowed {
			if a == p {
				return true
			}
		}
		return false
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hs.Close() })
	return hs
}

func TestHTTPRequestResponse(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, _ := PeerFromContext(r.Context())
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Peer", p.String())
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "%s %s %s", r.Method, r.URL.Path, body)
	}), cli.ID())

	client := &http.Client{Transport: NewRoundTripper(cli)}
	resp, err := client.Post("http://"+srv.ID().String()+"/v1/echo", "text/plain", strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusCreated || string(body) != "POST /v1/echo hello" {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
	if resp.Header.Get("X-Peer") != cli.ID().String() {
		t.Fatalf("server saw peer %q, want %s", resp.Header.Get("X-Peer"), cli.ID())
	}
}

func TestHTTPConcurrentRequestsShareOneConnection(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(w, r.Body)
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	const n = 64
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			want := strings.Repeat(fmt.Sprint(i), 10_000)
			resp, err := client.Post("http://"+srv.ID().String()+"/x", "text/plain", strings.NewReader(want))
			if err != nil {
				errs <- err
				return
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(got) != want {
				errs <- fmt.Errorf("request %d: %d bytes, err %v", i, len(got), err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := len(cli.Network().ConnsToPeer(srv.ID())); n != 1 {
		t.Errorf("%d connections to the server, want 1", n)
	}
	// Idle streams go back to the pool; closing the pool ends them all.
	client.CloseIdleConnections()
	waitFor(t, "streams to end", func() bool {
		for _, c := range cli.Network().ConnsToPeer(srv.ID()) {
			for _, s := range c.GetStreams() {
				if s.Protocol() == InferProtocol {
					return false
				}
			}
		}
		return true
	})
}

func TestHTTPStreamsAreReused(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Write([]byte("ok"))
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	defer client.CloseIdleConnections()
	reused := 0
	for range 5 {
		ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
			GotConn: func(info httptrace.GotConnInfo) {
				if info.Reused {
					reused++
				}
			},
		})
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+srv.ID().String()+"/v1/x", strings.NewReader("{}"))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if reused != 4 {
		t.Fatalf("%d of 4 follow-up requests reused a stream", reused)
	}
}

func TestHTTPServerSentEventsFlowPerEvent(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	release := make(chan struct{})
	handlerDone := make(chan struct{})
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(handlerDone)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release: // the client has seen the first event
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: second\n\n")
	}), cli.ID())

	client := &http.Client{Transport: NewRoundTripper(cli)}
	resp, err := client.Get("http://" + srv.ID().String() + "/v1/stream")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "data: first\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	select {
	case <-handlerDone:
		t.Fatal("handler finished before the client read the first event")
	default:
	}
	close(release)
	rest, err := io.ReadAll(br)
	if err != nil || string(rest) != "\ndata: second\n\n" {
		t.Fatalf("rest %q, %v", rest, err)
	}
}

func TestHTTPCancelResetsStreamAndEndsHandler(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	started := make(chan struct{})
	handlerCtxDone := make(chan struct{})
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: one\n\n")
		w.(http.Flusher).Flush()
		close(started)
		<-r.Context().Done()
		close(handlerCtxDone)
	}), cli.ID())

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+srv.ID().String()+"/v1/chat/completions", strings.NewReader("{}"))
	resp, err := NewRoundTripper(cli).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-started
	buf := make([]byte, 64)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case <-handlerCtxDone:
	case <-time.After(10 * time.Second):
		t.Fatal("server handler's context did not end after the client cancelled")
	}
	// The body now fails with the context's error, not a hang.
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, context.Canceled) {
		t.Fatalf("read after cancel: %v", err)
	}
}

func TestHTTPCancelBeforeResponse(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	entered := make(chan struct{})
	handlerCtxDone := make(chan struct{})
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		close(entered)
		<-r.Context().Done()
		close(handlerCtxDone)
	}), cli.ID())
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-entered
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+srv.ID().String()+"/slow", nil)
	_, err := NewRoundTripper(cli).RoundTrip(req)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("RoundTrip error %v, want context.Canceled", err)
	}
	select {
	case <-handlerCtxDone:
	case <-time.After(10 * time.Second):
		t.Fatal("server handler's context did not end")
	}
}

func TestHTTPRejectsPeersNotAllowed(t *testing.T) {
	srv, friend, stranger := newTestHost(t), newTestHost(t), newTestHost(t)
	connect(t, friend, srv)
	connect(t, stranger, srv)
	var calls sync.Map
	hs := serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, _ := PeerFromContext(r.Context())
		calls.Store(p, true)
	}), friend.ID())

	url := "http://" + srv.ID().String() + "/v1/models"
	resp, err := (&http.Client{Transport: NewRoundTripper(stranger)}).Get(url)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("stranger got status %d", resp.StatusCode)
	}
	if _, called := calls.Load(stranger.ID()); called {
		t.Fatal("handler ran for the stranger")
	}
	waitFor(t, "rejection to be counted", func() bool { return hs.Rejected() == 1 })

	resp, err = (&http.Client{Transport: NewRoundTripper(friend)}).Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("friend got %d", resp.StatusCode)
	}
}

func TestHTTPBadPeerIDInURL(t *testing.T) {
	cli := newTestHost(t)
	_, err := (&http.Client{Transport: NewRoundTripper(cli)}).Get("http://not-a-peer/v1/models")
	if err == nil || !strings.Contains(err.Error(), "not a peer ID") {
		t.Fatalf("err = %v", err)
	}
}

func TestHTTPServerCloseEndsHandlers(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	entered := make(chan struct{})
	hs := serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		close(entered)
		<-r.Context().Done()
	}), cli.ID())
	resp, err := (&http.Client{Transport: NewRoundTripper(cli)}).Get("http://" + srv.ID().String() + "/hang")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	<-entered
	hs.Close() // returns only after the handler has returned
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Fatal("a response cut by Close read as complete")
	}
}

// A server that stops accepting streams on its own (its listener failed)
// says so through Done and Err; one stopped by Close reports no error.
func TestHTTPServerReportsServeFailure(t *testing.T) {
	srv := newTestHost(t)
	hs := serve(t, srv, http.NotFoundHandler())
	select {
	case <-hs.Done():
		t.Fatal("Done closed while serving")
	default:
	}
	// The listener under the server fails, as it would if its libp2p
	// listener were closed under it.
	_ = hs.ln.(*allowListener).Listener.Close()
	select {
	case <-hs.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done not closed after the listener failed")
	}
	if hs.Err() == nil {
		t.Fatal("Err is nil after serving failed")
	}

	closed := serve(t, newTestHost(t), http.NotFoundHandler())
	closed.Close()
	<-closed.Done()
	if err := closed.Err(); err != nil {
		t.Fatalf("Err after Close: %v", err)
	}
}

// BenchmarkHTTPRoundTrip measures one small request/response on a new stream
// over an open QUIC connection on loopback.
func BenchmarkHTTPRoundTrip(b *testing.B) {
	srv, cli := newTestHost(b), newTestHost(b)
	connect(b, cli, srv)
	serve(b, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"ok":true}`))
	}), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	url := "http://" + srv.ID().String() + "/v1/x"
	b.ReportAllocs()
	for b.Loop() {
		resp, err := client.Get(url)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// BenchmarkStreamEcho measures the floor under BenchmarkHTTPRoundTrip: a
// 16-byte echo, on one long-lived stream ("reuse") and on a new stream per
// exchange ("new"), over the same loopback QUIC connection.
func BenchmarkStreamEcho(b *testing.B) {
	srv, cli := newTestHost(b), newTestHost(b)
	connect(b, cli, srv)
	const proto = "/computeflux/test-echo/1.0.0"
	srv.SetStreamHandler(proto, func(s network.Stream) {
		defer s.Close()
		buf := make([]byte, 16)
		for {
			if _, err := io.ReadFull(s, buf); err != nil {
				return
			}
			if _, err := s.Write(buf); err != nil {
				return
			}
		}
	})
	msg := make([]byte, 16)
	echo := func(b *testing.B, s network.Stream) {
		if _, err := s.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(s, msg); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("reuse", func(b *testing.B) {
		s, err := cli.NewStream(context.Background(), srv.ID(), proto)
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		for b.Loop() {
			echo(b, s)
		}
	})
	b.Run("new", func(b *testing.B) {
		for b.Loop() {
			s, err := cli.NewStream(context.Background(), srv.ID(), proto)
			if err != nil {
				b.Fatal(err)
			}
			echo(b, s)
			s.Close()
		}
	})
}

func TestHTTPStaleIdleStreamIsReplaced(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	})
	first := serve(t, srv, handler, cli.ID())
	rt := NewRoundTripper(cli)
	post := func(body string) (string, error) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+srv.ID().String()+"/v1/x", strings.NewReader(body))
		resp, err := rt.RoundTrip(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	if got, err := post("one"); err != nil || got != "one" {
		t.Fatalf("first: %q, %v", got, err)
	}
	// The server goes away and comes back: the pooled stream is dead.
	first.Close()
	serve(t, srv, handler, cli.ID())
	if got, err := post("two"); err != nil || got != "two" {
		t.Fatalf("after the server restarted: %q, %v", got, err)
	}
}

// bodyHandler is a BodyHandler recording what it was given.
type bodyHandler struct {
	got chan string
}

func (h bodyHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.got <- "ServeHTTP"
}

func (h bodyHandler) ServeHTTPBody(w http.ResponseWriter, r *http.Request, body []byte) {
	rest, _ := io.ReadAll(r.Body)
	h.got <- fmt.Sprintf("%s|%s|%d", body, rest, r.ContentLength)
	io.WriteString(w, "ok")
}

// TestBodyHandlerGetsTheBody: a BodyHandler is given the body read whole,
// and r.Body still reads it.
func TestBodyHandlerGetsTheBody(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	h := bodyHandler{got: make(chan string, 4)}
	serve(t, srv, h, cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	base := "http://" + srv.ID().String()
	for _, tc := range []struct{ method, body, want string }{
		{http.MethodPost, `{"a":1}`, `{"a":1}|{"a":1}|7`},
		{http.MethodGet, "", "||0"},
	} {
		var body io.Reader
		if tc.body != "" {
			body = strings.NewReader(tc.body)
		}
		req, _ := http.NewRequest(tc.method, base+"/x", body)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if got := <-h.got; got != tc.want || string(b) != "ok" {
			t.Fatalf("%s: handler got %q (want %q), answer %q", tc.method, got, tc.want, b)
		}
	}
}

func TestHTTPBodyErrorsAreOpenAIErrors(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	called := make(chan struct{}, 1)
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { called <- struct{}{} }), cli.ID())
	client := &http.Client{Transport: NewRoundTripper(cli)}
	// A body of unknown length past the bound (sent chunked); the bound
	// lowered from MaxRequestBody to 2 MiB, above the preallocated size.
	old := maxRequestBody.Swap(2 << 20)
	t.Cleanup(func() { maxRequestBody.Store(old) })
	big := io.MultiReader(strings.NewReader(`{"a":"`), io.LimitReader(repeatA{}, 2<<20+1))
	req, _ := http.NewRequest(http.MethodPost, "http://"+srv.ID().String()+"/x", big)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var e struct {
		Error struct{ Message, Type, Code string }
	}
	if resp.StatusCode != http.StatusRequestEntityTooLarge || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("status %d, Content-Type %q; want 413 application/json", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil || e.Error.Code != "request_too_large" || e.Error.Message == "" {
		t.Fatalf("error body %+v (%v): want OpenAI's error shape with code request_too_large", e, err)
	}
	select {
	case <-called:
		t.Fatal("the handler ran for a body over the bound")
	default:
	}

	// A body cut short of its Content-Length: the peer closes its side
	// after 10 of 100 bytes.
	s, err := cli.NewStream(context.Background(), srv.ID(), InferProtocol)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := io.WriteString(s, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\":\"aaaa"); err != nil {
		t.Fatal(err)
	}
	if err := s.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	s.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(s)
	cut, err := http.ReadResponse(br, nil)
	for err == nil && cut.StatusCode == AckStatus {
		cut, err = http.ReadResponse(br, nil)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer cut.Body.Close()
	e.Error.Message, e.Error.Code = "", ""
	if err := json.NewDecoder(cut.Body).Decode(&e); err != nil || cut.StatusCode != http.StatusBadRequest ||
		cut.Header.Get("Content-Type") != "application/json" || e.Error.Code != "bad_request_body" {
		t.Fatalf("cut body: status %d, Content-Type %q, error %+v (%v); want 400 with code bad_request_body",
			cut.StatusCode, cut.Header.Get("Content-Type"), e, err)
	}
	select {
	case <-called:
		t.Fatal("the handler ran for a body cut short")
	default:
	}
}

// repeatA reads as an endless run of 'a'.
type repeatA struct{}

func (repeatA) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'a'
	}
	return len(p), nil
}

// TestHTTPStreamsPerPeerBounded: requests beyond the bound on open streams
// to one peer wait for a stream instead of opening more (which QUIC would
// hold back, the peer's credit spent); they all complete, and one whose
// context ends while it waits returns at once.
func TestHTTPStreamsPerPeerBounded(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	var mu sync.Mutex
	var cur, peak int
	release := make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	defer free() // the handlers must return for the server to close
	serve(t, srv, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		cur++
		peak = max(peak, cur)
		mu.Unlock()
		<-release
		mu.Lock()
		cur--
		mu.Unlock()
		io.WriteString(w, "ok")
	}), cli.ID())
	tr := newStreamTransport(cli)
	tr.maxOpen = 3
	client := &http.Client{Transport: tr}
	url := "http://" + srv.ID().String() + "/v1/x"
	const n = 8
	errs := make(chan error, n)
	for range n {
		go func() {
			resp, err := client.Get(url)
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			errs <- err
		}()
	}
	// Three handlers run, the rest wait in the transport.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		c := cur
		mu.Unlock()
		if c == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d handlers running, want 3", c)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if _, err := client.Do(req); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a request waiting for a stream past its deadline: %v", err)
	}
	free()
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if peak != 3 {
		t.Fatalf("%d handlers ran at once, bound 3", peak)
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if o := tr.open[string(srv.ID())]; o == nil || o.n != len(tr.idle[string(srv.ID())]) || o.n > 3 {
		t.Fatalf("open streams %+v, idle %d", o, len(tr.idle[string(srv.ID())]))
	}
}
