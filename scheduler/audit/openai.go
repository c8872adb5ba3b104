package audit

import (
	"encoding/json"
	"errors"
	"fmt"
)

// Completion is what an audit reads of an OpenAI chat completion (or text
// completion) answer.
type Completion struct {
	// Model is the model the answer names.
	Model string
	// Answer is the first choice's text and, when given, its logprobs.
	Answer Answer
	// Finish is the first choice's finish_reason.
	Finish string
	// Usage is the answer's usage; nil when it had none.
	Usage *Usage
}

// ErrNoChoice is returned by ParseCompletion for an answer without choices.
var ErrNoChoice = errors.New("audit: answer has no choices")

type wireLogprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Top     []struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
	} `json:"top_logprobs"`
}

type wireUsage struct {
	Prompt     int `json:"prompt_tokens"`
	Completion int `json:"completion_tokens"`
	Details    *struct {
		Cached int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	CompletionDetails *struct {
		Reasoning int `json:"reasoning_tokens"`
	} `json:"completion_tokens_details"`
}

func (w *wireUsage) usage() *Usage {
	if w == nil {
		return nil
	}
	u := &Usage{Prompt: w.Prompt, Completion: w.Completion}
	if w.Details != nil {
		u.Cached = w.Details.Cached
	}
	if w.CompletionDetails != nil {
		u.Reasoning = w.CompletionDetails.Reasoning
	}
	return u
}

// ParseCompletion decodes a non-streamed /v1/chat/completions or
// /v1/completions answer body.
func ParseCompletion(body []byte) (Completion, error) {
	var w struct {
		Model   string `json:"model"`
		Choices []struct {
			Message *struct {
				Content          *string `json:"content"`
				ReasoningContent string  `json:"reasoning_content"`
			} `json:"message"`
			Text     *string `json:"text"`
			Finish   string  `json:"finish_reason"`
			Logprobs *struct {
				Content []wireLogprob `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
		Usage *wireUsage `json:"usage"`
	}
	if err := json.Unmarshal(body, &w); err != nil {
		return Completion{}, fmt.Errorf("audit: answer is not a completion: %w", err)
	}
	c := Completion{Model: w.Model, Usage: w.Usage.usage()}
	if len(w.Choices) == 0 {
		return c, ErrNoChoice
	}
	ch := w.Choices[0]
	c.Finish = ch.Finish
	switch {
	case ch.Message != nil && ch.Message.Content != nil:
		c.Answer.Text = *ch.Message.Content
	case ch.Text != nil:
		c.Answer.Text = *ch.Text
	}
	if ch.Logprobs != nil && ch.Logprobs.Content != nil {
		c.Answer.Tokens = tokens(c.Answer.Tokens, ch.Logprobs.Content)
	}
	return c, nil
}

func tokens(dst []Token, lps []wireLogprob) []Token {
	if dst == nil {
		dst = make([]Token, 0, len(lps))
	}
	for _, lp := range lps {
		t := Token{Text: lp.Token, Logprob: lp.Logprob}
		for _, a := range lp.Top {
			t.Top = append(t.Top, Alt{Text: a.Token, Logprob: a.Logprob})
		}
		dst = append(dst, t)
	}
	return dst
}

// StreamChunk adds one server-sent event's data (a chat.completion.chunk
// or text_completion chunk, without the "data: " prefix) to c: the first
// choice's text and logprobs, its finish_reason, the model, and the usage
// when the chunk carries it. "[DONE]" and empty data are ignored.
func (c *Completion) StreamChunk(data []byte) error {
	if len(data) == 0 || string(data) == "[DONE]" {
		return nil
	}
	var w struct {
		Model   string `json:"model"`
		Choices []struct {
			Delta *struct {
				Content *string `json:"content"`
			} `json:"delta"`
			Text     *string `json:"text"`
			Finish   *string `json:"finish_reason"`
			Logprobs *struct {
				Content []wireLogprob `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
		Usage *wireUsage `json:"usage"`
	}
	if err := json.Unmarshal(data, &w); err != nil {
		return fmt.Errorf("audit: stream chunk is not a completion chunk: %w", err)
	}
	if w.Model != "" {
		c.Model = w.Model
	}
	if u := w.Usage.usage(); u != nil {
		c.Usage = u
	}
	for _, ch := range w.Choices {
		switch {
		case ch.Delta != nil && ch.Delta.Content != nil:
			c.Answer.Text += *ch.Delta.Content
		case ch.Text != nil:
			c.Answer.Text += *ch.Text
		}
		if ch.Logprobs != nil && ch.Logprobs.Content != nil {
			c.Answer.Tokens = tokens(c.Answer.Tokens, ch.Logprobs.Content)
		}
		if ch.Finish != nil && *ch.Finish != "" {
			c.Finish = *ch.Finish
		}
	}
	return nil
}
