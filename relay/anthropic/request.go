package anthropic

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// Request is a Messages request as the chat completions request it means.
type Request struct {
	Chat  []byte // the chat completions request body
	Model string // the model it names
}

// Anthropic request shapes, as far as the translation reads them.
type messagesRequest struct {
	Model         json.RawMessage `json:"model"`
	MaxTokens     json.RawMessage `json:"max_tokens"`
	Messages      json.RawMessage `json:"messages"`
	System        json.RawMessage `json:"system"`
	StopSequences []string        `json:"stop_sequences"`
	Stream        json.RawMessage `json:"stream"`
	Temperature   json.RawMessage `json:"temperature"`
	TopP          json.RawMessage `json:"top_p"`
	TopK          json.RawMessage `json:"top_k"`
	Tools         []toolDef       `json:"tools"`
	ToolChoice    *toolChoice     `json:"tool_choice"`
	Metadata      *struct {
		UserID string `json:"user_id"`
	} `json:"metadata"`
}

type inMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type contentBlock struct {
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

type toolDef struct {
	Type        string          `json:"type"`
	Name        string          `json:"name"`
	Description string          `json:"description"`
	InputSchema json.RawMessage `json:"input_schema"`
}

type toolChoice struct {
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

// RequestError is why ToChat refused a request: a 400 with OpenAI's
// invalid_request_error type, its code and the field at fault.
type RequestError struct {
	Code    string // "invalid_json" or "invalid_request"
	Param   string // the request field at fault; empty for the whole body
	Message string // what a client is told
	Err     error  // the decoder's error, for logs; nil for none
}

func (e *RequestError) Error() string { return e.Message }

// Unwrap returns the decoder's error.
func (e *RequestError) Unwrap() error { return e.Err }

// errMessages refuses a request, naming the field at fault.
func errMessages(param, msg string) *RequestError {
	return &RequestError{Code: "invalid_request", Param: param, Message: param + ": " + msg}
}

func errJSON(msg string, err error) *RequestError {
	return &RequestError{Code: "invalid_json", Message: msg, Err: err}
}

// ToChat reads a Messages request and returns it as a chat
// completions request. It fails with a *RequestError for what Anthropic's API
// refuses: no model, no positive max_tokens, no messages, an unknown role
// or content block, tools that are not custom tools.
func ToChat(body []byte) (*Request, error) {
	trimmed := bytes.TrimLeft(body, " \t\r\n")
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, errJSON("The request body must be a JSON object", nil)
	}
	var in messagesRequest
	if err := json.Unmarshal(body, &in); err != nil {
		return nil, errJSON("The request body is not a valid Messages request: "+err.Error(), err)
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
	var msgs []inMessage
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
	return &Request{Chat: chat, Model: out.Model}, nil
}

// blocksText reads a content that is a string or an array of text blocks
// (a system prompt, a tool result) as one string; images is true when the
// array held an image, which is left out.
func blocksText(raw json.RawMessage) (text string, images bool, err error) {
	if len(raw) > 0 && raw[0] == '"' {
		err = json.Unmarshal(raw, &text)
		return text, false, err
	}
	var blocks []contentBlock
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
func chatMessages(m inMessage) ([]chatMessage, error) {
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
	var blocks []contentBlock
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
