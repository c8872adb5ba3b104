package audit

import (
	"errors"
	"strings"
	"testing"
)

func TestParseCompletion(t *testing.T) {
	body := `{"id":"x","object":"chat.completion","model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"Hi there"},"finish_reason":"length",
	"logprobs":{"content":[{"token":"Hi","logprob":-0.1,"top_logprobs":[{"token":"Hi","logprob":-0.1},{"token":"Hello","logprob":-2.5}]},{"token":" there","logprob":-0.3,"top_logprobs":[]}]}}],
	"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8},"completion_tokens_details":{"reasoning_tokens":0}}}`
	c, err := ParseCompletion([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if c.Model != "m1" || c.Answer.Text != "Hi there" || c.Finish != "length" {
		t.Errorf("%+v", c)
	}
	if c.Usage == nil || *c.Usage != (Usage{Prompt: 12, Completion: 2, Cached: 8}) {
		t.Errorf("usage %+v", c.Usage)
	}
	if len(c.Answer.Tokens) != 2 || c.Answer.Tokens[0].Top[1] != (Alt{"Hello", -2.5}) || c.Answer.Tokens[1].Text != " there" {
		t.Errorf("tokens %+v", c.Answer.Tokens)
	}
	// A text completion, no logprobs, no usage.
	c, err = ParseCompletion([]byte(`{"model":"m1","choices":[{"text":"abc","finish_reason":"stop"}]}`))
	if err != nil || c.Answer.Text != "abc" || c.Answer.Tokens != nil || c.Usage != nil {
		t.Errorf("text completion: %+v %v", c, err)
	}
	if _, err := ParseCompletion([]byte(`{"model":"m1","choices":[]}`)); !errors.Is(err, ErrNoChoice) {
		t.Errorf("no choices: %v", err)
	}
	if _, err := ParseCompletion([]byte(`<html>`)); err == nil {
		t.Error("not JSON: no error")
	}
}

func TestStreamChunks(t *testing.T) {
	stream := `data: {"model":"m1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}
data: {"model":"m1","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.1,"top_logprobs":[]}]},"finish_reason":null}]}
data: {"model":"m1","choices":[{"index":0,"delta":{"content":" there"},"logprobs":{"content":[{"token":" there","logprob":-0.2,"top_logprobs":[]}]},"finish_reason":null}]}
data: {"model":"m1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}
data: {"model":"m1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}
data: [DONE]`
	var c Completion
	for line := range strings.SplitSeq(stream, "\n") {
		if err := c.StreamChunk([]byte(strings.TrimPrefix(line, "data: "))); err != nil {
			t.Fatal(err)
		}
	}
	if c.Answer.Text != "Hi there" || len(c.Answer.Tokens) != 2 || c.Finish != "stop" || c.Usage == nil || c.Usage.Completion != 2 {
		t.Errorf("%+v usage %+v", c, c.Usage)
	}
	if err := c.StreamChunk([]byte("{")); err == nil {
		t.Error("broken chunk: no error")
	}
}

func FuzzParseCompletion(f *testing.F) {
	f.Add([]byte(`{"model":"m1","choices":[{"message":{"content":"x"},"logprobs":{"content":[{"token":"x","logprob":-1,"top_logprobs":[{"token":"y","logprob":-2}]}]}}],"usage":{"prompt_tokens":1}}`))
	f.Add([]byte(`{"choices":[{"delta":{"content":"x"},"finish_reason":"stop"}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseCompletion(b)
		if err == nil && c.Answer.Tokens != nil {
			// Whatever was parsed compares with itself.
			if got := Compare(c.Answer, c.Answer, Tolerance{}); got.Outcome == Disagree {
				t.Fatalf("an answer disagrees with itself: %+v", got)
			}
		}
		var s Completion
		_ = s.StreamChunk(b)
	})
}
