package main

import (
	"io"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// Log buffering, as nginx's `access_log ... buffer=64k flush=1s`: on a busy
// relay the per-request line cost one write(2) each, a few percent of the
// relay's CPU. Info and debug lines are gathered in memory and written
// together, at most logFlushEvery after the first of them or as soon as
// logBufSize fills; a warn, error or fatal line (and a line of unknown
// level) goes out at once with everything before it, so order is kept and
// problems are seen without delay. The process flushes on every exit path
// (main's flushLogs after the command returns, which a SIGTERM or Ctrl-C
// reaches through the command's context; zerolog's Fatal writes at fatal
// level, so it flushes before it exits).
//
// Only the relay's per-request lines are held (relay.Config.RequestLogger
// writes through the buffer, its other lines through logBuffer.Immediate):
// lifecycle lines, which operators and the chaos scenarios time faults by,
// go out at once, after every request line before them.
//
// The trade: a process that dies without running its exit path (SIGKILL,
// an unrecovered panic, the OOM killer) loses at most the last
// logFlushEvery of info lines; warnings and errors are never held back.
// logBufSize bounds the bytes held: a full buffer is written at once.
const logBufSize = 64 << 10

// logFlushEvery is the longest an info line waits in the buffer (a
// variable so that a test can hold lines until exit).
var logFlushEvery = 100 * time.Millisecond

// logBuffer is a zerolog.LevelWriter that buffers low-level lines in front
// of w (see above). Its methods are safe for concurrent use; one mutex
// serialises the writes, so lines reach w whole and in order.
type logBuffer struct {
	w     io.Writer
	every time.Duration

	mu     sync.Mutex // guards the following fields
	buf    []byte
	timer  *time.Timer // armed while buf holds lines
	closed bool        // after Close, lines go straight through
}

func newLogBuffer(w io.Writer, every time.Duration) *logBuffer {
	return &logBuffer{w: w, every: every, buf: make([]byte, 0, logBufSize)}
}

// Write writes p at once, with everything buffered before it: without a
// level, it may be a warning.
func (b *logBuffer) Write(p []byte) (int, error) {
	return b.WriteLevel(zerolog.NoLevel, p)
}

// WriteLevel buffers p if level is below warn, and otherwise writes it at
// once after the lines buffered before it.
func (b *logBuffer) WriteLevel(level zerolog.Level, p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	hold := level < zerolog.WarnLevel && !b.closed // Trace is -1, NoLevel 6
	if !hold || len(b.buf)+len(p) > cap(b.buf) {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
		if !hold || len(p) > cap(b.buf) {
			return b.w.Write(p)
		}
	}
	b.buf = append(b.buf, p...)
	if b.timer == nil {
		b.timer = time.AfterFunc(b.every, func() { _ = b.Flush() })
	} else if len(b.buf) == len(p) {
		b.timer.Reset(b.every) // the first line since the last flush
	}
	return len(p), nil
}

// Immediate returns a writer that writes each line at once, after the
// lines buffered before it, whatever its level.
func (b *logBuffer) Immediate() io.Writer { return immediateWriter{b} }

// immediateWriter writes through a logBuffer without holding lines.
type immediateWriter struct{ b *logBuffer }

func (w immediateWriter) Write(p []byte) (int, error) {
	return w.b.WriteLevel(zerolog.NoLevel, p)
}

// Flush writes the buffered lines.
func (b *logBuffer) Flush() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.flushLocked()
}

func (b *logBuffer) flushLocked() error {
	if len(b.buf) == 0 {
		return nil
	}
	if b.timer != nil {
		b.timer.Stop()
	}
	_, err := b.w.Write(b.buf)
	b.buf = b.buf[:0]
	return err
}

// Close flushes and stops buffering: later lines are written at once. It
// does not close w, and may be called more than once.
func (b *logBuffer) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	err := b.flushLocked()
	if b.timer != nil {
		b.timer.Stop()
	}
	return err
}

// logBuffers are the buffers the process's loggers write through, closed
// by flushLogs when the command returns.
var logBuffers struct {
	mu   sync.Mutex // guards list
	list []*logBuffer
}

// bufferLogs returns a buffer in front of w, closed by flushLogs.
func bufferLogs(w io.Writer) *logBuffer {
	b := newLogBuffer(w, logFlushEvery)
	logBuffers.mu.Lock()
	logBuffers.list = append(logBuffers.list, b)
	logBuffers.mu.Unlock()
	return b
}

// flushLogs writes out every log buffer and makes later lines go straight
// through. main calls it once the command has returned, before it exits.
func flushLogs() {
	logBuffers.mu.Lock()
	list := logBuffers.list
	logBuffers.list = nil
	logBuffers.mu.Unlock()
	for _, b := range list {
		_ = b.Close()
	}
}
