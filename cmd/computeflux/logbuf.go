package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
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

// A write that fails loses nothing at once: the bytes not written stay in
// the buffer (in order, whole lines after a short write) and are written
// again at the next flush, every logFlushEvery while the writer fails (a
// full disk freed, a pipe reader back). Lines that do not fit while it
// fails are dropped and counted: the first failure is reported on
// stderr at once, and once the writer works again a line in the log says
// how many were lost and why, as does Close for what it could not write.

// logBuffer is a zerolog.LevelWriter that buffers low-level lines in front
// of w (see above). Its methods are safe for concurrent use; one mutex
// serialises the writes, so lines reach w whole and in order.
type logBuffer struct {
	w      io.Writer
	every  time.Duration
	report io.Writer // where a failing writer is reported at once (stderr)

	mu      sync.Mutex // guards the following fields
	buf     []byte
	timer   *time.Timer // armed while buf holds lines
	closed  bool        // after Close, lines go straight through
	failErr error       // the last write error while writes fail, else nil
	lost    int         // lines dropped since the last loss line
	lostAll uint64      // lines dropped since the start
}

func newLogBuffer(w io.Writer, every time.Duration) *logBuffer {
	return &logBuffer{w: w, every: every, report: os.Stderr, buf: make([]byte, 0, logBufSize)}
}

// Write writes p at once, with everything buffered before it: without a
// level, it may be a warning.
func (b *logBuffer) Write(p []byte) (int, error) {
	return b.WriteLevel(zerolog.NoLevel, p)
}

// WriteLevel buffers p if level is below warn, and otherwise writes it at
// once after the lines buffered before it. While the writer fails, every
// line is held for the retry, or dropped and counted when it does not fit.
func (b *logBuffer) WriteLevel(level zerolog.Level, p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	hold := level < zerolog.WarnLevel && !b.closed // Trace is -1, NoLevel 6
	if !hold || len(b.buf)+len(p) > cap(b.buf) {
		if err := b.flushLocked(); err != nil {
			// Kept for the retry, behind the lines before it.
			if len(b.buf)+len(p) > cap(b.buf) {
				b.dropLocked(p)
			} else {
				b.buf = append(b.buf, p...)
			}
			return len(p), nil
		}
		if !hold || len(p) > cap(b.buf) {
			n, err := b.w.Write(p)
			if err != nil {
				b.failedLocked(err)
				if rest := p[n:]; len(rest) <= cap(b.buf) {
					b.buf = append(b.buf, rest...)
				} else {
					b.dropLocked(rest)
				}
				return len(p), nil
			}
			return n, nil
		}
	}
	b.buf = append(b.buf, p...)
	b.armLocked(len(b.buf) == len(p))
	return len(p), nil
}

// armLocked makes sure a flush comes within every; first says the buffer
// held nothing before (the timer, if any, is stopped or spent).
func (b *logBuffer) armLocked(first bool) {
	if b.timer == nil {
		b.timer = time.AfterFunc(b.every, func() { _ = b.Flush() })
	} else if first {
		b.timer.Reset(b.every) // the first line since the last flush
	}
}

// dropLocked counts the lines of p as lost.
func (b *logBuffer) dropLocked(p []byte) {
	n := max(bytes.Count(p, []byte{'\n'}), 1)
	b.lost += n
	b.lostAll += uint64(n)
}

// failedLocked records a failed write: reported on stderr the first time,
// retried within every.
func (b *logBuffer) failedLocked(err error) {
	if b.failErr == nil && b.report != nil && b.report != b.w {
		fmt.Fprintf(b.report, "computeflux: writing the log failed: %v; holding up to %d bytes of it and retrying every %v; lines beyond are counted and dropped\n", err, cap(b.buf), b.every)
	}
	b.failErr = err
	if b.timer == nil {
		b.timer = time.AfterFunc(b.every, func() { _ = b.Flush() })
	} else {
		b.timer.Reset(b.every)
	}
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

// Lost returns how many lines were dropped because the writer failed.
func (b *logBuffer) Lost() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lostAll
}

// flushLocked writes the buffered lines. What a failed write left is kept
// for the next try; once writes work again, a line says how many were
// lost meanwhile.
func (b *logBuffer) flushLocked() error {
	if len(b.buf) > 0 {
		if b.timer != nil {
			b.timer.Stop()
		}
		n, err := b.w.Write(b.buf)
		b.buf = b.buf[:copy(b.buf, b.buf[n:])]
		if err != nil {
			b.failedLocked(err)
			return err
		}
	}
	if b.lost > 0 {
		line := lossLine(b.lost, b.failErr)
		if _, err := b.w.Write(line); err != nil {
			b.failedLocked(err)
			return err
		}
		b.lost = 0
	}
	b.failErr = nil
	return nil
}

// lossLine is the log line that says n lines were lost to err.
func lossLine(n int, err error) []byte {
	var line bytes.Buffer
	msg := "log lines lost: writing the log failed"
	if err == nil {
		err = errors.New("unknown")
	}
	l := zerolog.New(&line).With().Timestamp().Logger()
	l.Error().Int("lost", n).AnErr("error", err).Msg(msg)
	return line.Bytes()
}

// Close flushes and stops buffering: later lines are written at once. It
// does not close w, and may be called more than once. Lines it cannot
// write are counted as lost and reported on stderr.
func (b *logBuffer) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	err := b.flushLocked()
	if err != nil {
		b.dropLocked(b.buf)
		b.buf = b.buf[:0]
		if b.report != nil {
			fmt.Fprintf(b.report, "computeflux: %d log lines lost: writing the log failed: %v\n", b.lost, err)
		}
	}
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
