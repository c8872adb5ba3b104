package relay

import (
	"bytes"
	"net/http"
	"sync"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// answerTap sits between an attempt and the client's ResponseWriter on
// chat completions while audits run: it counts the answer's bytes and
// keeps what the cheap checks read (a non-streamed answer whole, up to
// maxTapHead; a stream's last maxTapTail bytes, where its usage chunk is).
// Bytes pass through unchanged.
type answerTap struct {
	http.ResponseWriter
	status int
	bytes  int
	events int    // "data: " seen: a stream's events, about one per token
	carry  []byte // the last len(dataPrefix)-1 bytes written, for a prefix split between writes
	head   []byte // the first maxTapHead bytes
	tail   []byte // the last maxTapTail bytes, a ring while full
	ring   int    // next write position in tail once full
	full   bool
}

const (
	maxTapHead = 64 << 10
	maxTapTail = 4 << 10
)

var dataPrefix = []byte("data: ")

var tapPool = sync.Pool{New: func() any {
	return &answerTap{head: make([]byte, 0, 4<<10), tail: make([]byte, 0, maxTapTail)}
}}

func newAnswerTap(w http.ResponseWriter) *answerTap {
	t := tapPool.Get().(*answerTap)
	t.ResponseWriter = w
	return t
}

// release returns the tap to the pool; it must not be used after.
func (t *answerTap) release() {
	*t = answerTap{head: t.head[:0], tail: t.tail[:0], carry: t.carry[:0]}
	tapPool.Put(t)
}

// Unwrap lets http.ResponseController reach the real writer (Flush,
// deadlines).
func (t *answerTap) Unwrap() http.ResponseWriter { return t.ResponseWriter }

func (t *answerTap) WriteHeader(status int) {
	if t.status == 0 {
		t.status = status
	}
	t.ResponseWriter.WriteHeader(status)
}

func (t *answerTap) Write(b []byte) (int, error) {
	if t.status == 0 {
		t.status = http.StatusOK
	}
	n, err := t.ResponseWriter.Write(b)
	t.keep(b[:n])
	return n, err
}

func (t *answerTap) keep(b []byte) {
	t.bytes += len(b)
	t.countEvents(b)
	if room := maxTapHead - len(t.head); room > 0 {
		t.head = append(t.head, b[:min(room, len(b))]...)
	}
	if len(b) >= maxTapTail {
		t.tail = append(t.tail[:0], b[len(b)-maxTapTail:]...)
		t.ring, t.full = 0, true
		return
	}
	for len(b) > 0 {
		if !t.full {
			k := min(maxTapTail-len(t.tail), len(b))
			t.tail = append(t.tail, b[:k]...)
			b = b[k:]
			t.full = len(t.tail) == maxTapTail
			continue
		}
		k := copy(t.tail[t.ring:], b)
		t.ring = (t.ring + k) % maxTapTail
		b = b[k:]
	}
}

// countEvents counts dataPrefix in b, and across the boundary with the
// bytes written before.
func (t *answerTap) countEvents(b []byte) {
	k := len(dataPrefix) - 1
	joined := len(t.carry) > 0
	if joined {
		// A match here straddles the boundary: the carry alone is too short
		// for one, and so is the head of b.
		t.carry = append(t.carry, b[:min(k, len(b))]...)
		t.events += bytes.Count(t.carry, dataPrefix)
	}
	t.events += bytes.Count(b, dataPrefix)
	switch {
	case len(b) >= k:
		t.carry = append(t.carry[:0], b[len(b)-k:]...)
	case !joined:
		t.carry = append(t.carry, b...)
	}
	if n := len(t.carry); n > k {
		t.carry = append(t.carry[:0], t.carry[n-k:]...)
	}
}

// lastBytes returns the tail in order.
func (t *answerTap) lastBytes() []byte {
	if !t.full {
		return t.tail
	}
	return append(append([]byte(nil), t.tail[t.ring:]...), t.tail[:t.ring]...)
}

// observed fills o from the answer: the model it names, its usage and the
// bytes of generated text (for a stream: every byte streamed, an upper
// bound). events is a stream's event count (0 for a whole answer). ok is
// false when the answer was not a successful completion.
func (t *answerTap) observed(o *audit.Observed, stream bool) (events int, ok bool) {
	if t.status != http.StatusOK {
		return 0, false
	}
	if !stream {
		if t.bytes > len(t.head) {
			return 0, false // too large to have been kept whole
		}
		c, err := audit.ParseCompletion(t.head)
		if err != nil {
			return 0, false
		}
		o.Answered, o.Usage, o.CompletionText = c.Model, c.Usage, len(c.Answer.Text)
		return 0, true
	}
	var c audit.Completion
	for line := range bytes.SplitSeq(t.lastBytes(), []byte("\n")) {
		data, ok := bytes.CutPrefix(line, []byte("data: "))
		if !ok || !bytes.Contains(data, []byte(`"usage"`)) {
			continue
		}
		_ = c.StreamChunk(data) // a chunk cut by the tail's start is skipped
	}
	o.Answered, o.Usage, o.CompletionText = c.Model, c.Usage, t.bytes
	return t.events, true
}
