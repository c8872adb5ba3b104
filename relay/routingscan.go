package relay

import (
	"encoding/json"

	"github.com/computeflux/computeflux/scheduler"
)

// scanRoutingFields fills f as json.Unmarshal(body, f) would, without
// decoding the rest of the body: json.Valid checks the whole document (so
// malformed JSON fails as before, with json.Unmarshal's error), then one
// pass over the top-level object keeps the raw values of the routing keys
// and skips every other value. Unmarshal matched keys to fields and built a
// RawMessage copy for each; on a busy relay that was a few percent of its
// CPU. Semantics kept: keys match case-insensitively, the last duplicate
// wins, and a key with escapes or non-ASCII bytes (which encoding/json
// folds in its own way) falls back to json.Unmarshal itself. The raw values
// alias body.
func scanRoutingFields(body []byte, f *routingFields) error {
	if !json.Valid(body) {
		return json.Unmarshal(body, f)
	}
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return json.Unmarshal(body, f)
	}
	var out routingFields
	i++
	for {
		i = skipSpace(body, i)
		if body[i] == '}' {
			break
		}
		ke := skipString(body, i) // just past the key's closing quote
		key := body[i+1 : ke-1]
		i = skipSpace(body, ke)    // at ':'
		vs := skipSpace(body, i+1) // the value
		i = skipValue(body, vs)
		if !scheduler.PlainKey(key) {
			return json.Unmarshal(body, f)
		}
		switch {
		case scheduler.KeyEqualFold(key, "model"):
			out.Model = body[vs:i]
		case scheduler.KeyEqualFold(key, "stream"):
			out.Stream = body[vs:i]
		case scheduler.KeyEqualFold(key, "prompt_cache_key"):
			out.PromptCacheKey = body[vs:i]
		case scheduler.KeyEqualFold(key, "messages"):
			out.Messages = body[vs:i]
		case scheduler.KeyEqualFold(key, "previous_response_id"):
			out.PreviousResponseID = body[vs:i]
		case scheduler.KeyEqualFold(key, "store"):
			out.Store = body[vs:i]
		case scheduler.KeyEqualFold(key, "service_tier"):
			out.ServiceTier = body[vs:i]
		case scheduler.KeyEqualFold(key, "max_tokens"):
			out.MaxTokens = body[vs:i]
		case scheduler.KeyEqualFold(key, "max_completion_tokens"):
			out.MaxCompletionTokens = body[vs:i]
		case scheduler.KeyEqualFold(key, "max_output_tokens"):
			out.MaxOutputTokens = body[vs:i]
		}
		i = skipSpace(body, i)
		if body[i] == ',' {
			i++
			continue
		}
		break // '}'
	}
	// Unmarshal leaves fields whose key is absent as they were.
	if out.Model != nil {
		f.Model = out.Model
	}
	if out.Stream != nil {
		f.Stream = out.Stream
	}
	if out.PromptCacheKey != nil {
		f.PromptCacheKey = out.PromptCacheKey
	}
	if out.Messages != nil {
		f.Messages = out.Messages
	}
	if out.PreviousResponseID != nil {
		f.PreviousResponseID = out.PreviousResponseID
	}
	if out.Store != nil {
		f.Store = out.Store
	}
	for _, p := range [...]struct{ dst, src *json.RawMessage }{
		{&f.ServiceTier, &out.ServiceTier}, {&f.MaxTokens, &out.MaxTokens},
		{&f.MaxCompletionTokens, &out.MaxCompletionTokens}, {&f.MaxOutputTokens, &out.MaxOutputTokens},
	} {
		if *p.src != nil {
			*p.dst = *p.src
		}
	}
	return nil
}

// The helpers below walk a document json.Valid accepted: they need not
// check syntax, only find where things end.

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n') {
		i++
	}
	return i
}

// skipString returns the index just past the string starting at b[i] == '"'.
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return i
}

// skipValue returns the index just past the value starting at b[i].
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = skipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	default: // number, true, false, null
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\r', '\n':
				return i
			}
			i++
		}
		return i
	}
}
