package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Anthropic's Messages API (POST /v1/messages) through any engine. A
// request is read once, at prepare, into the chat completions request it
// means (messagesToChat); the relay routes, queues and accounts that like
// any chat request (its model, session, prompt prefix and size). Each
// attempt then goes one of two ways:
//   - to an agent whose engine lists /v1/messages (transport.JoinInfo.APIs):
//     the client's request as it is, and the engine's answer as it is;
//   - to any other endpoint: the chat request, to /v1/chat/completions,
//     and its answer turned back into a Messages answer as it comes
//     (messagesWriter): a message, or the stream of message_start,
//     content_block_start, _delta and _stop, message_delta and
//     message_stop events, with text, tool_use blocks (their input as
//     input_json_delta) and usage in Anthropic's terms (input_tokens
//     without the cached tokens, cache_read_input_tokens for them).
// Translated attempts are chat requests for the audits too: they get the
// relay's seed and pseudonyms, and their answers may be tapped. Errors on
// the route are in Anthropic's shape (writeErrorFor).

// messagesReq is what prepare made of a Messages request.
type messagesReq struct {
	chat      []byte // the request as chat completions
	agentChat []byte // as agents get it (forward.go); nil means chat
	model     string
	stream    bool
}

// Anthropic request shapes, as far as the translation reads them.
type anthropicRequest struct {
	Model         json.RawMessage      `json:"model"`
	MaxTokens     json.RawMessage      `json:"max_tokens"`
	Messages      json.RawMessage      `json:"messages"`
	System        json.RawMessage      `json:"system"`
	StopSequences []string             `json:"stop_sequences"`
	Stream        json.RawMessage      `json:"stream"`
	Temperature   json.RawMessage      `json:"temperature"`
	TopP          json.RawMessage      `json:"top_p"`
	TopK          json.RawMessage      `json:"top_k"`
	Tools         []anthropicTool      `json:"tools"`
	ToolChoice    *anthropicToolChoice `json:"tool_choice"`
	Metadata      *struct {
		UserID string `json:"user_id"`
	} `json:"metadata"`
}

type anthropicMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type anthropicBlock struct {
	Type      string          `json:"type"`
	Text      string          `json:"text"`
	ID        string          `json:"id"`
	Name      string          `json:"name"`
	Input     json.RawMessage `json:"input"`
	ToolUseID string          `json:"tool_use_id"`
	Content   json.RawMessage `json:"content"`
	IsError   bool            `json:"is_error"`
	Source    *struct {
		Type      string `json:"type"`
		MediaType string `json:"media_type"`
		Data      string `json:"data"`
		URL       string `json:"url"`
	} `json:"source"`
}

type anthropicTool struct {
	Type        string          `json:"type"`
	Name        string          `json:"name"`
	Description string          `json:"description"`
	InputSchema json.RawMessage `json:"input_schema"`
}

type anthropicToolChoice struct {
	Type                   string `json:"type"`
	Name                   string `json:"name"`
	DisableParallelToolUse bool   `json:"disable_parallel_tool_use"`
}

// Chat completions request shapes the translation writes.
type chatRequest struct {
	Model             string          `json:"model"`
	Messages          []chatMessage   `json:"messages"`
	MaxTokens         int             `json:"max_tokens,omitempty"`
	Stop              []string        `json:"stop,omitempty"`
	Stream            bool            `json:"stream,omitempty"`
	StreamOptions     *streamOptions  `json:"stream_options,omitempty"`
	Temperature       json.RawMessage `json:"temperature,omitempty"`
	TopP              json.RawMessage `json:"top_p,omitempty"`
	TopK              json.RawMessage `json:"top_k,omitempty"`
	Tools             []chatTool      `json:"tools,omitempty"`
	ToolChoice        any             `json:"tool_choice,omitempty"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls,omitempty"`
	User              string          `json:"user,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type chatMessage struct {
	Role       string         `json:"role"`
	Content    any            `json:"content"` // a string, []chatPart, or nil
	ToolCalls  []chatToolCall `json:"tool_calls,omitempty"`
	ToolCallID string         `json:"tool_call_id,omitempty"`
}

type chatPart struct {
	Type     string `json:"type"`
	Text     string `json:"text,omitempty"`
	ImageURL *struct {
		URL string `json:"url"`
	} `json:"image_url,omitempty"`
}

type chatToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function chatFunction `json:"function"`
}

type chatFunction struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

type chatTool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string          `json:"name"`
		Description string          `json:"description,omitempty"`
		Parameters  json.RawMessage `json:"parameters,omitempty"`
	} `json:"function"`
}

// errMessages is a 400 for a Messages request, naming the field at fault.
func errMessages(param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "invalid_request", Param: param, Message: param + ": " + msg}
}

// messagesToChat reads a Messages request and returns it as a chat
// completions request. It fails with a 400 *Error for what Anthropic's API
// refuses: no model, no positive max_tokens, no messages, an unknown role
// or content block, tools that are not custom tools.
func messagesToChat(body []byte) (*messagesReq, error) {
	trimmed := bytes.TrimLeft(body, " \t\r\n")
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, errBadRequest("invalid_json", "The request body must be a JSON object", nil)
	}
	var in anthropicRequest
	if err := json.Unmarshal(body, &in); err != nil {
		return nil, errBadRequest("invalid_json", "The request body is not a valid Messages request: "+err.Error(), err)
	}
	out := chatRequest{Stop: in.StopSequences, Temperature: in.Temperature, TopP: in.TopP, TopK: in.TopK}
	if err := json.Unmarshal(in.Model, &out.Model); err != nil || out.Model == "" {
		return nil, errMessages("model", "Field required (a non-empty string)")
	}
	if n, err := strconv.Atoi(string(in.MaxTokens)); err != nil || n < 1 {
		return nil, errMessages("max_tokens", "Field required (a positive integer)")
	} else {
		out.MaxTokens = n
	}
	switch string(in.Stream) {
	case "", "null", "false":
	case "true":
		out.Stream, out.StreamOptions = true, &streamOptions{IncludeUsage: true}
	default:
		return nil, errMessages("stream", "must be a boolean")
	}
	if len(in.System) > 0 && string(in.System) != "null" {
		text, _, err := blocksText(in.System)
		if err != nil {
			return nil, errMessages("system", err.Error())
		}
		out.Messages = append(out.Messages, chatMessage{Role: "system", Content: text})
	}
	var msgs []anthropicMessage
	if err := json.Unmarshal(in.Messages, &msgs); err != nil || len(msgs) == 0 {
		return nil, errMessages("messages", "Field required (a non-empty array of messages)")
	}
	for i, m := range msgs {
		cm, err := chatMessages(m)
		if err != nil {
			return nil, errMessages(fmt.Sprintf("messages.%d", i), err.Error())
		}
		out.Messages = append(out.Messages, cm...)
	}
	for i, t := range in.Tools {
		if t.Type != "" && t.Type != "custom" || t.Name == "" {
			return nil, errMessages(fmt.Sprintf("tools.%d", i), "only custom tools (a name and an input_schema) are served")
		}
		var ct chatTool
		ct.Type = "function"
		ct.Function.Name, ct.Function.Description, ct.Function.Parameters = t.Name, t.Description, t.InputSchema
		out.Tools = append(out.Tools, ct)
	}
	if tc := in.ToolChoice; tc != nil {
		switch tc.Type {
		case "auto", "":
			out.ToolChoice = "auto"
		case "any":
			out.ToolChoice = "required"
		case "none":
			out.ToolChoice = "none"
		case "tool":
			if tc.Name == "" {
				return nil, errMessages("tool_choice.name", "Field required")
			}
			out.ToolChoice = map[string]any{"type": "function", "function": map[string]string{"name": tc.Name}}
		default:
			return nil, errMessages("tool_choice.type", "must be auto, any, tool or none")
		}
		if tc.DisableParallelToolUse && len(out.Tools) > 0 {
			f := false
			out.ParallelToolCalls = &f
		}
		if len(out.Tools) == 0 {
			out.ToolChoice = nil
		}
	}
	if in.Metadata != nil {
		out.User = in.Metadata.UserID
	}
	chat, err := json.Marshal(out)
	if err != nil {
		return nil, err
	}
	return &messagesReq{chat: chat, model: out.Model, stream: out.Stream}, nil
}

// blocksText reads a content that is a string or an array of text blocks
// (a system prompt, a tool result) as one string; images is true when the
// array held an image, which is left out.
func blocksText(raw json.RawMessage) (text string, images bool, err error) {
	if len(raw) > 0 && raw[0] == '"' {
		err = json.Unmarshal(raw, &text)
		return text, false, err
	}
	var blocks []anthropicBlock
	if err := json.Unmarshal(raw, &blocks); err != nil {
		return "", false, fmt.Errorf("must be a string or an array of text blocks")
	}
	var b strings.Builder
	for _, bl := range blocks {
		switch bl.Type {
		case "text":
			if b.Len() > 0 {
				b.WriteString("\n")
			}
			b.WriteString(bl.Text)
		case "image":
			images = true
		default:
			return "", false, fmt.Errorf("block type %q is not a text block", bl.Type)
		}
	}
	return b.String(), images, nil
}

// chatMessages turns one Messages message into the chat messages it means:
// a user message's tool_result blocks become tool messages (before its
// other content, as Anthropic puts them first), an assistant's tool_use
// blocks its tool_calls.
func chatMessages(m anthropicMessage) ([]chatMessage, error) {
	if m.Role != "user" && m.Role != "assistant" {
		return nil, fmt.Errorf("role must be user or assistant, not %q", m.Role)
	}
	if len(m.Content) > 0 && m.Content[0] == '"' {
		var s string
		if err := json.Unmarshal(m.Content, &s); err != nil {
			return nil, err
		}
		return []chatMessage{{Role: m.Role, Content: s}}, nil
	}
	var blocks []anthropicBlock
	if err := json.Unmarshal(m.Content, &blocks); err != nil {
		return nil, fmt.Errorf("content must be a string or an array of content blocks")
	}
	var out []chatMessage
	var parts []chatPart
	var calls []chatToolCall
	hasImage := false
	for j, bl := range blocks {
		switch bl.Type {
		case "text":
			parts = append(parts, chatPart{Type: "text", Text: bl.Text})
		case "image":
			if m.Role != "user" || bl.Source == nil {
				return nil, fmt.Errorf("content.%d: an image needs a source, in a user message", j)
			}
			u := bl.Source.URL
			if bl.Source.Type == "base64" {
				u = "data:" + bl.Source.MediaType + ";base64," + bl.Source.Data
			}
			p := chatPart{Type: "image_url"}
			p.ImageURL = &struct {
				URL string `json:"url"`
			}{URL: u}
			parts = append(parts, p)
			hasImage = true
		case "tool_use":
			if m.Role != "assistant" || bl.ID == "" || bl.Name == "" {
				return nil, fmt.Errorf("content.%d: a tool_use block needs an id and a name, in an assistant message", j)
			}
			args := string(bl.Input)
			if args == "" || args == "null" {
				args = "{}"
			}
			calls = append(calls, chatToolCall{ID: bl.ID, Type: "function", Function: chatFunction{Name: bl.Name, Arguments: args}})
		case "tool_result":
			if m.Role != "user" || bl.ToolUseID == "" {
				return nil, fmt.Errorf("content.%d: a tool_result block needs a tool_use_id, in a user message", j)
			}
			text := ""
			if len(bl.Content) > 0 && string(bl.Content) != "null" {
				var err error
				if text, _, err = blocksText(bl.Content); err != nil {
					return nil, fmt.Errorf("content.%d.content: %v", j, err)
				}
			}
			if bl.IsError {
				text = "Error: " + text
			}
			out = append(out, chatMessage{Role: "tool", ToolCallID: bl.ToolUseID, Content: text})
		case "thinking", "redacted_thinking":
			// The engine's own reasoning from an earlier turn: not sent back.
		default:
			return nil, fmt.Errorf("content.%d: block type %q is not served", j, bl.Type)
		}
	}
	if len(parts) == 0 && len(calls) == 0 {
		return out, nil
	}
	cm := chatMessage{Role: m.Role, ToolCalls: calls}
	switch {
	case hasImage:
		cm.Content = parts
	case len(parts) > 0:
		// Text alone goes as one string: every engine takes that.
		var b strings.Builder
		for i, p := range parts {
			if i > 0 {
				b.WriteString("\n")
			}
			b.WriteString(p.Text)
		}
		cm.Content = b.String()
	}
	return append(out, cm), nil
}

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

// anthropicUsage is a Messages answer's usage: input_tokens are the
// prompt's tokens the engine did not find cached.
type anthropicUsage struct {
	InputTokens              int64 `json:"input_tokens"`
	OutputTokens             int64 `json:"output_tokens"`
	CacheCreationInputTokens int64 `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int64 `json:"cache_read_input_tokens"`
}

func (u *chatUsage) anthropic() anthropicUsage {
	if u == nil {
		return anthropicUsage{}
	}
	var cached int64
	if u.PromptTokensDetails != nil {
		cached = min(max(u.PromptTokensDetails.CachedTokens, 0), u.PromptTokens)
	}
	return anthropicUsage{InputTokens: u.PromptTokens - cached, OutputTokens: u.CompletionTokens, CacheReadInputTokens: cached}
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
		id = strconv.FormatUint(uint64(relaySeed()), 36)
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

// chatToMessage turns a whole chat completion into a Messages answer.
func chatToMessage(body []byte, model string) ([]byte, error) {
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
	return "toolu_" + strconv.FormatUint(uint64(relaySeed()), 36)
}

// anthropicErrorType is Anthropic's error type for an HTTP status.
func anthropicErrorType(status int) string {
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

// anthropicErrorJSON is e in Anthropic's error envelope.
func anthropicErrorJSON(e *Error) []byte {
	b, _ := json.Marshal(map[string]any{"type": "error",
		"error": map[string]string{"type": anthropicErrorType(e.Status), "message": e.Message}})
	return b
}

// messagesWriter turns a chat completions answer into a Messages answer on
// its way to the client, w: a whole answer at finish, a stream event by
// event as the copy stage writes them (whole events: sseFramer), an error
// answer into Anthropic's error shape. It is one attempt's, used by the
// request's goroutine only.
type messagesWriter struct {
	w      http.ResponseWriter
	model  string
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

// maxTranslatedBody bounds a non-streamed answer held for translation.
const maxTranslatedBody = maxCheckedBody

func newMessagesWriter(w http.ResponseWriter, model string) *messagesWriter {
	return &messagesWriter{w: w, model: model, open: -1}
}

// Unwrap lets http.ResponseController reach the real writer (Flush,
// deadlines).
func (m *messagesWriter) Unwrap() http.ResponseWriter { return m.w }

func (m *messagesWriter) Header() http.Header { return m.w.Header() }

func (m *messagesWriter) WriteHeader(status int) {
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

func (m *messagesWriter) Write(p []byte) (int, error) {
	if m.status == 0 {
		m.WriteHeader(http.StatusOK)
	}
	if m.raw {
		return m.w.Write(p)
	}
	if !m.sse {
		if len(m.buf)+len(p) > maxTranslatedBody {
			return 0, fmt.Errorf("answer larger than %d bytes to translate", maxTranslatedBody)
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

// passRaw makes the writer pass what follows as it is: the relay's own
// error event, already in Anthropic's shape (streamErrorEventFor).
func (m *messagesWriter) passRaw() {
	if m.sse && m.started && !m.ended && m.open >= 0 {
		_, _ = m.w.Write(appendEvent(nil, "content_block_stop", map[string]any{"type": "content_block_stop", "index": m.open}))
	}
	m.raw = true
}

// end completes the answer once the engine's ended cleanly: a whole
// answer is translated and written, a stream gets its closing events.
func (m *messagesWriter) end() error {
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
		b, err := chatToMessage(m.buf, m.model)
		if err != nil {
			out = anthropicErrorJSON(&Error{Status: http.StatusBadGateway, Message: "The engine's answer could not be read as a chat completion"})
		} else {
			out = b
		}
	} else {
		out = anthropicErrorJSON(engineError(m.status, m.buf))
	}
	_, err := m.w.Write(append(out, '\n'))
	return err
}

// engineError reads an engine's error answer (OpenAI's shape, or any text)
// as an *Error of its status.
func engineError(status int, body []byte) *Error {
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
	return &Error{Status: status, Message: msg}
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
func (m *messagesWriter) event(out, ev []byte) []byte {
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
			"error": map[string]string{"type": "api_error", "message": engineError(http.StatusBadGateway, data).Message}})
	}
	if !m.started {
		m.started = true
		m.id = messageID(c.ID)
		if c.Model != "" {
			m.model = c.Model
		}
		out = appendEvent(out, "message_start", map[string]any{"type": "message_start", "message": map[string]any{
			"id": m.id, "type": "message", "role": "assistant", "model": m.model, "content": []any{},
			"stop_reason": nil, "stop_sequence": nil, "usage": anthropicUsage{}}})
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
func (m *messagesWriter) startBlock(out []byte, tool bool, block map[string]any) []byte {
	if m.open >= 0 {
		out = appendEvent(out, "content_block_stop", map[string]any{"type": "content_block_stop", "index": m.open})
	}
	m.open, m.openTool = m.next, tool
	m.next++
	return appendEvent(out, "content_block_start", map[string]any{"type": "content_block_start", "index": m.open, "content_block": block})
}

// closeStream ends the stream: the open block, the message's stop reason
// and usage, message_stop.
func (m *messagesWriter) closeStream(out []byte) []byte {
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
