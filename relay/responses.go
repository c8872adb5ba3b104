package relay

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/scheduler/slab"
)

// The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id})
// and the Anthropic-style /v1/messages are routed like chat, with two
// additions:
//   - only agents whose engine lists the path (transport.JoinInfo.APIs) may
//     serve it; while none does, agents whose engine's support is unknown
//     (JoinInfo.UnknownAPIs) are tried, and one whose engine turns out to
//     lack the path (transport.HeaderAPIMissing on its answer) is left for
//     the next (its agent tells the relay too, in its next update);
//   - previous_response_id is a hard affinity: the engine that produced a
//     response stores it, so the relay remembers which agent answered each
//     response id and sends the follow-up (and GET, DELETE) there and only
//     there. An id the relay did not see answered, or whose agent left, gets
//     OpenAI's 404, never an answer from an engine that lacks the context.

// Paths of the APIs served only by agents that list them.
const (
	pathResponses = "/v1/responses"
	pathMessages  = "/v1/messages"
)

// maxScanBytes bounds how much of a response the relay reads to find its id.
const maxScanBytes = 64 << 10

// respEntry is where one response lives.
type respEntry struct {
	id    string
	agent string
	peer  peer.ID
	model string
	seen  time.Time // last stored or used
}

// responseStore maps response ids to the agent that holds them: bounded
// (least recently used evicted) and expiring after ttl without use, like
// the scheduler's session table, and built the same way: entries in a
// slab ordered by a slab.List, so a response stored costs no allocation of
// its own once the slab has grown. It is safe for concurrent use.
type responseStore struct {
	ttl time.Duration
	max int

	mu      sync.Mutex // guards the following fields
	byID    map[string]int32
	entries []respEntry // by slot
	order   slab.List   // entries' slots, most recently used first
}

func newResponseStore(ttl time.Duration, max int) *responseStore {
	return &responseStore{ttl: ttl, max: max, byID: make(map[string]int32), order: slab.New()}
}

// put records that agent (peer p) holds response id for model.
func (s *responseStore) put(id, agent string, p peer.ID, model string, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := respEntry{id: id, agent: agent, peer: p, model: model, seen: now}
	if i, ok := s.byID[id]; ok {
		s.entries[i] = e
		s.order.Touch(i)
		return
	}
	i, grew := s.order.Alloc()
	if grew {
		s.entries = append(s.entries, e)
	} else {
		s.entries[i] = e
	}
	s.byID[id] = i
	for len(s.byID) > s.max {
		s.removeLocked(s.order.Tail())
	}
}

// get returns where response id lives and refreshes it; false when unknown
// or expired.
func (s *responseStore) get(id string, now time.Time) (respEntry, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(now)
	i, ok := s.byID[id]
	if !ok {
		return respEntry{}, false
	}
	s.entries[i].seen = now
	s.order.Touch(i)
	return s.entries[i], true
}

// drop forgets response id.
func (s *responseStore) drop(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if i, ok := s.byID[id]; ok {
		s.removeLocked(i)
	}
}

func (s *responseStore) expireLocked(now time.Time) {
	for i := s.order.Tail(); i >= 0 && now.Sub(s.entries[i].seen) > s.ttl; i = s.order.Tail() {
		s.removeLocked(i)
	}
}

func (s *responseStore) removeLocked(i int32) {
	delete(s.byID, s.entries[i].id)
	s.entries[i] = respEntry{} // its strings go with it
	s.order.Release(i)
}

// agentsServing returns the names of the joined agents whose engines list
// path, and of those whose engines may serve it (their support unknown).
// The sets are taken under the registry's lock and then used by the
// scheduler's Allow without it (the registry calls the scheduler under its
// lock, never the other way round).
func (g *Registry) agentsServing(path string) (serving, maybe map[string]bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	serving, maybe = make(map[string]bool), make(map[string]bool)
	for name, e := range g.byName {
		switch {
		case slices.Contains(e.info.APIs, path):
			serving[name] = true
		case slices.Contains(e.info.UnknownAPIs, path):
			maybe[name] = true
		}
	}
	return serving, maybe
}

// lists reports whether agent name's engine is known to serve path.
func (g *Registry) lists(name, path string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	e, ok := g.byName[name]
	return ok && slices.Contains(e.info.APIs, path)
}

// allowServing is the scheduler's Allow for a request to an optional API:
// the agents whose engines serve it, or, while there are none, those whose
// engines may, less any that turned out to lack it in this request.
func allowServing(p *proxied, serving, maybe map[string]bool) func(string) bool {
	if len(serving) == 0 {
		serving = maybe
	}
	return func(id string) bool { return serving[id] && !slices.Contains(p.lacking, id) }
}

// errResponseNotFound is OpenAI's answer for a response id it does not hold.
func errResponseNotFound(id, param string) *Error {
	msg := "Response with id '" + id + "' not found."
	if param == "previous_response_id" {
		msg = "Previous response with id '" + id + "' not found."
	}
	e := &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Message: msg, Param: param}
	if param != "" {
		e.Code = "previous_response_not_found"
	}
	return e
}

// errAPINotServed answers a path no joined agent's engine serves.
func errAPINotServed(path string) *Error {
	return &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "unknown_url",
		Message: "No agent's engine serves " + path + " right now"}
}

// routeAPI completes sr for the paths served only by some engines and
// returns the writer the attempt writes through. For chat, completions and
// embeddings it changes nothing. The Responses fields come from the same
// pass over the body as the other routing fields (parseRouting).
func (r *Relay) routeAPI(p *proxied, rt routing, sr *scheduler.Request) (http.ResponseWriter, error) {
	w, path := p.w, p.req.URL.Path
	if path != pathResponses && path != pathMessages {
		return w, nil
	}
	if path == pathMessages {
		return w, nil // any endpoint: translated where not served (messages.go)
	}
	serving, maybe := r.reg.agentsServing(path)
	store := string(rt.store) != "false"
	if len(rt.previousResponseID) > 0 && string(rt.previousResponseID) != "null" {
		var prev string
		if err := json.Unmarshal(rt.previousResponseID, &prev); err != nil {
			return nil, &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "invalid_type",
				Param: "previous_response_id", Message: "'previous_response_id' must be a string"}
		}
		e, err := r.locateResponse(prev, "previous_response_id")
		if err != nil {
			return nil, err
		}
		sr.Allow = func(id string) bool { return id == e.agent }
	} else {
		if len(serving) == 0 && len(maybe) == 0 {
			return nil, errAPINotServed(path)
		}
		sr.Allow = allowServing(p, serving, maybe)
	}
	if !store {
		return w, nil
	}
	return &responseIDWriter{ResponseWriter: w, r: r, model: rt.model}, nil
}

// locateResponse returns where response id lives, or OpenAI's 404 when the
// relay never saw it answered, it expired, or its agent is gone.
func (r *Relay) locateResponse(id, param string) (respEntry, error) {
	e, ok := r.responses.get(id, r.cfg.Clock.Now())
	if !ok {
		return respEntry{}, errResponseNotFound(id, param)
	}
	if p, ok := r.reg.Peer(e.agent); !ok || p != e.peer {
		// The engine that stored it is out of reach (or another process
		// now holds the name): no other engine has this context.
		r.responses.drop(id)
		return respEntry{}, errResponseNotFound(id, param)
	}
	return e, nil
}

// responseIDWriter passes a Responses answer to the client and records, on
// the way, the response id and the agent that produced it (read from the
// routing header the attempt sets before the status).
type responseIDWriter struct {
	http.ResponseWriter
	r      *Relay
	model  string
	agent  string // set by WriteHeader on a 2xx
	sse    bool
	done   bool // id found, or the scan gave up
	buf    []byte
	status int
}

// Unwrap lets http.ResponseController reach the real writer (Flush,
// deadlines).
func (w *responseIDWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *responseIDWriter) WriteHeader(status int) {
	w.status = status
	if status/100 == 2 {
		// The attempt sets the header under its documented spelling,
		// not the canonical one.
		//lint:ignore SA1008 the key is set without canonicalising (proxy.go)
		if v := w.Header()[HeaderAgent]; len(v) > 0 {
			w.agent = v[0]
		}
		w.sse = strings.HasPrefix(w.Header().Get("Content-Type"), "text/event-stream")
	} else {
		w.done = true
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *responseIDWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.done && w.agent != "" {
		w.buf = append(w.buf, p[:min(len(p), maxScanBytes-len(w.buf))]...)
		if id, ok := scanResponseID(w.buf, w.sse); ok {
			w.done = true
			if pid, ok := w.r.reg.Peer(w.agent); ok {
				w.r.responses.put(id, w.agent, pid, w.model, w.r.cfg.Clock.Now())
			}
		} else if len(w.buf) >= maxScanBytes {
			w.done = true
		}
		if w.done {
			w.buf = nil
		}
	}
	return w.ResponseWriter.Write(p)
}

// scanResponseID finds a Responses API response id at the start of a body:
// the top-level "id" of a response object, or, in an event stream, the
// response.id of its first event that carries one (response.created). It
// returns false while the id may still come.
func scanResponseID(b []byte, sse bool) (string, bool) {
	if !sse {
		return topLevelID(b)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 4096), maxScanBytes)
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
		if !ok {
			continue
		}
		var ev struct {
			Response struct {
				ID string `json:"id"`
			} `json:"response"`
		}
		// A line at the end of b may be cut: it fails to decode and is
		// read again, whole, with the next write.
		if json.Unmarshal(bytes.TrimSpace(data), &ev) == nil && validResponseID(ev.Response.ID) {
			return ev.Response.ID, true
		}
	}
	return "", false
}

// topLevelID reads the object's keys in order up to "id"; a body cut short
// before it returns false.
func topLevelID(b []byte) (string, bool) {
	dec := json.NewDecoder(bytes.NewReader(b))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return "", false
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return "", false
		}
		key, _ := t.(string)
		if key == "id" {
			var id string
			if dec.Decode(&id) == nil && validResponseID(id) {
				return id, true
			}
			return "", false
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return "", false
		}
	}
	return "", false
}

// validResponseID bounds what the relay remembers.
func validResponseID(id string) bool {
	return id != "" && len(id) <= 256
}

// serveStoredResponse serves GET and DELETE /v1/responses/{id}, GET
// /v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel through
// the request path (proxy.go), to the agent holding the response.
func (r *Relay) serveStoredResponse(w http.ResponseWriter, req *http.Request, rest string) {
	id, sub, _ := strings.Cut(rest, "/")
	allowed := "GET, DELETE"
	switch sub {
	case "":
	case "input_items":
		allowed = "GET"
	case "cancel":
		allowed = "POST"
	default:
		writeError(w, errNotFound(req.URL.Path))
		return
	}
	if !slices.Contains(strings.Split(allowed, ", "), req.Method) {
		writeError(w, errMethod(req.Method, allowed))
		return
	}
	r.serveProxied(w, req, req.Method, pathResponses+"/{id}", id)
}

// prepareStored finds the agent holding response id and makes it the only
// route of the request.
func (r *Relay) prepareStored(p *proxied, id string) error {
	e, err := r.locateResponse(id, "")
	if err != nil {
		return err
	}
	req := p.req
	p.rl.model = e.model
	if req.Method == http.MethodPost {
		if p.body, err = readBody(p.w, req, r.cfg.MaxBodyBytes); err != nil {
			return err
		}
	}
	p.method, p.path, p.query = req.Method, req.URL.Path, req.URL.RawQuery
	p.route = &storedRoute{r: r, id: id, agent: e.agent, delete: req.Method == http.MethodDelete}
	return nil
}

// errOnlyHolder ends the attempts of a request about a stored response once
// its agent failed: no other engine holds the response.
var errOnlyHolder = errors.New("no other agent holds the response")

// storedRoute is the route of a request about a stored response: one
// attempt, to the agent that holds it. Outcomes are classified, not fed to
// the scheduler: reading back a stored response says nothing of how fast
// an agent answers a prompt, and takes none of its slots.
type storedRoute struct {
	r      *Relay
	id     string
	agent  string
	delete bool // the request deletes the response
	picked bool
}

// Pick names the holder once.
func (s *storedRoute) Pick() (scheduler.Choice, error) {
	if s.picked {
		return scheduler.Choice{}, errOnlyHolder
	}
	s.picked = true
	return scheduler.Choice{EndpointID: s.agent}, nil
}

// Started does nothing: there is no backlog to release.
func (s *storedRoute) Started(scheduler.Choice) {}

// Report classifies the outcome; a response deleted by its agent is
// forgotten.
func (s *storedRoute) Report(_ scheduler.Choice, o scheduler.Outcome) scheduler.Class {
	cls := scheduler.Classify(o.Status, o.Err)
	if s.delete && cls == scheduler.ClassSuccess {
		s.r.responses.drop(s.id)
	}
	return cls
}

// streamErrorEventFor is the event that ends a stream broken after its
// first byte, in the shape of the stream's own API: the Responses API's
// "error" event, Anthropic's "error" event, or OpenAI's chat error chunk.
func streamErrorEventFor(path, msg, code string) []byte {
	var b []byte
	switch {
	case path == pathResponses || strings.HasPrefix(path, pathResponses+"/"):
		b, _ = json.Marshal(map[string]any{"type": "error", "code": code, "message": msg, "param": nil})
	case path == pathMessages:
		b, _ = json.Marshal(map[string]any{"type": "error", "error": map[string]string{"type": "api_error", "message": msg}})
	default:
		return streamErrorEvent(msg, code)
	}
	out := make([]byte, 0, len(b)+24)
	out = append(out, "event: error\ndata: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}
