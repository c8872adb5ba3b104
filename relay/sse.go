package relay

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"unicode/utf8"

	"github.com/computeflux/computeflux/scheduler/jsonscan"
)

// Checks on what agents send back. An agent is a machine in someone's home
// in front of whatever answers on its upstream port; the relay does not pass
// garbage on to clients as if it were an answer:
//   - an event stream is re-framed event by event: every event the client
//     gets is whole, its fields known, its data JSON or "[DONE]"; a malformed
//     one ends the stream with an OpenAI-style error event;
//   - a non-streamed successful answer must be JSON; one that is not (an
//     HTML page, a truncated body) counts as the agent's failure and is
//     retried elsewhere, since nothing has reached the client yet.

// ErrBadUpstream is the cause when an agent's answer is malformed: a
// non-JSON body on success, or a malformed server-sent event.
var ErrBadUpstream = errors.New("agent sent a malformed response")

// maxEventBytes bounds one server-sent event (an OpenAI chunk is a few
// hundred bytes; one with log probabilities a few kilobytes).
const maxEventBytes = 1 << 20

// maxCheckedBody bounds the non-streamed answers the relay reads whole to
// check before the client sees them; larger ones pass through unchecked.
const maxCheckedBody = 8 << 20

// sseFramer cuts an agent's event stream into whole events and checks each.
// Line ends (CRLF, CR, LF) come out as LF; each event ends with a blank
// line. The zero value is ready.
type sseFramer struct {
	line    []byte // the current line, without its end
	ev      []byte // the current event's lines, each ending in '\n'
	data    []byte // the current event's data, lines joined by '\n'
	hasData bool
	afterCR bool // the last byte seen was '\r': a '\n' next belongs to it
	failed  bool
	// usage is what the stream's events said about its tokens; chunks
	// counts the events with data other than "[DONE]" passed on.
	usage  tokenUsage
	chunks int64
	// dropUsage is set when the agent asked its engine for a usage chunk
	// the client did not ask for (HeaderUsage): the framer reads it and
	// does not pass it on.
	dropUsage bool
}

// readUsage notes the usage an event's data carries, and reports whether
// the event is to be dropped: a usage chunk the client did not ask for.
func (f *sseFramer) readUsage(data []byte) bool {
	if !bytes.Contains(data, usageKey) {
		return false
	}
	u := f.usage
	u.Seen = false
	if u.scanTail(data); !u.Seen {
		return false
	}
	f.usage = u
	return f.dropUsage && usageChunk(data)
}

// usageChunk reports whether a chunk is the usage chunk that ends an
// OpenAI stream: a top-level usage object and no choices (not, say, a
// Responses event whose response carries its usage).
func usageChunk(data []byte) bool {
	choices, usage := false, false
	jsonscan.Object(data, func(k, v []byte) {
		switch string(k) {
		case "choices":
			choices = len(v) > 0 && v[0] == '[' && len(bytes.TrimSpace(v[1:len(v)-1])) > 0
		case "usage":
			usage = len(v) > 0 && v[0] == '{'
		}
	})
	return usage && !choices
}

// feed appends to dst the whole events that p completes. After an error
// the stream is broken and feed keeps failing.
func (f *sseFramer) feed(dst, p []byte) ([]byte, error) {
	if f.failed {
		return dst, ErrBadUpstream
	}
	for len(p) > 0 {
		if f.afterCR {
			f.afterCR = false
			if p[0] == '\n' {
				p = p[1:]
				continue
			}
		}
		i := bytes.IndexAny(p, "\r\n")
		if i < 0 {
			f.line = append(f.line, p...)
			if len(f.line)+len(f.ev) > maxEventBytes {
				return dst, f.fail()
			}
			return dst, nil
		}
		f.line = append(f.line, p[:i]...)
		f.afterCR = p[i] == '\r'
		p = p[i+1:]
		var err error
		if dst, err = f.endLine(dst); err != nil {
			return dst, err
		}
	}
	return dst, nil
}

// end is called when the agent's stream ended cleanly. An event the agent
// left without its closing blank line is delivered if it is whole and
// valid; anything else is an error.
func (f *sseFramer) end(dst []byte) ([]byte, error) {
	if f.failed {
		return dst, ErrBadUpstream
	}
	var err error
	if len(f.line) > 0 {
		if dst, err = f.endLine(dst); err != nil {
			return dst, err
		}
	}
	if len(f.ev) > 0 {
		return f.endLine(dst) // the missing blank line
	}
	return dst, nil
}

func (f *sseFramer) fail() error {
	f.failed = true
	return ErrBadUpstream
}

// endLine handles one whole line (f.line).
func (f *sseFramer) endLine(dst []byte) ([]byte, error) {
	line := f.line
	f.line = f.line[:0]
	if len(line) == 0 {
		if len(f.ev) == 0 {
			return dst, nil // blank lines between events carry nothing
		}
		switch {
		case f.hasData && len(bytes.TrimSpace(f.data)) == 0:
			// An empty data event (a keep-alive of some servers) would
			// make OpenAI's SDKs fail to parse it: drop it.
		case f.hasData && !validData(f.data):
			return dst, f.fail()
		case f.hasData && f.readUsage(f.data):
			// A usage chunk the client did not ask for: read, not passed on.
		default:
			if f.hasData && string(f.data) != "[DONE]" {
				f.chunks++
			}
			dst = append(dst, f.ev...)
			dst = append(dst, '\n')
		}
		f.ev, f.data, f.hasData = f.ev[:0], f.data[:0], false
		return dst, nil
	}
	if !utf8.Valid(line) || len(f.ev)+len(line) > maxEventBytes {
		return dst, f.fail()
	}
	if line[0] != ':' { // ':' starts a comment (keep-alive)
		name, value, colon := bytes.Cut(line, []byte(":"))
		if colon && len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
		switch string(name) {
		case "data":
			if f.hasData {
				f.data = append(f.data, '\n')
			}
			f.data = append(f.data, value...)
			f.hasData = true
		case "event", "id":
			if bytes.IndexByte(value, 0) >= 0 {
				return dst, f.fail()
			}
		case "retry":
			if len(value) == 0 || len(value) > 10 || len(bytes.Trim(value, "0123456789")) > 0 {
				return dst, f.fail()
			}
		default:
			return dst, f.fail()
		}
	}
	f.ev = append(f.ev, line...)
	f.ev = append(f.ev, '\n')
	return dst, nil
}

// validData reports whether an event's data is what OpenAI streams carry:
// a JSON value or the "[DONE]" marker.
func validData(d []byte) bool {
	return string(d) == "[DONE]" || json.Valid(d)
}

// writeUpstream passes bytes of the agent's body to the client: as they
// are, or, for event streams, as whole checked events. werr is the
// client's error, ferr the agent's (a malformed event).
func (s *streamCopier) writeUpstream(p []byte) (werr, ferr error) {
	if s.frame == nil {
		return s.write(p), nil
	}
	s.out, ferr = s.frame.feed(s.out[:0], p)
	return s.write(s.out), ferr
}

// endUpstream is called when the agent's body ended cleanly.
func (s *streamCopier) endUpstream() (werr, ferr error) {
	if s.frame == nil {
		return nil, nil
	}
	s.out, ferr = s.frame.end(s.out[:0])
	return s.write(s.out), ferr
}

// readChecked reads the rest of a non-streamed answer whose first bytes
// are first (ended by firstErr), up to maxCheckedBody, with the idle
// timeout between reads. It returns what it read and io.EOF when the body
// is whole, nil when it is larger than the bound (the rest is still to be
// read), or the read error. Each read touches wd, which bounds the pauses.
func readChecked(body io.Reader, first []byte, firstErr error, wd wdRef) ([]byte, error) {
	if firstErr != nil {
		return first, firstErr
	}
	data := append(make([]byte, 0, 2*len(first)), first...)
	for len(data) <= maxCheckedBody {
		if len(data) == cap(data) {
			data = append(data, 0)[:len(data)]
		}
		n, err := body.Read(data[len(data):cap(data)])
		data = data[:len(data)+n]
		wd.touch()
		if err != nil {
			return data, err
		}
	}
	return data, nil
}
