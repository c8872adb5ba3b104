package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// syncBuf is a bytes.Buffer safe for the flush timer's goroutine.
type syncBuf struct {
	mu     sync.Mutex
	b      bytes.Buffer
	writes int
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writes++
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestLogBufferHoldsInfoAndKeepsOrder(t *testing.T) {
	out := &syncBuf{}
	b := newLogBuffer(out, time.Hour) // only explicit flushes in this test
	defer b.Close()
	req := zerolog.New(b)
	life := zerolog.New(b.Immediate())

	req.Info().Msg("r1")
	req.Debug().Msg("r2")
	if got := out.String(); got != "" {
		t.Fatalf("info lines written at once: %q", got)
	}
	life.Info().Msg("l1") // lifecycle line: out at once, after r1 and r2
	req.Info().Msg("r3")
	req.Warn().Msg("w1") // a warning flushes r3 before it
	req.Info().Msg("r4")
	if err := b.Flush(); err != nil {
		t.Fatal(err)
	}
	var msgs []string
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		i := strings.Index(l, `"message":"`)
		msgs = append(msgs, strings.TrimSuffix(l[i+len(`"message":"`):], `"}`))
	}
	if got, want := strings.Join(msgs, ","), "r1,r2,l1,r3,w1,r4"; got != want {
		t.Fatalf("lines %s, want %s", got, want)
	}
	if out.writes != 5 { // [r1 r2] l1 [r3] w1 [r4]
		t.Errorf("%d writes, want 5", out.writes)
	}
}

func TestLogBufferFlushesWhenFullAndOnTimer(t *testing.T) {
	out := &syncBuf{}
	b := newLogBuffer(out, 20*time.Millisecond)
	defer b.Close()
	line := bytes.Repeat([]byte("x"), 1000)
	line = append(line, '\n')
	for range logBufSize / len(line) {
		_, _ = b.WriteLevel(zerolog.InfoLevel, line)
	}
	before := len(out.String())
	_, _ = b.WriteLevel(zerolog.InfoLevel, line) // no room: the buffer goes out
	if before != 0 || len(out.String()) != logBufSize/len(line)*len(line) {
		t.Fatalf("before the overflowing line %d bytes written, after %d", before, len(out.String()))
	}
	// The held line goes out within the flush interval, by itself.
	deadline := time.Now().Add(5 * time.Second)
	for len(out.String()) != (logBufSize/len(line)+1)*len(line) {
		if time.Now().After(deadline) {
			t.Fatalf("held line not flushed by the timer: %d bytes written", len(out.String()))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestLogBufferCloseWritesThrough(t *testing.T) {
	out := &syncBuf{}
	b := newLogBuffer(out, time.Hour)
	_, _ = b.WriteLevel(zerolog.InfoLevel, []byte("a\n"))
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	_, _ = b.WriteLevel(zerolog.InfoLevel, []byte("b\n"))
	if got := out.String(); got != "a\nb\n" {
		t.Fatalf("after Close: %q", got)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestLoggersBufferOnlyFiles(t *testing.T) {
	var buf bytes.Buffer
	l := logFlags{format: "json", level: "info"}
	_, req, err := l.loggers(&buf, true)
	if err != nil {
		t.Fatal(err)
	}
	req.Info().Msg("at once")
	if !strings.Contains(buf.String(), "at once") {
		t.Fatal("a logger to a non-file writer buffered its line")
	}
}

const envLogHelper = "COMPUTEFLUX_TEST_LOGBUF_HELPER"

// TestLogBufferProcessHelper is the child of TestLogsFlushedOnSIGTERM: it
// logs through the relay's loggers to its stderr (a pipe), says so on
// stdout, and on SIGTERM exits the way main does.
func TestLogBufferProcessHelper(t *testing.T) {
	if os.Getenv(envLogHelper) == "" {
		t.Skip("helper process of TestLogsFlushedOnSIGTERM")
	}
	ctx, stop := signal.NotifyContext(t.Context(), syscall.SIGTERM)
	logFlushEvery = time.Hour // only the exit path can write the held lines
	l := logFlags{format: "json", level: "info"}
	life, req, err := l.loggers(os.Stderr, true)
	if err != nil {
		t.Fatal(err)
	}
	req.Info().Msg("request 1")
	life.Info().Msg("lifecycle")
	req.Info().Msg("request 2")
	os.Stdout.WriteString("logged\n")
	<-ctx.Done()
	stop()
	flushLogs()
	os.Exit(0)
}

// TestLogsFlushedOnSIGTERM checks that request lines to a pipe are held,
// and reach the log when the process ends on SIGTERM, after the lines
// logged before them.
func TestLogsFlushedOnSIGTERM(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestLogBufferProcessHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), envLogHelper+"=1")
	var stderr syncBuf
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if _, err := bufio.NewReader(stdout).ReadString('\n'); err != nil {
		t.Fatalf("helper: %v; stderr: %s", err, stderr.String())
	}
	// The lifecycle line went out at once; the request line after it is
	// held, as the relay's per-request lines are on a pipe.
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(stderr.String(), "lifecycle"); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("lifecycle line not written at once:\n%s", stderr.String())
		}
	}
	if got := stderr.String(); strings.Contains(got, "request 2") {
		t.Fatalf("a request line to a pipe was written before the exit path, not held:\n%s", got)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("helper: %v; stderr: %s", err, stderr.String())
	}
	got := stderr.String()
	i1, il, i2 := strings.Index(got, "request 1"), strings.Index(got, "lifecycle"), strings.Index(got, "request 2")
	if i1 < 0 || il < 0 || i2 < 0 || !(i1 < il && il < i2) {
		t.Fatalf("log after SIGTERM, want request 1, lifecycle, request 2 in order:\n%s", got)
	}
}

// TestIsTerminal: /dev/null, a character device nobody reads, a file and a
// pipe are not terminals, so --log-format auto writes JSON to them.
func TestIsTerminal(t *testing.T) {
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Skip(err)
	}
	defer null.Close()
	file, err := os.Create(filepath.Join(t.TempDir(), "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	for name, f := range map[string]*os.File{"/dev/null": null, "file": file, "pipe": w} {
		if isTerminal(f) {
			t.Errorf("%s taken for a terminal", name)
		}
	}
	if isTerminal(&bytes.Buffer{}) {
		t.Error("a buffer taken for a terminal")
	}
}

// flakyWriter fails its writes while broken: after writing half of what
// it was given when short (a short write), else writing nothing.
type flakyWriter struct {
	syncBuf
	broken, short atomic.Bool
}

func (f *flakyWriter) Write(p []byte) (int, error) {
	if f.broken.Load() {
		n := 0
		if f.short.Load() {
			n, _ = f.syncBuf.Write(p[:len(p)/2])
		}
		return n, errors.New("write /var/log/relay.log: no space left on device")
	}
	return f.syncBuf.Write(p)
}

// A write that fails loses no line: what it did not write is written again
// once the writer works, in order, by the flush timer; lines that do not
// fit meanwhile are dropped, counted, reported on stderr at once and in
// the log once it works again.
func TestLogBufferRetriesAndCountsLostLines(t *testing.T) {
	out := &flakyWriter{}
	var report syncBuf
	b := newLogBuffer(out, 20*time.Millisecond)
	b.report = &report
	defer b.Close()
	req := zerolog.New(b)
	life := zerolog.New(b.Immediate())

	out.short.Store(true)
	out.broken.Store(true)
	req.Info().Msg("r1")
	life.Warn().Msg("w1") // flushes r1: the write fails half way
	req.Info().Msg("r2")
	if got := report.String(); !strings.Contains(got, "no space left on device") {
		t.Fatalf("the failure was not reported at once: %q", got)
	}
	out.broken.Store(false)
	want := "r1,w1,r2"
	for deadline := time.Now().Add(5 * time.Second); messages(out.String()) != want; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after the writer came back: %q, want lines %s", out.String(), want)
		}
	}
	if b.Lost() != 0 {
		t.Fatalf("%d lines counted lost, want 0", b.Lost())
	}

	// A longer failure: lines beyond the buffer are dropped and counted.
	out.short.Store(false)
	out.broken.Store(true)
	line := strings.Repeat("x", 1000)
	sent := 2 * logBufSize / len(line)
	for range sent {
		req.Info().Msg(line)
	}
	out.broken.Store(false)
	if err := b.Flush(); err != nil {
		t.Fatal(err)
	}
	lost := b.Lost()
	if lost == 0 || lost >= uint64(sent) {
		t.Fatalf("%d of %d lines counted lost", lost, sent)
	}
	got := out.String()
	kept := strings.Count(got, line)
	if uint64(kept)+lost != uint64(sent) {
		t.Fatalf("%d lines written and %d counted lost, of %d sent", kept, lost, sent)
	}
	if !strings.Contains(got, fmt.Sprintf(`"lost":%d`, lost)) || !strings.Contains(got, "no space left on device") {
		t.Fatalf("no loss line with the count and the cause in the log: %q", got[max(0, len(got)-400):])
	}
	if n := strings.Count(report.String(), "writing the log failed"); n != 2 {
		t.Fatalf("stderr reports %d failures, want one per failure episode (2): %q", n, report.String())
	}
}

// Close reports what it could not write.
func TestLogBufferCloseReportsLoss(t *testing.T) {
	out := &flakyWriter{}
	var report syncBuf
	b := newLogBuffer(out, time.Hour)
	b.report = &report
	_, _ = b.WriteLevel(zerolog.InfoLevel, []byte("a\n"))
	_, _ = b.WriteLevel(zerolog.InfoLevel, []byte("b\n"))
	out.broken.Store(true)
	if err := b.Close(); err == nil {
		t.Fatal("Close with a failing writer returned no error")
	}
	if b.Lost() != 2 || !strings.Contains(report.String(), "2 log lines lost") {
		t.Fatalf("lost %d, report %q", b.Lost(), report.String())
	}
}

// messages returns the message fields of JSON log lines, joined by commas.
func messages(log string) string {
	var msgs []string
	for _, l := range strings.Split(strings.TrimSpace(log), "\n") {
		var m struct {
			Message string `json:"message"`
		}
		if json.Unmarshal([]byte(l), &m) == nil {
			msgs = append(msgs, m.Message)
		}
	}
	return strings.Join(msgs, ",")
}
