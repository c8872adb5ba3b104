package anthropic

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
)

// Chat completions answer shapes, as far as the translation reads them.
type chatUsage struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type chatChoice struct {
	Message *struct {
		Content   *string `json:"content"`
		ToolCalls []struct {
			ID       string       `json:"id"`
			Function chatFunction `json:"function"`
		} `json:"tool_calls"`
	} `json:"message"`
	Delta *struct {
		Content   *string `json:"content"`
		ToolCalls []struct {
			Index    int          `json:"index"`
			ID       string       `json:"id"`
			Function chatFunction `json:"function"`
		} `json:"tool_calls"`
	} `json:"delta"`
	FinishReason *string `json:"finish_reason"`
	// StopReason is vLLM's: the stop string that ended the answer.
	StopReason json.RawMessage `json:"stop_reason"`
}

type chatAnswer struct {
	ID      string          `json:"id"`
	Model   string          `json:"model"`
	Choices []chatChoice    `json:"choices"`
	Usage   *chatUsage      `json:"usage"`
	Error   json.RawMessage `json:"error"`
}

// usage is a Messages answer's usage: input_tokens are the
// prompt's tokens the engine did not find cached.
type usage struct {
	InputTokens              int64 `json:"input_tokens"`
	OutputTokens             int64 `json:"output_tokens"`
	CacheCreationInputTokens int64 `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int64 `json:"cache_read_input_tokens"`
}

func (u *chatUsage) anthropic() usage {
	if u == nil {
		return usage{}
	}
	var cached int64
	if u.PromptTokensDetails != nil {
		cached = min(max(u.PromptTokensDetails.CachedTokens, 0), u.PromptTokens)
	}
	return usage{InputTokens: u.PromptTokens - cached, OutputTokens: u.CompletionTokens, CacheReadInputTokens: cached}
}

// stopReason maps a chat finish_reason to Anthropic's stop_reason and
// stop_sequence.
func stopReason(finish *string, stop json.RawMessage) (string, *string) {
	if finish == nil {
		return "end_turn", nil
	}
	switch *finish {
	case "length":
		return "max_tokens", nil
	case "tool_calls", "function_call":
		return "tool_use", nil
	case "stop":
		var seq string
		if len(stop) > 0 && stop[0] == '"' && json.Unmarshal(stop, &seq) == nil && seq != "" {
			return "stop_sequence", &seq
		}
	}
	return "end_turn", nil
}

// messageID names a translated answer: msg_ and the engine's chat id.
func messageID(chatID string) string {
	id := strings.TrimPrefix(chatID, "chatcmpl-")
	if id == "" {
		id = strconv.FormatUint(uint64(randomID()), 36)
	}
	return "msg_" + id
}

// toolInput is a tool call's arguments as a tool_use block's input: the
// object they are, or an empty one when the engine wrote no object.
func toolInput(args string) json.RawMessage {
	b := bytes.TrimSpace([]byte(args))
	if len(b) > 0 && b[0] == '{' && json.Valid(b) {
		return b
	}
	return json.RawMessage("{}")
}

// toMessage turns a whole chat completion into a Messages answer.
func toMessage(body []byte, model string) ([]byte, error) {
	var a chatAnswer
	if err := json.Unmarshal(body, &a); err != nil {
		return nil, err
	}
	if a.Model != "" {
		model = a.Model
	}
	content := []map[string]any{}
	var finish *string
	var stop json.RawMessage
	if len(a.Choices) > 0 {
		c := a.Choices[0]
		finish, stop = c.FinishReason, c.StopReason
		if c.Message != nil {
			if c.Message.Content != nil && *c.Message.Content != "" {
				content = append(content, map[string]any{"type": "text", "text": *c.Message.Content})
			}
			for _, tc := range c.Message.ToolCalls {
				content = append(content, map[string]any{"type": "tool_use", "id": toolUseID(tc.ID), "name": tc.Function.Name, "input": toolInput(tc.Function.Arguments)})
			}
		}
	}
	reason, seq := stopReason(finish, stop)
	if reason == "end_turn" && hasToolUse(content) {
		reason = "tool_use"
	}
	return json.Marshal(map[string]any{
		"id": messageID(a.ID), "type": "message", "role": "assistant", "model": model,
		"content": content, "stop_reason": reason, "stop_sequence": seq, "usage": a.Usage.anthropic(),
	})
}

func hasToolUse(content []map[string]any) bool {
	for _, c := range content {
		if c["type"] == "tool_use" {
			return true
		}
	}
	return false
}

// toolUseID is a tool call's id as a tool_use id (one is made up when the
// engine gave none).
func toolUseID(id string) string {
	if id != "" {
		return id
	}
	return "toolu_" + strconv.FormatUint(uint64(randomID()), 36)
}

// ErrorType is Anthropic's error type for an HTTP status.
func ErrorType(status int) string {
	switch status {
	case http.StatusBadRequest, http.StatusUnprocessableEntity, http.StatusMethodNotAllowed:
		return "invalid_request_error"
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusServiceUnavailable, 529:
		return "overloaded_error"
	}
	return "api_error"
}

// ErrorJSON is an error answer of status in Anthropic's error envelope.
func ErrorJSON(status int, message string) []byte {
	b, _ := json.Marshal(map[string]any{"type": "error",
		"error": map[string]string{"type": ErrorType(status), "message": message}})
	return b
}

// Writer turns a chat completions answer into a Messages answer on
// its way to the client, w: a whole answer at finish, a stream event by
// event as the copy stage writes them (whole events: sseFramer), an error
// answer into Anthropic's error shape. It is one attempt's, used by the
// request's goroutine only.
type Writer struct {
	w      http.ResponseWriter
	model  string
	max    int // bound of a non-streamed answer's bytes
	status int
	sse    bool
	raw    bool   // pass bytes as they are (the relay's own error event)
	buf    []byte // a whole answer, or a stream's partial event
	// The stream's state.
	started  bool
	ended    bool
	id       string
	open     int             // the open content block's index; -1 for none
	openTool bool            // the open block is a tool_use
	next     int             // the next block's index
	tools    map[int]int     // chat tool call index -> block index
	finish   *string         // the finish_reason seen
	stop     json.RawMessage // vLLM's stop_reason seen
	usage    *chatUsage
	anyTool  bool
}

// NewWriter returns a Writer of an answer to a request for model on its
// way to w. maxBody bounds a non-streamed answer held for translation.
func NewWriter(w http.ResponseWriter, model string, maxBody int) *Writer {
	return &Writer{w: w, model: model, max: maxBody, open: -1}
}

// Unwrap lets http.ResponseController reach the real writer (Flush,
// deadlines).
func (m *Writer) Unwrap() http.ResponseWriter { return m.w }

func (m *Writer) Header() http.Header { return m.w.Header() }

func (m *Writer) WriteHeader(status int) {
	if m.status != 0 {
		return
	}
	m.status = status
	h := m.w.Header()
	m.sse = status/100 == 2 && strings.HasPrefix(h.Get("Content-Type"), "text/event-stream")
	h.Del("Content-Length") // the translation has another length
	if !m.sse {
		h.Set("Content-Type", "application/json")
	}
	m.w.WriteHeader(status)
}

func (m *Writer) Write(p []byte) (int, error) {
	if m.status == 0 {
		m.WriteHeader(http.StatusOK)
	}
	if m.raw {
		return m.w.Write(p)
	}
	if !m.sse {
		if len(m.buf)+len(p) > m.max {
			return 0, fmt.Errorf("answer larger than %d bytes to translate", m.max)
		}
		m.buf = append(m.buf, p...)
		return len(p), nil
	}
	m.buf = append(m.buf, p...)
	var out []byte
	for {
		i := bytes.Index(m.buf, []byte("\n\n"))
		if i < 0 {
			break
		}
		out = m.event(out, m.buf[:i])
		m.buf = m.buf[i+2:]
	}
	if len(out) > 0 {
		if _, err := m.w.Write(out); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// PassRaw makes the writer pass what follows as it is: the relay's own
// error event, already in Anthropic's shape.
func (m *Writer) PassRaw() {
	if m.sse && m.started && !m.ended && m.open >= 0 {
		_, _ = m.w.Write(appendEvent(nil, "content_block_stop", map[string]any{"type": "content_block_stop", "index": m.open}))
	}
	m.raw = true
}

// End completes the answer once the engine's ended cleanly: a whole
// answer is translated and written, a stream gets its closing events.
func (m *Writer) End() error {
	if m.raw {
		return nil
	}
	if m.sse {
		if !m.ended {
			_, err := m.w.Write(m.closeStream(nil))
			return err
		}
		return nil
	}
	var out []byte
	if m.status/100 == 2 {
		b, err := toMessage(m.buf, m.model)
		if err != nil {
			out = ErrorJSON(http.StatusBadGateway, "The engine's answer could not be read as a chat completion")
		} else {
			out = b
		}
	} else {
		out = ErrorJSON(m.status, engineMessage(m.status, m.buf))
	}
	_, err := m.w.Write(append(out, '\n'))
	return err
}

// engineMessage reads an engine's error answer (OpenAI's shape, or any
// text) as the message a client is told.
func engineMessage(status int, body []byte) string {
	var v struct {
		Error json.RawMessage `json:"error"`
	}
	msg := ""
	if json.Unmarshal(body, &v) == nil && len(v.Error) > 0 {
		var o struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(v.Error, &o) == nil && o.Message != "" {
			msg = o.Message
		} else if v.Error[0] == '"' {
			_ = json.Unmarshal(v.Error, &msg)
		}
	}
	if msg == "" {
		msg = strings.TrimSpace(string(body[:min(len(body), 512)]))
	}
	if msg == "" {
		msg = http.StatusText(status)
	}
	return msg
}

// appendEvent appends one server-sent event.
func appendEvent(out []byte, name string, v any) []byte {
	b, _ := json.Marshal(v)
	out = append(out, "event: "...)
	out = append(out, name...)
	out = append(out, "\ndata: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}

// event translates one chat event (its lines, without the blank line).
func (m *Writer) event(out, ev []byte) []byte {
	var data []byte
	for line := range bytes.SplitSeq(ev, []byte("\n")) {
		if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = append(data, bytes.TrimSpace(d)...)
		}
	}
	if len(data) == 0 || m.ended {
		return out
	}
	if string(data) == "[DONE]" {
		return m.closeStream(out)
	}
	var c chatAnswer
	if json.Unmarshal(data, &c) != nil {
		return out
	}
	if len(c.Error) > 0 && string(c.Error) != "null" {
		m.ended = true
		return appendEvent(out, "error", map[string]any{"type": "error",
			"error": map[string]string{"type": "api_error", "message": engineMessage(http.StatusBadGateway, data)}})
	}
	if !m.started {
		m.started = true
		m.id = messageID(c.ID)
		if c.Model != "" {
			m.model = c.Model
		}
		out = appendEvent(out, "message_start", map[string]any{"type": "message_start", "message": map[string]any{
			"id": m.id, "type": "message", "role": "assistant", "model": m.model, "content": []any{},
			"stop_reason": nil, "stop_sequence": nil, "usage": usage{}}})
	}
	if c.Usage != nil {
		m.usage = c.Usage
	}
	for _, ch := range c.Choices {
		if ch.FinishReason != nil {
			m.finish, m.stop = ch.FinishReason, ch.StopReason
		}
		if ch.Delta == nil {
			continue
		}
		if t := ch.Delta.Content; t != nil && *t != "" {
			if m.open < 0 || m.openTool {
				out = m.startBlock(out, false, map[string]any{"type": "text", "text": ""})
			}
			out = appendEvent(out, "content_block_delta", map[string]any{"type": "content_block_delta", "index": m.open,
				"delta": map[string]string{"type": "text_delta", "text": *t}})
		}
		for _, tc := range ch.Delta.ToolCalls {
			blk, ok := m.tools[tc.Index]
			if !ok {
				if m.tools == nil {
					m.tools = map[int]int{}
				}
				out = m.startBlock(out, true, map[string]any{"type": "tool_use", "id": toolUseID(tc.ID), "name": tc.Function.Name, "input": map[string]any{}})
				m.tools[tc.Index], blk = m.open, m.open
				m.anyTool = true
			}
			if tc.Function.Arguments != "" && blk == m.open {
				out = appendEvent(out, "content_block_delta", map[string]any{"type": "content_block_delta", "index": blk,
					"delta": map[string]string{"type": "input_json_delta", "partial_json": tc.Function.Arguments}})
			}
		}
	}
	return out
}

// startBlock closes the open content block and opens the next.
func (m *Writer) startBlock(out []byte, tool bool, block map[string]any) []byte {
	if m.open >= 0 {
		out = appendEvent(out, "content_block_stop", map[string]any{"type": "content_block_stop", "index": m.open})
	}
	m.open, m.openTool = m.next, tool
	m.next++
	return appendEvent(out, "content_block_start", map[string]any{"type": "content_block_start", "index": m.open, "content_block": block})
}

// closeStream ends the stream: the open block, the message's stop reason
// and usage, message_stop.
func (m *Writer) closeStream(out []byte) []byte {
	if m.ended {
		return out
	}
	m.ended = true
	if !m.started {
		return appendEvent(out, "error", map[string]any{"type": "error",
			"error": map[string]string{"type": "api_error", "message": "The engine's stream ended before its first event"}})
	}
	if m.open >= 0 {
		out = appendEvent(out, "content_block_stop", map[string]any{"type": "content_block_stop", "index": m.open})
	}
	reason, seq := stopReason(m.finish, m.stop)
	if reason == "end_turn" && m.anyTool {
		reason = "tool_use"
	}
	out = appendEvent(out, "message_delta", map[string]any{"type": "message_delta",
		"delta": map[string]any{"stop_reason": reason, "stop_sequence": seq}, "usage": m.usage.anthropic()})
	return appendEvent(out, "message_stop", map[string]any{"type": "message_stop"})
}

// randomID is an id's random part where the engine gave none.
func randomID() uint32 { return rand.Uint32() >> 1 }
