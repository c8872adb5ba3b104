package anthropic_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/relay/anthropic"
)

func TestToChat(t *testing.T) {
	req, err := anthropic.ToChat([]byte(`{"model":"m","max_tokens":16,"system":"be brief","stream":true,
		"stop_sequences":["END"],"metadata":{"user_id":"u1"},
		"tools":[{"name":"get","input_schema":{"type":"object"}}],"tool_choice":{"type":"any"},
		"messages":[{"role":"user","content":"hi"},
		{"role":"assistant","content":[{"type":"text","text":"calling"},{"type":"tool_use","id":"t1","name":"get","input":{"a":1}}]},
		{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"42"}]}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if req.Model != "m" {
		t.Fatalf("model %q", req.Model)
	}
	var chat struct {
		Model         string   `json:"model"`
		MaxTokens     int      `json:"max_tokens"`
		Stop          []string `json:"stop"`
		Stream        bool     `json:"stream"`
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
		User       string `json:"user"`
		ToolChoice string `json:"tool_choice"`
		Tools      []struct {
			Type     string `json:"type"`
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		} `json:"tools"`
		Messages []struct {
			Role       string `json:"role"`
			Content    any    `json:"content"`
			ToolCallID string `json:"tool_call_id"`
			ToolCalls  []struct {
				ID       string `json:"id"`
				Function struct {
					Name      string `json:"name"`
					Arguments string `json:"arguments"`
				} `json:"function"`
			} `json:"tool_calls"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(req.Chat, &chat); err != nil {
		t.Fatalf("%v: %s", err, req.Chat)
	}
	if chat.Model != "m" || chat.MaxTokens != 16 || !chat.Stream || !chat.StreamOptions.IncludeUsage ||
		chat.User != "u1" || chat.ToolChoice != "required" || len(chat.Stop) != 1 || chat.Stop[0] != "END" {
		t.Fatalf("request fields: %s", req.Chat)
	}
	if len(chat.Tools) != 1 || chat.Tools[0].Type != "function" || chat.Tools[0].Function.Name != "get" {
		t.Fatalf("tools: %s", req.Chat)
	}
	m := chat.Messages
	if len(m) != 4 || m[0].Role != "system" || m[0].Content != "be brief" || m[1].Content != "hi" ||
		m[2].Role != "assistant" || m[2].Content != "calling" || len(m[2].ToolCalls) != 1 ||
		m[2].ToolCalls[0].ID != "t1" || m[2].ToolCalls[0].Function.Arguments != `{"a":1}` ||
		m[3].Role != "tool" || m[3].ToolCallID != "t1" || m[3].Content != "42" {
		t.Fatalf("messages: %s", req.Chat)
	}
}

func TestToChatRefuses(t *testing.T) {
	for _, c := range []struct{ body, code, param string }{
		{`[]`, "invalid_json", ""},
		{`{"model":`, "invalid_json", ""},
		{`{"max_tokens":1,"messages":[{"role":"user","content":"x"}]}`, "invalid_request", "model"},
		{`{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"x"}]}`, "invalid_request", "max_tokens"},
		{`{"model":"m","max_tokens":1,"messages":[]}`, "invalid_request", "messages"},
		{`{"model":"m","max_tokens":1,"stream":"yes","messages":[{"role":"user","content":"x"}]}`, "invalid_request", "stream"},
		{`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"x"},{"role":"robot","content":"x"}]}`, "invalid_request", "messages.1"},
		{`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"video"}]}]}`, "invalid_request", "messages.0"},
		{`{"model":"m","max_tokens":1,"tools":[{"type":"web_search"}],"messages":[{"role":"user","content":"x"}]}`, "invalid_request", "tools.0"},
		{`{"model":"m","max_tokens":1,"tool_choice":{"type":"tool"},"messages":[{"role":"user","content":"x"}]}`, "invalid_request", "tool_choice.name"},
	} {
		_, err := anthropic.ToChat([]byte(c.body))
		var re *anthropic.RequestError
		if !errors.As(err, &re) || re.Code != c.code || re.Param != c.param || re.Message == "" {
			t.Errorf("%s: got %#v, want code %s param %q", c.body, err, c.code, c.param)
		}
	}
}

func TestWriterWhole(t *testing.T) {
	rec := httptest.NewRecorder()
	w := anthropic.NewWriter(rec, "m", 1<<20)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", "999")
	_, _ = w.Write([]byte(`{"id":"chatcmpl-abc","choices":[{"message":{"content":"hello","tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{\"x\":2}"}}]},"finish_reason":"tool_calls"}],`))
	_, _ = w.Write([]byte(`"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}`))
	if err := w.End(); err != nil {
		t.Fatal(err)
	}
	if rec.Header().Get("Content-Length") != "" {
		t.Fatal("the engine's Content-Length was kept")
	}
	var msg struct {
		ID         string `json:"id"`
		Type       string `json:"type"`
		StopReason string `json:"stop_reason"`
		Content    []struct {
			Type  string          `json:"type"`
			Text  string          `json:"text"`
			ID    string          `json:"id"`
			Input json.RawMessage `json:"input"`
		} `json:"content"`
		RawUsage map[string]int64 `json:"usage"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &msg); err != nil {
		t.Fatalf("%v: %s", err, rec.Body)
	}
	if msg.ID != "msg_abc" || msg.Type != "message" || msg.StopReason != "tool_use" || len(msg.Content) != 2 ||
		msg.Content[0].Text != "hello" || msg.Content[1].ID != "c1" || string(msg.Content[1].Input) != `{"x":2}` {
		t.Fatalf("message: %s", rec.Body)
	}
	if u := msg.RawUsage; u["input_tokens"] != 6 || u["cache_read_input_tokens"] != 4 || u["output_tokens"] != 3 {
		t.Fatalf("usage: %s", rec.Body)
	}
}

func TestWriterStream(t *testing.T) {
	rec := httptest.NewRecorder()
	w := anthropic.NewWriter(rec, "m", 1<<20)
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	stream := `data: {"id":"chatcmpl-1","choices":[{"delta":{"content":"he"}}]}` + "\n\n" +
		`data: {"id":"chatcmpl-1","choices":[{"delta":{"content":"llo"},"finish_reason":"stop","stop_reason":"END"}]}` + "\n\n" +
		`data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}` + "\n\n" +
		"data: [DONE]\n\n"
	// Written in pieces that split events, as a network read does.
	for i := 0; i < len(stream); i += 7 {
		if _, err := w.Write([]byte(stream[i:min(i+7, len(stream))])); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.End(); err != nil {
		t.Fatal(err)
	}
	var names []string
	var text strings.Builder
	for ev := range strings.SplitSeq(strings.TrimSpace(rec.Body.String()), "\n\n") {
		name, data, _ := strings.Cut(ev, "\n")
		names = append(names, strings.TrimPrefix(name, "event: "))
		var d struct {
			Delta struct {
				Text       string `json:"text"`
				StopReason string `json:"stop_reason"`
				StopSeq    string `json:"stop_sequence"`
			} `json:"delta"`
			Usage map[string]int64 `json:"usage"`
		}
		if err := json.Unmarshal([]byte(strings.TrimPrefix(data, "data: ")), &d); err != nil {
			t.Fatalf("%v: %q", err, ev)
		}
		text.WriteString(d.Delta.Text)
		if strings.HasSuffix(name, "message_delta") && (d.Delta.StopReason != "stop_sequence" || d.Delta.StopSeq != "END" || d.Usage["input_tokens"] != 5 || d.Usage["output_tokens"] != 2) {
			t.Fatalf("message_delta: %q", ev)
		}
	}
	want := "message_start content_block_start content_block_delta content_block_delta content_block_stop message_delta message_stop"
	if got := strings.Join(names, " "); got != want || text.String() != "hello" {
		t.Fatalf("events %q text %q, want %q", got, text.String(), want)
	}
}

func TestWriterEngineError(t *testing.T) {
	rec := httptest.NewRecorder()
	w := anthropic.NewWriter(rec, "m", 1<<20)
	w.WriteHeader(http.StatusTooManyRequests)
	_, _ = w.Write([]byte(`{"error":{"message":"slow down","type":"rate_limit"}}`))
	if err := w.End(); err != nil {
		t.Fatal(err)
	}
	var e struct {
		Type  string `json:"type"`
		Error struct{ Type, Message string }
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || rec.Code != 429 || e.Type != "error" ||
		e.Error.Type != "rate_limit_error" || e.Error.Message != "slow down" {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	// A non-streamed answer past the bound is refused, not held.
	w = anthropic.NewWriter(httptest.NewRecorder(), "m", 8)
	if _, err := w.Write([]byte(`{"id":"0123456789"}`)); err == nil {
		t.Fatal("an answer past maxBody was held")
	}
}

// FuzzToChat: any body is a chat request that is a JSON object naming the
// model, or a *RequestError; never a panic.
func FuzzToChat(f *testing.F) {
	f.Add([]byte(`{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA"}}]}]}`))
	f.Add([]byte(`{"model":"m","max_tokens":4,"system":[{"type":"text","text":"s"}],"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"b"}]}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := anthropic.ToChat(body)
		if err != nil {
			var re *anthropic.RequestError
			if !errors.As(err, &re) {
				t.Fatalf("error of type %T: %v", err, err)
			}
			return
		}
		var v struct {
			Model string `json:"model"`
		}
		if json.Unmarshal(req.Chat, &v) != nil || v.Model != req.Model || v.Model == "" {
			t.Fatalf("chat %s for model %q", req.Chat, req.Model)
		}
	})
}
