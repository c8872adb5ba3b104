package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"sync"

	"github.com/computeflux/computeflux/scheduler"
)

// maxHashedBody bounds the request body the agent reads to hash it; larger
// bodies pass through unhashed (the relay refuses them anyway).
const maxHashedBody = 32 << 20

// maxUsageEvent bounds one server-sent event held back to look for usage;
// a longer event passes through unread.
const maxUsageEvent = 1 << 20

// maxUsageJSON bounds the non-streamed answer kept to read its usage.
const maxUsageJSON = 4 << 20

// servedKey carries a request's prefix state from ServeHTTP to the
// response hook.
type servedKey struct{}

// servedReq is one request's prefix state.
type servedReq struct {
	chain []uint64
	// strip: the engine was asked for a usage chunk the client did not ask
	// for; it is not passed on.
	strip bool
}

// indexRequest reads r's body, hashes its prompt for the index and, for a
// stream whose client did not ask for usage, asks the engine for it. It
// returns the request to forward.
func (a *Agent) indexRequest(r *http.Request) *http.Request {
	if a.index == nil || r.Body == nil {
		return r
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxHashedBody+1))
	if err != nil || len(body) > maxHashedBody {
		// Forward what was read and the rest as it comes, unhashed.
		r.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(body), r.Body), r.Body}
		return r
	}
	st := &servedReq{chain: scheduler.PromptBlocks(nil, body, a.index.cfg.Prefix)}
	if out, ok := askUsage(body); ok {
		body, st.strip = out, true
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.Header.Set("Content-Length", strconv.Itoa(len(body)))
	return r.WithContext(context.WithValue(r.Context(), servedKey{}, st))
}

// askUsage returns body with stream_options.include_usage set, when body is
// a streamed request that does not ask for usage already.
func askUsage(body []byte) ([]byte, bool) {
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
		i := bytes.IndexByte(body, '{')
		out := make([]byte, 0, len(body)+48)
		out = append(out, body[:i+1]...)
		out = append(out, `"stream_options":{"include_usage":true},`...)
		return append(out, body[i+1:]...), true
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

// observeResponse is the proxy's response hook: a successful answer to an
// indexed request puts its prompt in the index and, once the body has been
// read, corrects the index from the answer's usage.
func (a *Agent) observeResponse(resp *http.Response) error {
	st, _ := resp.Request.Context().Value(servedKey{}).(*servedReq)
	if st == nil || a.index == nil || resp.StatusCode/100 != 2 {
		return nil
	}
	a.index.served(st.chain)
	ub := &usageBody{
		rc:    resp.Body,
		sse:   bytes.HasPrefix([]byte(resp.Header.Get("Content-Type")), []byte("text/event-stream")),
		strip: st.strip,
	}
	ub.done = func(u usage) {
		if u.seen {
			a.index.answered(st.chain, u.prompt, u.cached)
		}
	}
	if !ub.sse {
		ub.strip = false
	}
	resp.Body = ub
	if ub.strip {
		resp.ContentLength = -1
		resp.Header.Del("Content-Length")
	}
	return nil
}

// usage is what an answer said about its prompt.
type usage struct {
	seen           bool
	prompt, cached int
}

// usageFields is the part of an answer (or a stream chunk) read for usage.
type usageFields struct {
	Choices []json.RawMessage `json:"choices"`
	Usage   *struct {
		PromptTokens int `json:"prompt_tokens"`
		Details      *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func (f *usageFields) usage() usage {
	if f.Usage == nil {
		return usage{}
	}
	u := usage{seen: true, prompt: f.Usage.PromptTokens}
	if f.Usage.Details != nil {
		u.cached = f.Usage.Details.CachedTokens
	}
	return u
}

// usageBody passes an engine's answer on while reading its usage: for a
// non-streamed answer from the JSON at its end, for a stream from the
// usage chunk, which it drops when strip is set (the client did not ask for
// it). Events are cut at blank lines ("\n\n").
type usageBody struct {
	rc    io.ReadCloser
	sse   bool
	strip bool
	done  func(usage)

	in     []byte // stream bytes not yet cut into events
	out    []byte // bytes ready for the reader
	outPos int
	rbuf   []byte
	err    error // the upstream's read error, once seen
	kept   []byte
	over   bool // the JSON answer was larger than maxUsageJSON
	u      usage
	once   sync.Once
}

func (b *usageBody) Read(p []byte) (int, error) {
	if !b.sse {
		n, err := b.rc.Read(p)
		if !b.over {
			if len(b.kept)+n > maxUsageJSON {
				b.over, b.kept = true, nil
			} else {
				b.kept = append(b.kept, p[:n]...)
			}
		}
		if err == io.EOF {
			b.finish()
		}
		return n, err
	}
	for {
		if b.outPos < len(b.out) {
			n := copy(p, b.out[b.outPos:])
			b.outPos += n
			return n, nil
		}
		if b.err != nil {
			if b.err == io.EOF {
				b.finish()
			}
			return 0, b.err
		}
		b.out, b.outPos = b.out[:0], 0
		if b.rbuf == nil {
			b.rbuf = make([]byte, 32<<10)
		}
		n, err := b.rc.Read(b.rbuf)
		b.in = append(b.in, b.rbuf[:n]...)
		b.cut()
		if err != nil {
			b.out = append(b.out, b.in...)
			b.in = b.in[:0]
			b.err = err
		} else if len(b.in) > maxUsageEvent {
			b.out = append(b.out, b.in...)
			b.in = b.in[:0]
		}
	}
}

// cut moves the complete events of b.in to b.out, reading (and maybe
// dropping) the usage chunk.
func (b *usageBody) cut() {
	start := 0
	for {
		i := bytes.Index(b.in[start:], []byte("\n\n"))
		if i < 0 {
			break
		}
		ev := b.in[start : start+i+2]
		start += i + 2
		if b.usageOnly(ev) && b.strip {
			continue
		}
		b.out = append(b.out, ev...)
	}
	b.in = b.in[:copy(b.in, b.in[start:])]
}

// usageOnly reads an event's usage and reports whether the event is a
// usage chunk (no choices).
func (b *usageBody) usageOnly(ev []byte) bool {
	if !bytes.Contains(ev, []byte(`"usage"`)) {
		return false
	}
	var data []byte
	for line := range bytes.Lines(ev) {
		if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = append(data, bytes.TrimSpace(d)...)
		}
	}
	var f usageFields
	if json.Unmarshal(data, &f) != nil || f.Usage == nil {
		return false
	}
	b.u = f.usage()
	return len(f.Choices) == 0
}

func (b *usageBody) finish() {
	b.once.Do(func() {
		if !b.sse && !b.over {
			var f usageFields
			if json.Unmarshal(b.kept, &f) == nil {
				b.u = f.usage()
			}
			b.kept = nil
		}
		b.done(b.u)
	})
}

// Close closes the engine's body; an answer cut short corrects nothing.
func (b *usageBody) Close() error {
	b.once.Do(func() { b.done(usage{}) })
	return b.rc.Close()
}
