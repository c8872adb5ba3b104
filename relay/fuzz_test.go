package relay

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/transport"
)

// Valid upstream streams the fuzz targets start from.
var sseSeeds = []string{
	"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n",
	"data:{\"a\":1}\r\n\r\n: keep-alive\r\n\r\ndata: [DONE]\r\n\r\n",
	"event: message\nid: 7\nretry: 1000\ndata: {\"x\":\ndata: 2}\n\n",
	"data: {\"a\":1}\n\ndata: [DONE]\n", // no final blank line
	"data: {\"a\":1}\n\ndata: {\"choi",  // cut mid-event
	"<html><body>It works!</body></html>",
	"data: not json\n\n",
	"error: {\"code\":500}\n\n",
	"\r\r\rdata: {}\r\r",
	"data:\n\ndata: \n\n: ping\n\ndata: [DONE]\n\n", // empty keep-alives
}

// checkEvents fails t unless out is a sequence of whole, well-formed
// server-sent events, as the relay promises its clients; errorAllowed says
// whether the last may be an OpenAI error event. It returns the data of the
// events.
func checkEvents(t *testing.T, out []byte, errorAllowed bool) []string {
	t.Helper()
	if len(out) == 0 {
		return nil
	}
	if !bytes.HasSuffix(out, []byte("\n\n")) {
		t.Fatalf("output does not end with a blank line: %q", out)
	}
	var datas []string
	events := strings.Split(strings.TrimSuffix(string(out), "\n\n"), "\n\n")
	for i, ev := range events {
		if ev == "" || strings.ContainsRune(ev, '\r') {
			t.Fatalf("event %d empty or with CR: %q in %q", i, ev, out)
		}
		var data []string
		for _, line := range strings.Split(ev, "\n") {
			if strings.HasPrefix(line, ":") {
				continue
			}
			name, value, _ := strings.Cut(line, ":")
			value = strings.TrimPrefix(value, " ")
			switch name {
			case "data":
				data = append(data, value)
			case "event", "id", "retry":
			default:
				t.Fatalf("event %d has field %q: %q", i, name, out)
			}
		}
		if data == nil {
			continue
		}
		d := strings.Join(data, "\n")
		if d != "[DONE]" && !json.Valid([]byte(d)) {
			t.Fatalf("event %d data is neither JSON nor [DONE]: %q", i, d)
		}
		if strings.HasPrefix(d, `{"error":`) && i != len(events)-1 && errorAllowed {
			// Only the relay's own error event must come last; an agent
			// may stream error objects of its own, which are JSON too.
			continue
		}
		datas = append(datas, d)
	}
	return datas
}

// FuzzSSEFramer feeds arbitrary bytes, cut at an arbitrary point, to the
// event framer: the output is always whole, well-formed events, and it does
// not depend on how the input was cut.
func FuzzSSEFramer(f *testing.F) {
	for i, s := range sseSeeds {
		f.Add([]byte(s), uint16(i*7))
	}
	f.Fuzz(func(t *testing.T, in []byte, cut uint16) {
		run := func(parts ...[]byte) ([]byte, error) {
			var fr sseFramer
			var out []byte
			for _, p := range parts {
				var err error
				if out, err = fr.feed(out, p); err != nil {
					return out, err
				}
			}
			return fr.end(out)
		}
		whole, errWhole := run(in)
		c := int(cut) % (len(in) + 1)
		split, errSplit := run(in[:c], in[c:])
		checkEvents(t, whole, false)
		checkEvents(t, split, false)
		if (errWhole == nil) != (errSplit == nil) {
			t.Fatalf("cut at %d changes the verdict: %v vs %v", c, errWhole, errSplit)
		}
		// A CR at the cut may end a line early in one run and not the
		// other only when the error comes first, so on success the
		// outputs agree byte for byte.
		if errWhole == nil && !bytes.Equal(whole, split) {
			t.Fatalf("cut at %d changes the output:\n%q\n%q", c, whole, split)
		}
	})
}

// cannedTransport answers every request with the next canned response:
// status, content type and body, delivered in chunks of chunk bytes.
type cannedTransport struct {
	mu     sync.Mutex
	status int
	ctype  string
	body   []byte
	chunk  int
}

func (ct *cannedTransport) set(status int, ctype string, body []byte, chunk int) {
	ct.mu.Lock()
	ct.status, ct.ctype, ct.body, ct.chunk = status, ctype, body, chunk
	ct.mu.Unlock()
}

func (ct *cannedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
	}
	ct.mu.Lock()
	status, ctype, body, chunk := ct.status, ct.ctype, ct.body, ct.chunk
	ct.mu.Unlock()
	return &http.Response{
		StatusCode:    status,
		Header:        http.Header{"Content-Type": {ctype}},
		Body:          io.NopCloser(&chunkReader{b: body, n: max(chunk, 1)}),
		ContentLength: -1,
		Request:       req,
	}, nil
}

// chunkReader returns at most n bytes per Read, as a network would.
type chunkReader struct {
	b []byte
	n int
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	k := copy(p[:min(len(p), c.n)], c.b)
	c.b = c.b[k:]
	return k, nil
}

// newFuzzRelay returns a relay with two agents whose answers all come from
// a cannedTransport. A new one per run keeps runs independent (breakers).
func newFuzzRelay() (*Relay, *cannedTransport) {
	ct := &cannedTransport{status: 200, ctype: "application/json", body: []byte("{}")}
	r, err := New(Config{NoP2P: true, NoAuth: true, Transport: ct, Logger: zerolog.Nop(),
		IdleTimeout: 5 * time.Second, TTFBTimeout: 5 * time.Second,
		RestartHold: time.Millisecond}) // a model no agent serves: its 404 without the restart's wait for agents
	if err != nil {
		panic(err)
	}
	for _, n := range []string{"a", "b"} {
		if err := r.Registry().Joined(peer.ID("peer-"+n), transport.JoinInfo{Name: n, Models: []string{"m1"}}); err != nil {
			panic(err)
		}
	}
	return r, ct
}

// FuzzStreamRelay sends arbitrary agent bytes through the relay's whole
// streaming path (retries, commit, copier, framer): the request always
// ends, and the client gets either whole, well-formed events (the last of
// which may be the relay's error event) or an OpenAI error.
func FuzzStreamRelay(f *testing.F) {
	for i, s := range sseSeeds {
		f.Add([]byte(s), uint8(1+i*5), true)
	}
	f.Add([]byte(`{"id":"x","choices":[]}`), uint8(3), false)
	f.Add([]byte(`<html>`), uint8(3), false)
	f.Fuzz(func(t *testing.T, body []byte, chunk uint8, sse bool) {
		r, ct := newFuzzRelay()
		defer r.Close()
		ctype := "application/json"
		if sse {
			ctype = "text/event-stream"
		}
		ct.set(200, ctype, body, int(chunk))
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(`{"model":"m1","stream":true}`))
		r.Handler().ServeHTTP(rec, req)
		out := rec.Body.Bytes()
		switch {
		case rec.Code == 200 && sse:
			checkEvents(t, out, true)
		case rec.Code == 200:
			if !json.Valid(out) {
				t.Fatalf("200 with a non-JSON body %q", out)
			}
		case rec.Code == http.StatusBadGateway || rec.Code == http.StatusServiceUnavailable:
			var e errorBody
			if err := json.Unmarshal(out, &e); err != nil || e.Error.Message == "" || e.Error.Code == "" {
				t.Fatalf("%d with body %q", rec.Code, out)
			}
			if sse {
				t.Fatalf("a streamed answer was refused before its first event: %d", rec.Code)
			}
		default:
			t.Fatalf("status %d, body %q", rec.Code, out)
		}
	})
}

// FuzzInferenceRequest sends arbitrary request bodies through the relay's
// handler to a healthy agent: the answer is the agent's (200) or a 4xx in
// OpenAI's error shape, never a 5xx or a panic.
func FuzzInferenceRequest(f *testing.F) {
	for _, s := range []string{
		chatBody,
		`{"model":"m1","stream":true,"prompt_cache_key":"k","messages":[]}`,
		`{"model":"m1","messages":"hi"}`,
		`{"model":7}`,
		`{"model":"nope"}`,
		`{"model":"m1"`,
		`[]`,
	} {
		f.Add([]byte(s), "sess")
	}
	f.Fuzz(func(t *testing.T, body []byte, session string) {
		r, ct := newFuzzRelay()
		defer r.Close()
		ct.set(200, "application/json", []byte(`{"ok":true}`), 64)
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("POST", "/v1/chat/completions", bytes.NewReader(body))
		if session != "" && !strings.ContainsAny(session, "\r\n\x00") {
			req.Header.Set("X-Session-ID", session)
		}
		r.Handler().ServeHTTP(rec, req)
		if rec.Code == 200 {
			if rec.Body.String() != `{"ok":true}` {
				t.Fatalf("200 with %q", rec.Body.String())
			}
			return
		}
		if rec.Code < 400 || rec.Code >= 500 {
			t.Fatalf("status %d for body %q", rec.Code, body)
		}
		var e errorBody
		if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" || e.Error.Code == "" {
			t.Fatalf("%d with body %q", rec.Code, rec.Body.String())
		}
	})
}
