package relay

import (
	"bytes"
	"time"

	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler/jsonscan"
	"github.com/computeflux/computeflux/transport/usage"
)

// Recording into the usage ledger. The copy stages note what the answer
// said about its tokens (tokenUsage: from the usage object at the end of a
// non-streamed answer, or from the stream's usage chunk, as the framer
// passes it); serveProxied records every finished inference request once,
// through recordUsage.

// estimateBytesPerToken is the bytes per token of an estimate, for answers
// that carry no usage: about four bytes of English text per token.
const estimateBytesPerToken = 4

// anonymousClient names the client of every request when the relay checks
// no keys.
const anonymousClient = "anonymous"

// tokenUsage is what an answer said about its tokens, read from the
// usage object an answer ends with. The zero value says nothing.
type tokenUsage struct{ usage.Counts }

// usageKey is how a usage object's key is found in an answer's bytes.
var usageKey = []byte(`"usage"`)

// maxUsageTries bounds the `"usage"` occurrences read from the end of an
// answer before it is taken as having none (a text that quotes the word
// many times is not worth scanning whole).
const maxUsageTries = 4

// usageTail is how much of an answer's end is searched for its usage:
// OpenAI-style answers end with it, followed at most by a few short
// fields. Searching the whole of a long answer would cost about a
// nanosecond a byte.
const usageTail = 4 << 10

// scanTail reads the last usage object in the last usageTail bytes of a
// JSON answer into u, searching from the end; the body is not copied. An
// answer without one there leaves u as it was.
func (u *tokenUsage) scanTail(data []byte) {
	if len(data) > usageTail {
		data = data[len(data)-usageTail:]
	}
	for try := 0; try < maxUsageTries; try++ {
		i := bytes.LastIndex(data, usageKey)
		if i < 0 {
			return
		}
		if u.readAt(data, i+len(usageKey)) {
			return
		}
		data = data[:i]
	}
}

// readAt reads the usage object whose key ends at data[i] (at its closing
// quote's next byte). It reports false when what follows is not a key's
// object value; a null value counts as read and changes nothing.
func (u *tokenUsage) readAt(data []byte, i int) bool {
	i = jsonscan.SkipSpace(data, i)
	if i >= len(data) || data[i] != ':' {
		return false
	}
	i = jsonscan.SkipSpace(data, i+1)
	if i < len(data) && data[i] == 'n' {
		return bytes.HasPrefix(data[i:], []byte("null"))
	}
	if i >= len(data) || data[i] != '{' {
		return false
	}
	end, ok := jsonscan.SkipValue(data, i)
	if !ok {
		return false
	}
	return u.Read(data[i:end])
}

// recordUsage records p's request, once it finished after taking dur, in
// the ledger: its client, model and the endpoint that served it, with the
// tokens the answer reported, or when it reported none an estimate: the
// request's bytes over four for the prompt, and the answer's chunks (a
// stream) or bytes over four for the completion. A request no endpoint answered
// with success, or whose answer broke off before its usage, counts as an
// error.
func (r *Relay) recordUsage(p *proxied, end time.Time) {
	if p.rl.client == nil && !r.cfg.NoAuth {
		return // no client: an unauthenticated request
	}
	rl := &p.rl
	// A stream whose client left after its usage chunk was served whole.
	e := ledger.Entry{Time: end, Client: anonymousClient, Model: rl.model, Serving: rl.serving,
		Error: !rl.answered || (rl.err != nil && !rl.usage.Seen)}
	if rl.client != nil {
		e.Client = rl.client.Name
	}
	if rl.agent != "" {
		if r.providers.get(rl.agent) != nil {
			e.Provider = rl.agent
		} else {
			e.Agent = rl.agent
		}
	}
	if rl.answered || rl.usage.Seen {
		e.PromptTokens, e.CachedTokens, e.CompletionTokens, e.Estimated = rl.tokenCounts(len(p.body))
	}
	r.metrics.observeTokens(e.Client, rl.agent, e.PromptTokens, e.CachedTokens, e.CompletionTokens)
	if l := r.cfg.Ledger; l != nil {
		l.Record(e)
	}
}

// tokenCounts returns what the answer said about its tokens or, when it
// said nothing, an estimate from the request's bodyBytes and what was
// streamed (estimated true).
func (rl *reqLog) tokenCounts(bodyBytes int) (prompt, cached, completion int64, estimated bool) {
	if u := &rl.usage; u.Seen {
		return u.Prompt, u.Cached, u.Completion, false
	}
	return int64(bodyBytes) / estimateBytesPerToken, 0, rl.guess, true
}

// tokens returns the answer's prompt and completion tokens (tokenCounts).
func (rl *reqLog) tokens(bodyBytes int) int64 {
	prompt, _, completion, _ := rl.tokenCounts(bodyBytes)
	return prompt + completion
}

// checkBudget refuses a request of client c once c's budget is used up:
// its use through this relay and, as their reports say, through its peer
// relays. The answer is a 429 in OpenAI's insufficient_quota shape that
// says when the budget resets.
func (r *Relay) checkBudget(c *Client) error {
	l := r.cfg.Ledger
	if l == nil || c == nil || c.Budget.Unlimited() {
		return nil
	}
	now := r.cfg.Clock.Now()
	if v := l.Check(c.Name, ledger.Budget(c.Budget), now); v.Over {
		return errOverBudget(v, now)
	}
	return nil
}
