package relay

import (
	"encoding/json"

	"github.com/computeflux/computeflux/scheduler/jsonscan"
)

// scanRoutingFields fills f as json.Unmarshal(body, f) would, without
// decoding the rest of the body: json.Valid checks the whole document (so
// malformed JSON fails as before, with json.Unmarshal's error), then one
// pass over the top-level object (jsonscan.PlainObject) keeps the raw
// values of the routing keys and skips every other value. Unmarshal matched keys to fields and built a
// RawMessage copy for each; on a busy relay that was a few percent of its
// CPU. Semantics kept: keys match case-insensitively, the last duplicate
// wins, and a key with escapes or non-ASCII bytes (which encoding/json
// folds in its own way) falls back to json.Unmarshal itself. The raw values
// alias body.
func scanRoutingFields(body []byte, f *routingFields) error {
	if !json.Valid(body) {
		return json.Unmarshal(body, f)
	}
	var out routingFields
	if !jsonscan.PlainObject(body, func(key, v []byte) {
		switch {
		case jsonscan.KeyEqualFold(key, "model"):
			out.Model = v
		case jsonscan.KeyEqualFold(key, "stream"):
			out.Stream = v
		case jsonscan.KeyEqualFold(key, "prompt_cache_key"):
			out.PromptCacheKey = v
		case jsonscan.KeyEqualFold(key, "messages"):
			out.Messages = v
		case jsonscan.KeyEqualFold(key, "previous_response_id"):
			out.PreviousResponseID = v
		case jsonscan.KeyEqualFold(key, "store"):
			out.Store = v
		case jsonscan.KeyEqualFold(key, "service_tier"):
			out.ServiceTier = v
		case jsonscan.KeyEqualFold(key, "max_tokens"):
			out.MaxTokens = v
		case jsonscan.KeyEqualFold(key, "max_completion_tokens"):
			out.MaxCompletionTokens = v
		case jsonscan.KeyEqualFold(key, "max_output_tokens"):
			out.MaxOutputTokens = v
		}
	}) {
		// Not an object (a valid array, say), or a key that is not plain.
		return json.Unmarshal(body, f)
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
