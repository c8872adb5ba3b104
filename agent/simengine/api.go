package simengine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
)

// kind says which OpenAI endpoint a request came from.
type kind uint8

const (
	kindChat kind = iota
	kindText
)

// genRequest is a parsed generation request.
type genRequest struct {
	kind      kind
	model     string // as requested; "" means the default model
	prompt    string // rendered prompt (empty when tokens came as ids)
	tokens    []Token
	maxTokens int // 0 means the server's default
	stream    bool
	// draw is what a sampled request's answer depends on beyond its
	// prompt: its seed, or a random draw without one; 0 for greedy
	// decoding (no temperature, or 0), whose answer is the prompt's alone.
	draw uint64
	resp *respMeta // Responses API requests only
	// tool is the call the answer makes instead of text (chat only); nil
	// for a text answer.
	tool *toolCall
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type chatRequest struct {
	Model               string          `json:"model"`
	Messages            []chatMessage   `json:"messages"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	N                   *int            `json:"n"`
	PromptCacheKey      json.RawMessage `json:"prompt_cache_key"` // routing hint for relays; ignored here
	Tools               []chatTool      `json:"tools"`
	ToolChoice          json.RawMessage `json:"tool_choice"`
	sampling
}

// chatTool is a function the client offers the model.
type chatTool struct {
	Type     string `json:"type"`
	Function struct {
		Name       string          `json:"name"`
		Parameters json.RawMessage `json:"parameters"`
	} `json:"function"`
}

// sampling is a request's decoding: a temperature above 0 samples, and
// the seed (or a random draw) selects the answer, as engines under a
// seed do.
type sampling struct {
	Temperature *float64 `json:"temperature"`
	Seed        *int64   `json:"seed"`
}

func (s sampling) draw() uint64 {
	switch {
	case s.Temperature == nil || *s.Temperature <= 0:
		return 0
	case s.Seed != nil:
		return mix64(uint64(*s.Seed)) | 1
	}
	return rand.Uint64() | 1
}

type chatMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	ToolCalls  json.RawMessage `json:"tool_calls"`
	ToolCallID string          `json:"tool_call_id"`
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type completionRequest struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
	MaxTokens     *int            `json:"max_tokens"`
	N             *int            `json:"n"`
	sampling
}

// decode unmarshals body into v, answering malformed JSON with a 400.
func decode(body []byte, v any) error {
	if err := json.Unmarshal(body, v); err != nil {
		return badRequest("", "malformed JSON body: %v", err)
	}
	return nil
}

func checkCommon(maxTokens *int, n *int) (int, error) {
	if n != nil && *n != 1 {
		return 0, badRequest("n", "n must be 1")
	}
	if maxTokens == nil {
		return 0, nil
	}
	if *maxTokens < 1 {
		return 0, badRequest("max_tokens", "max_tokens must be at least 1, got %d", *maxTokens)
	}
	return *maxTokens, nil
}

// parseChat parses a /v1/chat/completions body and renders its prompt.
func parseChat(body []byte) (*genRequest, error) {
	var cr chatRequest
	if err := decode(body, &cr); err != nil {
		return nil, err
	}
	limit := cr.MaxTokens
	if cr.MaxCompletionTokens != nil {
		limit = cr.MaxCompletionTokens
	}
	maxTokens, err := checkCommon(limit, cr.N)
	if err != nil {
		return nil, err
	}
	if len(cr.Messages) == 0 {
		return nil, badRequest("messages", "messages must not be empty")
	}
	var b strings.Builder
	for i, m := range cr.Messages {
		if m.Role == "" || strings.ContainsAny(m.Role, "\n<|>") {
			return nil, badRequest(fmt.Sprintf("messages[%d].role", i), "invalid role %q", m.Role)
		}
		text, err := messageText(m.Content)
		if err != nil {
			return nil, badRequest(fmt.Sprintf("messages[%d].content", i), "%v", err)
		}
		if len(m.ToolCalls) > 0 && string(m.ToolCalls) != "null" {
			text += string(m.ToolCalls) // the calls are part of the turn, as a template renders them
		}
		renderMessage(&b, m.Role, text)
	}
	b.WriteString(chatGenerationPrompt)
	prompt := b.String()
	tool, err := chooseTool(cr.Tools, cr.ToolChoice, cr.Messages[len(cr.Messages)-1].Role)
	if err != nil {
		return nil, err
	}
	return &genRequest{kind: kindChat, model: cr.Model, prompt: prompt, tokens: Tokenize(nil, prompt),
		maxTokens: maxTokens, stream: cr.Stream, draw: cr.draw(), tool: tool}, nil
}

// chooseTool decides whether the answer is a call of one of tools, and of
// which, as a model that follows its instructions would: tool_choice
// "required" or a named function calls (the named one, or the first);
// "none" answers in text; "auto" (or none given) calls the first tool
// unless the last message is a tool's result, which the answer then is
// about. The call's arguments fill the function's required parameters
// (every parameter when none is required) with values of their types.
func chooseTool(tools []chatTool, choice json.RawMessage, lastRole string) (*toolCall, error) {
	if len(tools) == 0 {
		return nil, nil
	}
	name := ""
	switch c := string(bytes.TrimSpace(choice)); {
	case c == "" || c == "null" || c == `"auto"`:
		if lastRole == "tool" {
			return nil, nil
		}
	case c == `"none"`:
		return nil, nil
	case c == `"required"`:
	default:
		var named struct {
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		}
		if json.Unmarshal(choice, &named) != nil || named.Function.Name == "" {
			return nil, badRequest("tool_choice", "tool_choice must be auto, none, required or a named function")
		}
		name = named.Function.Name
	}
	t := tools[0]
	if name != "" {
		found := false
		for _, c := range tools {
			if c.Function.Name == name {
				t, found = c, true
				break
			}
		}
		if !found {
			return nil, badRequest("tool_choice", "tool_choice names %q, which is not among the tools", name)
		}
	}
	if t.Function.Name == "" {
		return nil, badRequest("tools", "every tool needs a function name")
	}
	return &toolCall{name: t.Function.Name, args: toolArguments(t.Function.Parameters)}, nil
}

// toolCall is an answer that calls a function.
type toolCall struct {
	name, args string
}

// toolArguments are a call's arguments for a JSON schema of an object:
// its required properties (all of them when none is required), each a
// value of its type (the first of an enum).
func toolArguments(schema json.RawMessage) string {
	var s struct {
		Properties map[string]struct {
			Type string            `json:"type"`
			Enum []json.RawMessage `json:"enum"`
		} `json:"properties"`
		Required []string `json:"required"`
	}
	_ = json.Unmarshal(schema, &s)
	names := s.Required
	if len(names) == 0 {
		for n := range s.Properties {
			names = append(names, n)
		}
		slices.Sort(names)
	}
	args := map[string]json.RawMessage{}
	for _, n := range names {
		p := s.Properties[n]
		switch {
		case len(p.Enum) > 0:
			args[n] = p.Enum[0]
		case p.Type == "number" || p.Type == "integer":
			args[n] = json.RawMessage("1")
		case p.Type == "boolean":
			args[n] = json.RawMessage("true")
		case p.Type == "object":
			args[n] = json.RawMessage("{}")
		case p.Type == "array":
			args[n] = json.RawMessage("[]")
		default:
			args[n] = json.RawMessage(strconv.Quote(n))
		}
	}
	b, _ := json.Marshal(args)
	return string(b)
}

// chatGenerationPrompt opens the assistant's turn.
const chatGenerationPrompt = "<|im_start|>assistant\n"

// renderMessage writes one message in the ChatML template. Earlier turns
// render the same way in every later request, which is what lets a
// follow-up turn hit the cache.
func renderMessage(b *strings.Builder, role, text string) {
	b.WriteString("<|im_start|>")
	b.WriteString(role)
	b.WriteString("\n")
	b.WriteString(text)
	b.WriteString("<|im_end|>\n")
}

// messageText returns a message's text: a string, null, or text parts.
func messageText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		err := json.Unmarshal(raw, &s)
		return s, err
	}
	var parts []contentPart
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("content must be a string or an array of text parts")
	}
	var b strings.Builder
	for _, p := range parts {
		if p.Type != "text" && p.Type != "input_text" {
			return "", fmt.Errorf("content part type %q is not supported", p.Type)
		}
		b.WriteString(p.Text)
	}
	return b.String(), nil
}

// parseCompletion parses a /v1/completions body. The prompt is a string, an
// array holding one string, or an array of token ids (used as they are).
func parseCompletion(body []byte) (*genRequest, error) {
	var cr completionRequest
	if err := decode(body, &cr); err != nil {
		return nil, err
	}
	maxTokens, err := checkCommon(cr.MaxTokens, cr.N)
	if err != nil {
		return nil, err
	}
	g := &genRequest{kind: kindText, model: cr.Model, maxTokens: maxTokens, stream: cr.Stream, draw: cr.draw()}
	raw := bytes.TrimSpace(cr.Prompt)
	var s string
	var ss []string
	var ids []int64
	switch {
	case len(raw) == 0 || bytes.Equal(raw, []byte("null")):
		return nil, badRequest("prompt", "prompt is required")
	case json.Unmarshal(raw, &s) == nil:
		g.prompt = s
	case json.Unmarshal(raw, &ss) == nil && len(ss) == 1:
		g.prompt = ss[0]
	case json.Unmarshal(raw, &ids) == nil && len(ids) > 0:
		g.tokens = make([]Token, len(ids))
		for i, id := range ids {
			if id < 0 || id > 1<<32-1 {
				return nil, badRequest("prompt", "token id %d out of range", id)
			}
			g.tokens[i] = Token(id)
		}
		return g, nil
	default:
		return nil, badRequest("prompt", "prompt must be a string, one string in an array, or an array of token ids")
	}
	g.tokens = Tokenize(nil, g.prompt)
	if len(g.tokens) == 0 {
		return nil, badRequest("prompt", "prompt is empty")
	}
	return g, nil
}

type embeddingRequest struct {
	Model      string          `json:"model"`
	Input      json.RawMessage `json:"input"`
	Dimensions int             `json:"dimensions"`
}

// parseEmbedding returns the inputs of an /v1/embeddings body as texts.
func parseEmbedding(body []byte) (*embeddingRequest, []string, error) {
	var er embeddingRequest
	if err := decode(body, &er); err != nil {
		return nil, nil, err
	}
	if er.Dimensions < 0 || er.Dimensions > 4096 {
		return nil, nil, badRequest("dimensions", "dimensions must be in 1..4096")
	}
	var s string
	var ss []string
	switch {
	case json.Unmarshal(er.Input, &s) == nil:
		ss = []string{s}
	case json.Unmarshal(er.Input, &ss) == nil && len(ss) > 0:
	default:
		return nil, nil, badRequest("input", "input must be a string or an array of strings")
	}
	return &er, ss, nil
}
