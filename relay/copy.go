package relay

import (
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/computeflux/computeflux/scheduler"
)

// copyBufSize is the one buffer a response is copied through: buffering per
// request is bounded by it, whatever the client's reading speed.
const copyBufSize = 32 << 10

var bufPool = sync.Pool{New: func() any { b := make([]byte, copyBufSize); return &b }}

// readSome reads until it gets at least one byte or an error.
func readSome(rd io.Reader, buf []byte) (int, error) {
	for i := 0; i < 100; i++ {
		n, err := rd.Read(buf)
		if n > 0 || err != nil {
			return n, err
		}
	}
	return 0, io.ErrNoProgress
}

// streamCopier writes a response to the client, flushing streamed bodies as
// they come and bounding how long one write may block on a client that does
// not read.
type streamCopier struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	flush   bool
	idle    time.Duration
	clock   scheduler.Clock
	last    [2]byte // the last two bytes written, to find event boundaries
	written int64
	dl      bool       // a write deadline is set
	frame   *sseFramer // nil: bytes pass as they are
	out     []byte     // framed events to write, reused
}

// heldWrite is how much of a response net/http holds in its response
// buffer (bufferBeforeChunkingSize) before it writes to the connection: an
// unflushed body up to that size reaches the socket only after the handler
// returned, so its writes cannot block on the client and need no deadline.
// Setting and clearing one for every small answer was two runtime timer
// updates per request.
const heldWrite = 2048

func (s *streamCopier) write(p []byte) error {
	if len(p) == 0 {
		return nil
	}
	if (s.flush || s.written+int64(len(p)) > heldWrite) && s.rc.SetWriteDeadline(s.clock.Now().Add(s.idle)) == nil {
		s.dl = true
	}
	n, err := s.w.Write(p)
	s.written += int64(n)
	if n >= 2 {
		s.last = [2]byte{p[n-2], p[n-1]}
	} else if n == 1 {
		s.last = [2]byte{s.last[1], p[0]}
	}
	if err != nil {
		return err
	}
	if s.flush {
		return s.rc.Flush()
	}
	return nil
}

// writeEvent writes a whole server-sent event, first closing an event the
// agent left half written.
func (s *streamCopier) writeEvent(ev []byte) error {
	if s.written > 0 && s.last != [2]byte{'\n', '\n'} {
		if s.last[1] == '\n' {
			ev = append([]byte("\n"), ev...)
		} else {
			ev = append([]byte("\n\n"), ev...)
		}
	}
	s.flush = true
	return s.write(ev)
}

func (s *streamCopier) clearDeadline() {
	if s.dl {
		_ = s.rc.SetWriteDeadline(time.Time{})
	}
}
