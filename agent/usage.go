package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/scheduler/jsonscan"
	"github.com/computeflux/computeflux/transport"
	"github.com/computeflux/computeflux/transport/usage"
)

// maxHashedBody bounds the request body the agent reads to hash it; larger
// bodies pass through unhashed (the relay refuses them anyway).
const maxHashedBody = 32 << 20

// maxUsageEvent bounds one server-sent event held back to look for usage;
// a longer event passes through unread.
const maxUsageEvent = 1 << 20

// maxUsageJSON bounds the non-streamed answer kept to read its usage.
const maxUsageJSON = 4 << 20

// servedReq is one request's prefix state.
type servedReq struct {
	chain []uint64
	// strip: the engine was asked for a usage chunk the client did not ask
	// for; it is not passed on.
	strip bool
	// added: the engine was asked for a usage chunk the client did not
	// ask for, and the relay drops it (transport.HeaderUsage).
	added  bool
	body   usageBody    // the answer's reader, allocated with the request's state
	reader bytes.Reader // the request body forwarded
}

// indexRequest hashes r's prompt for the index and, for a stream whose
// client did not ask for usage, asks the engine for it: it sets r's body to
// the one to forward and returns the request's prefix state (nil when not
// indexed). body is r's body when the stream server read it already
// (transport.BodyHandler; r.Body then reads the same bytes and is
// forwarded as it is unless rewritten); nil means indexRequest reads r.Body.
func (a *Agent) indexRequest(r *http.Request, body []byte) *servedReq {
	if a.index == nil || r.Body == nil {
		return nil
	}
	buffered := body != nil
	if !buffered {
		var err error
		body, err = io.ReadAll(io.LimitReader(r.Body, maxHashedBody+1))
		if err != nil || len(body) > maxHashedBody {
			// Forward what was read and the rest as it comes, unhashed.
			r.Body = struct {
				io.Reader
				io.Closer
			}{io.MultiReader(bytes.NewReader(body), r.Body), r.Body}
			return nil
		}
	} else if len(body) > maxHashedBody {
		return nil
	}
	st := &servedReq{chain: scheduler.PromptBlocks(chainRoom(len(body), a.index.cfg.Prefix), body, a.index.cfg.Prefix)}
	keep := r.Header.Get(transport.HeaderUsage) == transport.UsageKeep
	r.Header.Del(transport.HeaderUsage)
	out, rewritten := askUsage(body)
	if rewritten {
		body, st.strip, st.added = out, !keep, keep
	} else if buffered {
		return st // r.Body reads body, unread
	}
	st.reader.Reset(body)
	// io.NopCloser over a *bytes.Reader: net/http sees a body in memory and
	// writes the request in one write. The request's Content-Length field
	// is what goes out (its Header's is never written: outHeader drops it).
	r.Body = io.NopCloser(&st.reader)
	r.ContentLength = int64(len(body))
	return st
}

// chainRoom returns an empty chain with room for the blocks of a body of n
// bytes (its prompt's canonical text is about as long, without the JSON's
// keys and quotes), so that the chain is one allocation rather than one per
// doubling; nil for a body shorter than a block.
func chainRoom(n int, cfg scheduler.PrefixConfig) []uint64 {
	blocks := min(n/cfg.BlockBytes(), scheduler.DefaultMaxBlocks)
	if cfg.MaxBlocks > 0 {
		blocks = min(blocks, cfg.MaxBlocks)
	}
	if blocks == 0 {
		return nil
	}
	return make([]uint64, 0, blocks)
}

// askUsage returns body with stream_options.include_usage set, when body is
// a streamed request that does not ask for usage already. It decides as
// askUsageJSON does (encoding/json's reading of the body: keys matched
// case-insensitively, the last duplicate wins, malformed JSON rewrites
// nothing) from one allocation-free scan of the top-level keys; only a body
// it is about to rewrite is checked with json.Valid, and anything unusual
// (escaped or non-ASCII keys, stream_options present, a scan that fails)
// goes to askUsageJSON itself. Decoding every POST body with json.Unmarshal
// just to read two keys was a few percent of the agent's CPU.
func askUsage(body []byte) ([]byte, bool) {
	var stream, opts []byte
	if !jsonscan.PlainObject(body, func(k, v []byte) {
		switch {
		case jsonscan.KeyEqualFold(k, "stream"):
			stream = v
		case jsonscan.KeyEqualFold(k, "stream_options"):
			opts = v
		}
	}) {
		return askUsageJSON(body)
	}
	if string(stream) != "true" {
		return nil, false
	}
	if opts != nil {
		// A client that asked for usage itself (map keys match exactly,
		// escapes decoded: a key with escapes is left to encoding/json).
		var inc []byte
		exact := true
		if jsonscan.Object(opts, func(k, v []byte) {
			if bytes.IndexByte(k, '\\') >= 0 {
				exact = false
			} else if string(k) == "include_usage" {
				inc = v
			}
		}) && exact && string(inc) == "true" {
			return nil, false
		}
		return askUsageJSON(body)
	}
	if !json.Valid(body) {
		return nil, false
	}
	return insertUsageOption(body), true
}

// insertUsageOption returns the object body with
// "stream_options":{"include_usage":true} as its first key, the rest byte
// for byte.
func insertUsageOption(body []byte) []byte {
	i := bytes.IndexByte(body, '{')
	out := make([]byte, 0, len(body)+48)
	out = append(out, body[:i+1]...)
	out = append(out, `"stream_options":{"include_usage":true},`...)
	return append(out, body[i+1:]...)
}

// askUsageJSON is askUsage with encoding/json: the reference it keeps to,
// and its path for the bodies its scan does not decide.
func askUsageJSON(body []byte) ([]byte, bool) {
	var f struct {
		Stream        json.RawMessage `json:"stream"`
		StreamOptions json.RawMessage `json:"stream_options"`
	}
	if json.Unmarshal(body, &f) != nil || string(f.Stream) != "true" {
		return nil, false
	}
	var opts map[string]json.RawMessage
	if len(f.StreamOptions) > 0 && string(f.StreamOptions) != "null" {
		if json.Unmarshal(f.StreamOptions, &opts) != nil {
			return nil, false // the engine will say what is wrong with it
		}
		if string(opts["include_usage"]) == "true" {
			return nil, false
		}
	}
	if len(f.StreamOptions) == 0 {
		// The common case: insert the option, leave the rest byte for byte.
		return insertUsageOption(body), true
	}
	if opts == nil {
		opts = make(map[string]json.RawMessage, 1)
	}
	opts["include_usage"] = json.RawMessage("true")
	var all map[string]json.RawMessage
	if json.Unmarshal(body, &all) != nil {
		return nil, false
	}
	o, err := json.Marshal(opts)
	if err != nil {
		return nil, false
	}
	all["stream_options"] = o
	out, err := json.Marshal(all)
	if err != nil {
		return nil, false
	}
	return out, true
}

// observeResponse wraps the body of a successful answer to an indexed
// request: it puts the request's prompt in the index and, once the body
// has been read, corrects the index from the answer's usage. sse says
// whether the answer is an event stream.
func (a *Agent) observeResponse(resp *http.Response, st *servedReq, sse bool) {
	if st == nil || a.index == nil || resp.StatusCode/100 != 2 {
		return
	}
	if st.added && sse {
		resp.Header.Set(transport.HeaderUsage, transport.UsageAdded) // the relay drops the chunk
	}
	predicted := a.index.served(st.chain)
	if len(st.chain) == 0 && !(st.strip && sse) {
		// A prompt shorter than a block: no usage would correct anything
		// (answered ignores an empty chain), and no chunk is dropped, so
		// the answer passes as it is.
		return
	}
	ub := &st.body
	ub.rc = resp.Body
	ub.index = a.index
	ub.chain = st.chain
	ub.predicted = predicted
	ub.sse = sse
	ub.strip = st.strip && sse
	ub.length = resp.ContentLength
	resp.Body = ub
	if ub.strip {
		resp.ContentLength = -1
		resp.Header.Del("Content-Length")
	}
}

// isEventStream reports whether a Content-Type is text/event-stream.
func isEventStream(ct string) bool {
	return strings.HasPrefix(ct, "text/event-stream")
}

// readUsage reads an answer (or a stream chunk's data) as encoding/json
// would read its top-level choices and usage: u is what its usage object
// says (usage.Counts.Read; u.Seen false without one); noChoices reports an
// empty or missing choices array; ok is false for what is not a JSON
// object. It scans the top-level keys without allocating; anything its
// scan does not decide as encoding/json would (escaped or non-ASCII keys,
// values of an unexpected type, a scan that fails) goes to readUsageJSON.
// Unmarshalling every answer was most of the agent's encoding/json time,
// and json.Valid alone still showed in its profile: the scan checks the
// structure and the values it reads, not every scalar, so an answer
// malformed only in some other scalar (`tru`) still has its usage read,
// where encoding/json would refuse it. The usage only corrects the prefix
// index's estimate, and the client gets the engine's bytes as they are
// either way.
func readUsage(data []byte) (u usage.Counts, noChoices, ok bool) {
	var choices, usg []byte
	if !jsonscan.PlainObject(data, func(k, v []byte) {
		switch {
		case jsonscan.KeyEqualFold(k, "choices"):
			choices = v
		case jsonscan.KeyEqualFold(k, "usage"):
			usg = v
		}
	}) {
		return readUsageJSON(data)
	}
	switch {
	case choices == nil || string(choices) == "null":
		noChoices = true
	case choices[0] == '[':
		noChoices = len(bytes.TrimSpace(choices[1:len(choices)-1])) == 0
	default:
		return readUsageJSON(data) // a type error
	}
	if usg == nil || string(usg) == "null" {
		return u, noChoices, true
	}
	if usg[0] != '{' {
		return readUsageJSON(data) // a type error
	}
	u.Read(usg)
	return u, noChoices, true
}

// readUsageJSON is readUsage with encoding/json: the reference it keeps
// to, and its path for what its scan does not decide.
func readUsageJSON(data []byte) (u usage.Counts, noChoices, ok bool) {
	var f struct {
		Choices []json.RawMessage `json:"choices"`
		Usage   json.RawMessage   `json:"usage"`
	}
	if json.Unmarshal(data, &f) != nil {
		return u, false, false
	}
	switch {
	case len(f.Usage) == 0 || string(f.Usage) == "null":
	case f.Usage[0] != '{':
		return u, false, false // not an object: encoding/json's type error
	default:
		u.Read(f.Usage)
	}
	return u, len(f.Choices) == 0, true
}

// keptBuffers hold non-streamed answers while their usage is read; only
// buffers up to maxPooledKept go back.
var keptBuffers sync.Pool

const maxPooledKept = 64 << 10

// usageBody passes an engine's answer on while reading its usage: for a
// non-streamed answer from the JSON at its end, for a stream from the
// usage chunk, which it drops when strip is set (the client did not ask for
// it). Events are cut at blank lines ("\n\n", or "\r\n\r\n": eventEnd).
// When the answer has been read to its end, its usage (if any) corrects
// index for chain.
//
// A stream is read into one buffer (from copyBuffers, grown for an event
// longer than it, up to maxUsageEvent) and handed to the reader from there,
// its complete events first checked for usage: buf[lo:ready] is checked and
// waits for the reader, buf[ready:hi] is an event not complete yet. A
// dropped usage chunk is cut out of the buffer. An event longer than
// maxUsageEvent passes through unread.
type usageBody struct {
	rc    io.ReadCloser
	sse   bool
	strip bool
	index *prefixIndex // nil: the usage is only read (u)
	chain []uint64
	// predicted is the index's prediction for chain when the request
	// was served (prefixIndex.served).
	predicted int
	length    int64 // the answer's Content-Length, -1 when unknown

	buf           *[]byte // the stream's bytes; from copyBuffers unless grown
	lo, ready, hi int
	// scan is where the last search for an event's end stopped: buf[ready:
	// scan] holds none, so the next search starts two bytes before it (a
	// blank line's "\n\r\n" may straddle it) instead of at ready, and a
	// long event arriving in small reads is searched once, not once per read.
	scan int
	err  error   // the upstream's read error, once seen
	kept *[]byte // from keptBuffers
	over bool    // the JSON answer was larger than maxUsageJSON
	u    usage.Counts
	done bool // the usage was reported (or the answer cut short)
}

func (b *usageBody) Read(p []byte) (int, error) {
	if !b.sse {
		n, err := b.rc.Read(p)
		if err == io.EOF && b.kept == nil && !b.done {
			// The whole answer in one read (the usual small answer): its
			// usage is read where it is, not from a copy.
			b.finishJSON(p[:n])
			return n, err
		}
		if !b.over && !b.done {
			b.keep(p[:n])
		}
		if err == io.EOF {
			b.finish()
		}
		return n, err
	}
	for {
		if b.lo < b.ready {
			n := copy(p, (*b.buf)[b.lo:b.ready])
			b.lo += n
			return n, nil
		}
		if b.err != nil {
			if b.lo < b.hi {
				b.ready = b.hi // an event cut short passes as it is
				continue
			}
			if b.err == io.EOF {
				b.finish()
			}
			return 0, b.err
		}
		b.fill()
	}
}

// fill reads more of a stream and checks the events it completes; the
// reader has taken everything before b.ready.
func (b *usageBody) fill() {
	if b.buf == nil {
		b.buf = copyBuffers.get()
	}
	buf := *b.buf
	if b.lo > 0 {
		b.hi = copy(buf, buf[b.lo:b.hi])
		b.scan = max(b.scan-b.lo, 0)
		b.lo, b.ready = 0, 0
	}
	if b.hi == len(buf) {
		if len(buf) >= maxUsageEvent {
			b.ready = b.hi // too long to be held back: passed on unread
			b.scan = b.hi
			return
		}
		grown := make([]byte, min(2*len(buf), maxUsageEvent))
		copy(grown, buf[:b.hi])
		b.putBuf()
		b.buf, buf = &grown, grown
	}
	n, err := b.rc.Read(buf[b.hi:])
	b.hi += n
	b.err = err
	for {
		from := max(b.ready, b.scan-2)
		i := eventEnd(buf[from:b.hi])
		if i < 0 {
			b.scan = b.hi
			return
		}
		end := from + i
		if b.usageOnly(buf[b.ready:end]) && b.strip {
			b.hi = b.ready + copy(buf[b.ready:], buf[end:b.hi])
			b.scan = b.ready
			continue
		}
		b.ready = end
	}
}

// eventEnd returns the length of b's first event, the blank line that ends
// it included, or -1 when b holds no complete event. Lines end in "\n" or
// "\r\n" (sse-starlette's default separator, for a server built on it
// that keeps the default); a stream whose lines end in a lone "\r", which
// the format allows too and no engine is known to write, is not cut.
func eventEnd(b []byte) int {
	for i := 0; ; {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			return -1
		}
		i += j + 1 // past a line's end
		if i < len(b) && b[i] == '\n' {
			return i + 1
		}
		if i+1 < len(b) && b[i] == '\r' && b[i+1] == '\n' {
			return i + 2
		}
	}
}

// keep appends p to the answer kept for its usage, in a pooled buffer
// sized from the Content-Length when it is known.
func (b *usageBody) keep(p []byte) {
	if b.kept == nil {
		if v, ok := keptBuffers.Get().(*[]byte); ok {
			b.kept = v
		} else {
			b.kept = new([]byte)
		}
		if b.length > int64(cap(*b.kept)) && b.length <= maxUsageJSON {
			*b.kept = make([]byte, 0, b.length)
		}
	}
	if len(*b.kept)+len(p) > maxUsageJSON {
		b.over = true
		b.release()
		return
	}
	*b.kept = append(*b.kept, p...)
}

// usageOnly reads an event's usage and reports whether the event is a
// usage chunk (no choices).
func (b *usageBody) usageOnly(ev []byte) bool {
	if !bytes.Contains(ev, []byte(`"usage"`)) {
		return false
	}
	var data []byte
	lines := 0
	for line := range bytes.Lines(ev) {
		if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			if lines++; lines == 1 {
				data = bytes.TrimSpace(d) // the usual single line: no copy
			} else {
				if lines == 2 {
					data = append([]byte(nil), data...)
				}
				data = append(data, bytes.TrimSpace(d)...)
			}
		}
	}
	u, noChoices, ok := readUsage(data)
	if !ok || !u.Seen {
		return false
	}
	b.u = u
	return noChoices
}

// finish reads the usage of a non-streamed answer and reports it, once.
func (b *usageBody) finish() {
	var kept []byte // nil for a stream, and past maxUsageJSON
	if b.kept != nil {
		kept = *b.kept
	}
	b.finishJSON(kept)
}

// finishJSON reports the usage, once: for a non-streamed answer (not over
// the bound) read from answer, for a stream the one its chunk gave.
func (b *usageBody) finishJSON(answer []byte) {
	if b.done {
		return
	}
	if !b.sse && !b.over {
		if u, _, ok := readUsage(answer); ok {
			b.u = u
		}
	}
	b.done = true
	b.release()
	if b.index != nil && b.u.Seen {
		b.index.answered(b.chain, b.predicted, int(b.u.Prompt), int(b.u.Cached))
	}
}

// release returns the pooled buffers.
func (b *usageBody) release() {
	if b.kept != nil {
		if cap(*b.kept) <= maxPooledKept {
			*b.kept = (*b.kept)[:0]
			keptBuffers.Put(b.kept)
		}
		b.kept = nil
	}
	if b.err != nil {
		b.putBuf() // Read has returned the upstream's error: it reads no more
	}
}

// putBuf gives the stream's buffer back, unless it was grown.
func (b *usageBody) putBuf() {
	if b.buf != nil && len(*b.buf) == copyBufferSize {
		copyBuffers.put(b.buf)
	}
	b.buf = nil
}

// Close closes the engine's body; an answer cut short corrects nothing.
func (b *usageBody) Close() error {
	b.done = true
	b.err = errBodyClosed
	b.lo, b.ready, b.hi = 0, 0, 0 // what was not read is gone with the buffer
	b.release()
	return b.rc.Close()
}

var errBodyClosed = errors.New("agent: answer body closed")
