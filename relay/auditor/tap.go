package auditor

import (
	"bytes"
	"net/http"
	"sync"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// Tap sits between an attempt and the client's ResponseWriter on chat
// completions while audits run: it counts the answer's bytes and keeps
// what the cheap checks and re-checks read (the first maxTapHead bytes: a
// small answer whole, streamed or not; a stream's last maxTapTail bytes,
// where its usage chunk is). Bytes pass through unchanged. Get one with
// NewTap, give it back with Release.
type Tap struct {
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
	return &Tap{head: make([]byte, 0, 4<<10), tail: make([]byte, 0, maxTapTail)}
}}

// NewTap returns a tap in front of w, from a pool.
func NewTap(w http.ResponseWriter) *Tap {
	t := tapPool.Get().(*Tap)
	t.ResponseWriter = w
	return t
}

// Release returns the tap to the pool; it must not be used after.
func (t *Tap) Release() {
	*t = Tap{head: t.head[:0], tail: t.tail[:0], carry: t.carry[:0]}
	tapPool.Put(t)
}

// Unwrap lets http.ResponseController reach the real writer (Flush,
// deadlines).
func (t *Tap) Unwrap() http.ResponseWriter { return t.ResponseWriter }

func (t *Tap) WriteHeader(status int) {
	if t.status == 0 {
		t.status = status
	}
	t.ResponseWriter.WriteHeader(status)
}

func (t *Tap) Write(b []byte) (int, error) {
	if t.status == 0 {
		t.status = http.StatusOK
	}
	n, err := t.ResponseWriter.Write(b)
	t.keep(b[:n])
	return n, err
}

func (t *Tap) keep(b []byte) {
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
func (t *Tap) countEvents(b []byte) {
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
func (t *Tap) lastBytes() []byte {
	if !t.full {
		return t.tail
	}
	return append(append([]byte(nil), t.tail[t.ring:]...), t.tail[:t.ring]...)
}

// observed fills o from the answer: the model it names, its usage and the
// bytes of generated text (for a stream: every byte streamed, an upper
// bound). events is a stream's event count (0 for a whole answer). ok is
// false when the answer was not a successful completion.
func (t *Tap) observed(o *audit.Observed, stream bool) (events int, ok bool) {
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

// completion returns the whole answer, when it was kept whole (its first
// maxTapHead bytes were all of it) and was a successful completion.
func (t *Tap) completion(stream bool) (audit.Completion, bool) {
	if t.status != http.StatusOK || t.bytes > len(t.head) {
		return audit.Completion{}, false
	}
	if !stream {
		c, err := audit.ParseCompletion(t.head)
		return c, err == nil
	}
	var c audit.Completion
	done := false
	for line := range bytes.SplitSeq(t.head, []byte("\n")) {
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			done = true
			continue
		}
		if c.StreamChunk(data) != nil {
			return audit.Completion{}, false
		}
	}
	return c, done
}
