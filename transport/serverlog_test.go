package transport

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"
)

// syncBuffer is a bytes.Buffer safe for the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// lines returns the JSON log lines written so far.
func (s *syncBuffer) lines(t *testing.T) []map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(s.b.Bytes()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Bytes(), err)
		}
		out = append(out, m)
	}
	return out
}

// panicHandler panics with a value of its own on /boom, aborts on /abort
// (http.ErrAbortHandler: deliberate, not a panic to count) and answers
// anything else.
func panicHandler(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/boom":
		panic("boom at " + r.URL.Path)
	case "/abort":
		panic(http.ErrAbortHandler)
	}
	w.Write([]byte("ok"))
}

// waitPanics polls until n reaches want, or fails after a deadline.
func waitPanics(t *testing.T, n *atomic.Int64, want int64) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); n.Load() < want; {
		if time.Now().After(deadline) {
			t.Fatalf("%d panics counted, want %d", n.Load(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// checkPanicLogged checks the log holds exactly one panic, at error level,
// with its value and the handler's frame in its stack.
func checkPanicLogged(t *testing.T, logs *syncBuffer) {
	t.Helper()
	var panics []map[string]any
	for _, l := range logs.lines(t) {
		if l["message"] == "recovered a panic serving a request" {
			panics = append(panics, l)
		}
	}
	if len(panics) != 1 {
		t.Fatalf("%d panic lines logged, want 1: %v", len(panics), logs.lines(t))
	}
	p := panics[0]
	if p["level"] != "error" || p["panic"] != "boom at /boom" || !strings.Contains(p["stack"].(string), "transport.panicHandler") {
		t.Fatalf("panic logged as %v", p)
	}
}

// TestServerLogCountsPanics: a panic net/http recovers is counted once and
// logged at error level with its value and stack; a deliberate abort is
// neither; requests after it are served.
func TestServerLogCountsPanics(t *testing.T) {
	var logs syncBuffer
	var n atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(panicHandler))
	srv.Config.ErrorLog = ServerLog(zerolog.New(&logs), func() { n.Add(1) })
	srv.Start()
	defer srv.Close()
	requestPanics(t, srv.Client(), srv.URL, &logs, &n)
}

// requestPanics requests /abort, /boom and /ok from base (panicHandler):
// only /ok answers, and exactly one panic is counted and logged.
func requestPanics(t *testing.T, client *http.Client, base string, logs *syncBuffer, n *atomic.Int64) {
	t.Helper()
	for _, path := range []string{"/abort", "/boom", "/ok"} {
		resp, err := client.Get(base + path)
		if err == nil {
			resp.Body.Close()
		}
		if (err == nil) != (path == "/ok") {
			t.Fatalf("%s: %v", path, err)
		}
	}
	waitPanics(t, n, 1)
	checkPanicLogged(t, logs)
	if n.Load() != 1 {
		t.Fatalf("%d panics counted, want 1 (the abort is not one)", n.Load())
	}
}

// TestServeHTTPCountsPanics is the same through ServeHTTP, on libp2p
// streams, as the agent serves its relays.
func TestServeHTTPCountsPanics(t *testing.T) {
	srv, cli := newTestHost(t), newTestHost(t)
	connect(t, cli, srv)
	var logs syncBuffer
	var n atomic.Int64
	c, err := ServeHTTP(srv, http.HandlerFunc(panicHandler), func(peer.ID) bool { return true },
		WithServerLog(ServerLog(zerolog.New(&logs), func() { n.Add(1) })))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	requestPanics(t, &http.Client{Transport: NewRoundTripper(cli)}, "http://"+srv.ID().String(), &logs, &n)
}
