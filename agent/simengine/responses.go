package simengine

import (
	"container/list"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"
)

// The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}),
// as vLLM serves it: the engine stores each response (unless store is
// false), and a request naming previous_response_id continues that
// conversation, its earlier turns rendered the same way as before, so the
// follow-up hits the prefix cache. Instructions are rendered as the system
// message of a conversation's first turn only (later ones keep the first
// turn's, which keeps the prefix).

// maxStoredResponses bounds the responses a server keeps (oldest dropped).
const maxStoredResponses = 10_000

// kindResponse is a Responses API request.
const kindResponse kind = 2

// storedResponse is one response the engine keeps.
type storedResponse struct {
	id         string
	transcript string // the prompt and the answer, rendered, for a follow-up
	object     []byte // the response object as sent
}

// responseStore keeps stored responses, oldest evicted first.
type responseStore struct {
	mu    sync.Mutex // guards the following fields
	byID  map[string]*list.Element
	order *list.List // of *storedResponse, oldest at the front
}

func newResponseStore() *responseStore {
	return &responseStore{byID: make(map[string]*list.Element), order: list.New()}
}

func (rs *responseStore) put(sr *storedResponse) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.byID[sr.id] = rs.order.PushBack(sr)
	for rs.order.Len() > maxStoredResponses {
		old := rs.order.Front()
		delete(rs.byID, old.Value.(*storedResponse).id)
		rs.order.Remove(old)
	}
}

func (rs *responseStore) get(id string) (*storedResponse, bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	el, ok := rs.byID[id]
	if !ok {
		return nil, false
	}
	return el.Value.(*storedResponse), true
}

func (rs *responseStore) remove(id string) bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	el, ok := rs.byID[id]
	if ok {
		delete(rs.byID, id)
		rs.order.Remove(el)
	}
	return ok
}

type responsesRequest struct {
	Model              string          `json:"model"`
	Input              json.RawMessage `json:"input"`
	Instructions       *string         `json:"instructions"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Stream             bool            `json:"stream"`
	Store              *bool           `json:"store"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
}

type inputItem struct {
	Type    string          `json:"type"`
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// respMeta is what a Responses request carries besides the generation.
type respMeta struct {
	prev  string
	store bool
}

// parseResponses parses a /v1/responses body; prev is the transcript of
// previous_response_id (looked up by the caller).
func parseResponses(body []byte, lookup func(id string) (string, bool)) (*genRequest, respMeta, error) {
	var rr responsesRequest
	if err := decode(body, &rr); err != nil {
		return nil, respMeta{}, err
	}
	maxTokens, err := checkCommon(rr.MaxOutputTokens, nil)
	if err != nil {
		return nil, respMeta{}, err
	}
	meta := respMeta{store: rr.Store == nil || *rr.Store}
	var b strings.Builder
	if rr.PreviousResponseID != nil && *rr.PreviousResponseID != "" {
		meta.prev = *rr.PreviousResponseID
		t, ok := lookup(meta.prev)
		if !ok {
			return nil, meta, &APIError{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "previous_response_not_found",
				Param: "previous_response_id", Message: fmt.Sprintf("Previous response with id '%s' not found.", meta.prev)}
		}
		b.WriteString(t)
	} else if rr.Instructions != nil && *rr.Instructions != "" {
		renderMessage(&b, "system", *rr.Instructions)
	}
	if err := renderInput(&b, rr.Input); err != nil {
		return nil, meta, err
	}
	b.WriteString(chatGenerationPrompt)
	prompt := b.String()
	return &genRequest{kind: kindResponse, model: rr.Model, prompt: prompt, tokens: Tokenize(nil, prompt),
		maxTokens: maxTokens, stream: rr.Stream}, meta, nil
}

// renderInput renders the input: a string (one user message) or an array of
// message items.
func renderInput(b *strings.Builder, raw json.RawMessage) error {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		if s == "" {
			return badRequest("input", "input must not be empty")
		}
		renderMessage(b, "user", s)
		return nil
	}
	var items []inputItem
	if err := json.Unmarshal(raw, &items); err != nil || len(items) == 0 {
		return badRequest("input", "input must be a string or a non-empty array of message items")
	}
	for i, it := range items {
		if it.Type != "" && it.Type != "message" {
			return badRequest(fmt.Sprintf("input[%d].type", i), "input item type %q is not supported", it.Type)
		}
		if it.Role == "" || strings.ContainsAny(it.Role, "\n<|>") {
			return badRequest(fmt.Sprintf("input[%d].role", i), "invalid role %q", it.Role)
		}
		text, err := messageText(it.Content)
		if err != nil {
			return badRequest(fmt.Sprintf("input[%d].content", i), "%v", err)
		}
		renderMessage(b, it.Role, text)
	}
	return nil
}

// newResponseID returns a random id: ids must be unique across engines, since
// a relay maps each to the engine that holds it.
func newResponseID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// responses serves POST /v1/responses.
func (s *Server) responses(w http.ResponseWriter, r *http.Request) error {
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	g, meta, err := parseResponses(body, func(id string) (string, bool) {
		sr, ok := s.stored.get(id)
		if !ok {
			return "", false
		}
		return sr.transcript, true
	})
	if err != nil {
		return err
	}
	g.resp = &respMeta{prev: meta.prev, store: meta.store}
	return s.generate(w, r, g)
}

// storedResponse serves GET and DELETE /v1/responses/{id}.
func (s *Server) storedResponseHandler(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	notFound := &APIError{Status: http.StatusNotFound, Type: "invalid_request_error", Message: fmt.Sprintf("Response with id '%s' not found.", id)}
	if r.Method == http.MethodDelete {
		if !s.stored.remove(id) {
			return notFound
		}
		writeJSON(w, http.StatusOK, map[string]any{"id": id, "object": "response", "deleted": true})
		return nil
	}
	sr, ok := s.stored.get(id)
	if !ok {
		return notFound
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(append(sr.object, '\n'))
	return nil
}

// Responses API objects.
type (
	respUsage struct {
		InputTokens        int `json:"input_tokens"`
		InputTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
		OutputTokens        int `json:"output_tokens"`
		OutputTokensDetails struct {
			ReasoningTokens int `json:"reasoning_tokens"`
		} `json:"output_tokens_details"`
		TotalTokens int `json:"total_tokens"`
	}
	respPart struct {
		Type        string `json:"type"`
		Text        string `json:"text"`
		Annotations []any  `json:"annotations"`
	}
	respItem struct {
		ID      string     `json:"id"`
		Type    string     `json:"type"`
		Status  string     `json:"status"`
		Role    string     `json:"role"`
		Content []respPart `json:"content"`
	}
	respObject struct {
		ID                 string     `json:"id"`
		Object             string     `json:"object"`
		CreatedAt          int64      `json:"created_at"`
		Status             string     `json:"status"`
		Model              string     `json:"model"`
		Output             []respItem `json:"output"`
		PreviousResponseID *string    `json:"previous_response_id"`
		Store              bool       `json:"store"`
		Usage              *respUsage `json:"usage"`
	}
)

// responsesWriter writes one request's answer in the Responses API's shapes
// and stores the response when asked to.
type responsesWriter struct {
	s       *Server
	w       http.ResponseWriter
	g       *genRequest
	obj     respObject
	itemID  string
	text    strings.Builder
	seq     int
	started bool
	buf     []byte
}

func newResponsesWriter(s *Server, w http.ResponseWriter, g *genRequest, model string) *responsesWriter {
	rw := &responsesWriter{s: s, w: w, g: g, itemID: newResponseID("msg_")}
	rw.obj = respObject{ID: newResponseID("resp_"), Object: "response", CreatedAt: time.Now().Unix(),
		Status: "in_progress", Model: model, Output: []respItem{}, Store: g.resp.store}
	if g.resp.prev != "" {
		prev := g.resp.prev
		rw.obj.PreviousResponseID = &prev
	}
	return rw
}

func (o *responsesWriter) hasStarted() bool { return o.started }

func (o *responsesWriter) item(status string) respItem {
	it := respItem{ID: o.itemID, Type: "message", Status: status, Role: "assistant", Content: []respPart{}}
	if status == "completed" {
		it.Content = []respPart{{Type: "output_text", Text: o.text.String(), Annotations: []any{}}}
	}
	return it
}

// finish completes the object and stores it.
func (o *responsesWriter) finish(u Usage) []byte {
	o.obj.Status = "completed"
	o.obj.Output = []respItem{o.item("completed")}
	ru := &respUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, TotalTokens: u.PromptTokens + u.CompletionTokens}
	ru.InputTokensDetails.CachedTokens = u.CachedTokens
	o.obj.Usage = ru
	b, _ := json.Marshal(&o.obj) // plain structs: cannot fail
	if o.obj.Store {
		o.s.stored.put(&storedResponse{id: o.obj.ID, transcript: o.g.prompt + o.text.String() + "<|im_end|>\n", object: b})
	}
	return b
}

func (o *responsesWriter) whole(text, _ string, u Usage) error {
	o.text.WriteString(text)
	b := o.finish(u)
	o.w.Header().Set("Content-Type", "application/json")
	o.w.WriteHeader(http.StatusOK)
	_, _ = o.w.Write(append(b, '\n'))
	return nil
}

func (o *responsesWriter) event(typ string, fields map[string]any) {
	fields["type"] = typ
	fields["sequence_number"] = o.seq
	o.seq++
	b, _ := json.Marshal(fields)
	o.buf = append(o.buf, "event: "...)
	o.buf = append(o.buf, typ...)
	o.buf = append(o.buf, "\ndata: "...)
	o.buf = append(o.buf, b...)
	o.buf = append(o.buf, "\n\n"...)
}

func (o *responsesWriter) chunks(pieces []string) error {
	if !o.started {
		startStream(o.w)
		o.started = true
		snap := o.obj
		o.event("response.created", map[string]any{"response": &snap})
		o.event("response.in_progress", map[string]any{"response": &snap})
		o.event("response.output_item.added", map[string]any{"output_index": 0, "item": o.item("in_progress")})
		o.event("response.content_part.added", map[string]any{"item_id": o.itemID, "output_index": 0, "content_index": 0,
			"part": respPart{Type: "output_text", Text: "", Annotations: []any{}}})
	}
	for _, p := range pieces {
		o.text.WriteString(p)
		o.event("response.output_text.delta", map[string]any{"item_id": o.itemID, "output_index": 0, "content_index": 0,
			"delta": p, "logprobs": []any{}})
	}
	return o.flush()
}

func (o *responsesWriter) end(_ string, u Usage) error {
	text := o.text.String()
	o.event("response.output_text.done", map[string]any{"item_id": o.itemID, "output_index": 0, "content_index": 0,
		"text": text, "logprobs": []any{}})
	o.event("response.content_part.done", map[string]any{"item_id": o.itemID, "output_index": 0, "content_index": 0,
		"part": respPart{Type: "output_text", Text: text, Annotations: []any{}}})
	o.event("response.output_item.done", map[string]any{"output_index": 0, "item": o.item("completed")})
	o.finish(u)
	o.event("response.completed", map[string]any{"response": &o.obj})
	return o.flush()
}

func (o *responsesWriter) flush() error { return flushStream(o.w, &o.buf) }
