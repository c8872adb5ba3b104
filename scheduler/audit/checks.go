package audit

import (
	"fmt"
	"path"
	"strings"
	"time"
)

// Observed is what the relay saw of one answer, for CheckAnswer.
type Observed struct {
	// Model is the model the request asked for; Answered the model the
	// answer names (empty when it names none).
	Model, Answered string
	// PromptText is the bytes of text in the request's messages (or
	// prompt); RequestBytes the size of the whole request body. Tokens
	// of the prompt lie between them: a token has at least one byte of
	// text (bytes beyond the text, such as tools, come from the body), and
	// at most MaxBytesPerToken.
	PromptText, RequestBytes int
	// Messages is the number of chat messages (0 for a plain prompt).
	Messages int
	// Media is true when the prompt carries images, audio or files,
	// whose tokens text length does not bound.
	Media bool
	// CompletionText is the bytes of generated text, reasoning and tool
	// call arguments included.
	CompletionText int
	// Usage is the answer's usage; nil when it had none (no checks on it).
	Usage *Usage
}

// Usage is an answer's token counts as the engine reported them.
type Usage struct {
	Prompt, Completion, Cached int
	// Reasoning is completion_tokens_details.reasoning_tokens: tokens of
	// reasoning the engine counted but need not return.
	Reasoning int
}

// Limits bound what an honest engine reports. The zero value of each field
// means the default named after it.
type Limits struct {
	// MaxBytesPerToken: no tokenizer in use packs more bytes of text into
	// one token on average.
	MaxBytesPerToken int
	// TemplateTokens is what a chat template may add per message, and
	// once more for the whole prompt (role markers, a default system
	// prompt).
	TemplateTokens int
	// SlackTokens is added to every upper bound on completion tokens
	// (end-of-sequence and other special tokens that leave no text).
	SlackTokens int
	// MinPrompt: prompts shorter than this many bytes get no lower bound
	// (a template can dominate them).
	MinPrompt int
}

// Defaults for the zero values of Limits.
const (
	// DefaultMaxBytesPerToken is 32: common vocabularies average 3 to 5
	// bytes of English per token, and their longest tokens (runs of
	// spaces in code vocabularies) seldom pass 32 bytes in a whole prompt.
	DefaultMaxBytesPerToken = 32
	// DefaultTemplateTokens is 64 per message and once for the prompt:
	// Llama 3's default system prompt is about 30 tokens.
	DefaultTemplateTokens = 64
	// DefaultSlackTokens is 8.
	DefaultSlackTokens = 8
	// DefaultMinPrompt is 256 bytes.
	DefaultMinPrompt = 256
)

func (l Limits) populate() Limits {
	l.MaxBytesPerToken = positiveOr(l.MaxBytesPerToken, DefaultMaxBytesPerToken)
	l.TemplateTokens = positiveOr(l.TemplateTokens, DefaultTemplateTokens)
	l.SlackTokens = positiveOr(l.SlackTokens, DefaultSlackTokens)
	l.MinPrompt = positiveOr(l.MinPrompt, DefaultMinPrompt)
	return l
}

// Finding is one thing an answer reports that no honest engine would.
type Finding struct {
	// Check names the check: "model", "cached", "prompt_tokens",
	// "completion_tokens" or "load".
	Check string
	// Detail gives the numbers.
	Detail string
}

// CheckAnswer returns what is impossible or implausible in one answer:
// a model it names that is not the one asked for, more cached tokens than
// prompt tokens, prompt tokens out of the range the prompt's bytes allow,
// completion tokens beyond what the returned text can hold. Each finding
// is evidence for an audit, not a verdict: a tokenizer or a template can
// be stranger than the limits assume.
func CheckAnswer(o Observed, l Limits) []Finding {
	l = l.populate()
	var out []Finding
	add := func(check, format string, args ...any) {
		out = append(out, Finding{Check: check, Detail: fmt.Sprintf(format, args...)})
	}
	if o.Answered != "" && !SameModel(o.Model, o.Answered) {
		add("model", "asked for %q, answer names %q", o.Model, o.Answered)
	}
	u := o.Usage
	if u == nil {
		return out
	}
	if u.Prompt < 0 || u.Completion < 0 || u.Cached < 0 || u.Reasoning < 0 {
		add("usage", "negative counts: prompt %d, completion %d, cached %d, reasoning %d", u.Prompt, u.Completion, u.Cached, u.Reasoning)
		return out
	}
	if u.Cached > u.Prompt {
		add("cached", "cached_tokens %d > prompt_tokens %d", u.Cached, u.Prompt)
	}
	upper := max(o.RequestBytes, o.PromptText) + l.TemplateTokens*(o.Messages+1)
	if !o.Media && u.Prompt > upper {
		add("prompt_tokens", "prompt_tokens %d for %d bytes of request: at most %d", u.Prompt, max(o.RequestBytes, o.PromptText), upper)
	}
	if o.PromptText >= l.MinPrompt {
		if lower := o.PromptText / l.MaxBytesPerToken; u.Prompt < lower {
			add("prompt_tokens", "prompt_tokens %d for %d bytes of text: at least %d", u.Prompt, o.PromptText, lower)
		}
	}
	if limit := o.CompletionText + u.Reasoning + l.SlackTokens; u.Completion > limit {
		add("completion_tokens", "completion_tokens %d for %d bytes of text: at most %d", u.Completion, o.CompletionText, limit)
	}
	return out
}

// SameModel reports whether an answer's model name a is the model asked
// for as b, allowing the ways honest engines spell a name: case, a
// ":latest" tag (Ollama), a path or a ".gguf" file name (llama.cpp), an
// "org/" prefix (Hugging Face names).
func SameModel(a, b string) bool {
	return normModel(a) == normModel(b)
}

func normModel(m string) string {
	m = strings.ToLower(strings.TrimSpace(m))
	m = strings.TrimSuffix(m, ":latest")
	m = path.Base(m)
	m = strings.TrimSuffix(m, ".gguf")
	return m
}

// LoadCheck compares the load an engine publishes (its running plus
// waiting requests, from the metrics its agent gossips) with the requests
// this relay has in flight on it. An engine cannot run fewer requests than
// one relay has sent it; a published load below the relay's own count, in
// Consecutive samples in a row, is a finding. A single sample proves
// little: gossip lags by a second or two. The zero value uses the
// defaults; it is not safe for concurrent use.
type LoadCheck struct {
	// Slack: published may fall short of measured by this much.
	Slack int
	// Consecutive samples short in a row make a finding.
	Consecutive int
	// MaxAge: a published figure older than this is not compared.
	MaxAge time.Duration

	short int // samples short in a row
}

// Defaults for the zero values of LoadCheck.
const (
	DefaultLoadSlack       = 2
	DefaultLoadConsecutive = 5
	DefaultLoadMaxAge      = 5 * time.Second
)

// Sample compares one published figure, published at, with measured, the
// relay's requests in flight on the engine now, and returns a finding when
// the engine has under-reported its load Consecutive times in a row (then
// it counts again from zero).
func (c *LoadCheck) Sample(now, at time.Time, published, measured int) (Finding, bool) {
	slack, consec, maxAge := c.Slack, c.Consecutive, c.MaxAge
	if slack <= 0 {
		slack = DefaultLoadSlack
	}
	if consec <= 0 {
		consec = DefaultLoadConsecutive
	}
	if maxAge <= 0 {
		maxAge = DefaultLoadMaxAge
	}
	if at.IsZero() || now.Sub(at) > maxAge {
		return Finding{}, false
	}
	if published+slack >= measured {
		c.short = 0
		return Finding{}, false
	}
	c.short++
	if c.short < consec {
		return Finding{}, false
	}
	c.short = 0
	return Finding{Check: "load", Detail: fmt.Sprintf("publishes %d requests running or waiting while this relay has %d in flight on it, %d samples in a row", published, measured, consec)}, true
}
