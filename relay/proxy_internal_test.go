package relay

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestForwardedHeadersCanonical(t *testing.T) {
	for _, h := range forwardedHeaders {
		if got := http.CanonicalHeaderKey(h.wire); got != h.canon {
			t.Errorf("%s: canonical %s, table says %s", h.wire, got, h.canon)
		}
	}
	if http.CanonicalHeaderKey(HeaderSession) != headerSessionCanon {
		t.Errorf("headerSessionCanon %s is not %s canonicalised", headerSessionCanon, HeaderSession)
	}
}

// FuzzJSONString checks jsonString against json.Unmarshal on every valid
// JSON string.
func FuzzJSONString(f *testing.F) {
	for _, s := range []string{`"m1"`, `""`, `"a\"b"`, `"\u00e9t\u00e9"`, "\"\xff\"", `"été"`, `"tab	"`, `"x\\"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) || len(raw) == 0 || raw[0] != '"' {
			return
		}
		var want string
		wantErr := json.Unmarshal(raw, &want)
		got, err := jsonString(raw)
		if (err != nil) != (wantErr != nil) || got != want {
			t.Fatalf("jsonString(%q) = %q, %v; Unmarshal: %q, %v", raw, got, err, want, wantErr)
		}
	})
}

// TestReadBodyTrustsNoDeclaredLength: a client that announces a body near
// the limit and sends a few bytes makes the relay hold memory only for what
// it sent, not for what it announced. (The server's body reader fails such
// a body as cut short; this reader just ends.)
func TestReadBodyTrustsNoDeclaredLength(t *testing.T) {
	// The measure is the process's, other tests' goroutines included:
	// the bound is far below the declared length, not tight.
	const declared = 30 << 20
	for _, sent := range []int{10, 64 << 10} {
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", io.LimitReader(zeros{}, int64(sent)))
		r.ContentLength = declared
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		b, err := readBody(httptest.NewRecorder(), r, 32<<20)
		runtime.ReadMemStats(&after)
		if err != nil || len(b) != sent {
			t.Fatalf("sent %d of %d declared bytes: read %d, %v", sent, declared, len(b), err)
		}
		if got := after.TotalAlloc - before.TotalAlloc; got > 8<<20 {
			t.Errorf("sent %d of %d declared bytes: allocated %d bytes", sent, declared, got)
		}
	}
	// A small declared body is read whole.
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(`{"model":"m"}`))
	if b, err := readBody(httptest.NewRecorder(), r, 32<<20); err != nil || string(b) != `{"model":"m"}` {
		t.Fatalf("small body: %q, %v", b, err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// deadlineWriter is a ResponseWriter that counts write deadlines.
type deadlineWriter struct {
	httptest.ResponseRecorder
	deadlines int
}

func (w *deadlineWriter) SetWriteDeadline(t time.Time) error {
	if !t.IsZero() {
		w.deadlines++
	}
	return nil
}

// TestStreamCopierDeadlines checks that every write that may reach the
// client's connection before the handler returns has a deadline: flushed
// writes and writes past what net/http holds; the rest need none.
func TestStreamCopierDeadlines(t *testing.T) {
	for _, c := range []struct {
		name   string
		flush  bool
		writes []int
		want   int
	}{
		{"small answer", false, []int{600, 1}, 0},
		{"held in full", false, []int{heldWrite}, 0},
		{"past the held bytes", false, []int{1000, 1000, 48, 1, 4000}, 2},
		{"large answer", false, []int{32 << 10, 10}, 2},
		{"flushed", true, []int{10, 10, 10}, 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := &deadlineWriter{ResponseRecorder: *httptest.NewRecorder()}
			cp := streamCopier{w: w, rc: http.NewResponseController(w), flush: c.flush, idle: time.Second, clock: realClock{}}
			total := 0
			for _, n := range c.writes {
				if err := cp.write([]byte(strings.Repeat("x", n))); err != nil {
					t.Fatal(err)
				}
				total += n
			}
			if w.deadlines != c.want {
				t.Errorf("%d deadlines set, want %d", w.deadlines, c.want)
			}
			if w.Body.Len() != total || cp.dl != (c.want > 0) {
				t.Errorf("wrote %d of %d bytes, deadline flag %v", w.Body.Len(), total, cp.dl)
			}
		})
	}
}

// TestHeldWriteStaysInServer holds heldWrite to net/http's own response
// buffer: an unflushed answer of up to heldWrite bytes, written by a
// streamCopier without a write deadline, must send nothing to the client
// (not even its head) before the handler returns, so that its writes cannot
// block on a client that stops reading. net/http holds more (its
// connection's buffer too, 4 KiB), so heldWrite errs on the safe side; an
// answer past both must go out at once: the check can tell.
func TestHeldWriteStaysInServer(t *testing.T) {
	for _, c := range []struct {
		size int
		held bool
	}{{heldWrite, true}, {4 * heldWrite, false}} {
		wrote, release := make(chan struct{}), make(chan struct{})
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(c.size))
			w.WriteHeader(http.StatusOK)
			cp := streamCopier{w: w, rc: http.NewResponseController(w), idle: time.Minute, clock: realClock{}}
			if err := cp.write([]byte(strings.Repeat("x", c.size))); err != nil {
				t.Error(err)
			}
			if cp.dl == c.held {
				t.Errorf("%d bytes: write deadline set %v", c.size, cp.dl)
			}
			close(wrote)
			<-release
			cp.clearDeadline()
		}))
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(conn, "GET / HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		<-wrote
		// Whatever the write sent is on loopback well within this.
		_ = conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		var one [1]byte
		n, _ := conn.Read(one[:])
		close(release)
		if sent := n > 0; sent == c.held {
			t.Errorf("%d bytes unflushed: bytes reached the client before the handler returned: %v", c.size, sent)
		}
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		rest, err := io.ReadAll(conn)
		if err != nil {
			t.Fatal(err)
		}
		if body := len(rest) + n - bytes.Index(append(one[:n], rest...), []byte("\r\n\r\n")) - 4; body != c.size {
			t.Errorf("%d bytes: client got a body of %d", c.size, body)
		}
		_ = conn.Close()
		srv.Close()
	}
}
