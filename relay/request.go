package relay

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"unicode/utf8"
)

// routing is what the relay reads from a request body: just enough to route
// it. The body itself is forwarded byte for byte.
type routing struct {
	model   string
	stream  bool
	session string // prompt_cache_key, when it is a non-empty string

	// The raw Responses routing fields (responses.go), aliasing the body.
	previousResponseID, store json.RawMessage

	// tier is the request's service_tier; "" when absent.
	tier string
	// maxTokens is the answer's bound the request sets (max_tokens,
	// max_completion_tokens or max_output_tokens); 0 when none.
	maxTokens int
}

// routingFields decodes the routing fields lazily: RawMessage keeps the
// decoder from building values for the rest of the body.
type routingFields struct {
	Model          json.RawMessage `json:"model"`
	Stream         json.RawMessage `json:"stream"`
	PromptCacheKey json.RawMessage `json:"prompt_cache_key"`
	Messages       json.RawMessage `json:"messages"`

	PreviousResponseID json.RawMessage `json:"previous_response_id"`
	Store              json.RawMessage `json:"store"`

	ServiceTier         json.RawMessage `json:"service_tier"`
	MaxTokens           json.RawMessage `json:"max_tokens"`
	MaxCompletionTokens json.RawMessage `json:"max_completion_tokens"`
	MaxOutputTokens     json.RawMessage `json:"max_output_tokens"`
}

// parseRouting reads the routing fields of an OpenAI request body. It fails
// with a 400 *Error on malformed JSON, a body that is not an object, a
// missing, empty or non-string model, a non-boolean stream, or messages
// that are not an array.
func parseRouting(body []byte) (routing, error) {
	var f routingFields
	trimmed := bytes.TrimLeft(body, " \t\r\n")
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return routing{}, errBadRequest("invalid_json", "The request body must be a JSON object", nil)
	}
	if err := scanRoutingFields(body, &f); err != nil {
		return routing{}, errBadRequest("invalid_json", "The request body is not valid JSON", err)
	}
	var rt routing
	if len(f.Model) == 0 || string(f.Model) == "null" {
		return routing{}, errBadRequest("missing_model", "The request must name a 'model'", nil)
	}
	if f.Model[0] != '"' {
		return routing{}, errBadRequest("invalid_model", "'model' must be a string", nil)
	}
	var err error
	if rt.model, err = jsonString(f.Model); err != nil || rt.model == "" {
		return routing{}, errBadRequest("missing_model", "The request must name a non-empty 'model'", err)
	}
	switch string(f.Stream) {
	case "", "null", "false":
	case "true":
		rt.stream = true
	default:
		return routing{}, errBadRequest("invalid_stream", "'stream' must be a boolean", nil)
	}
	if len(f.Messages) > 0 && f.Messages[0] != '[' && string(f.Messages) != "null" {
		// Caught here, it costs no agent a round trip.
		return routing{}, errBadRequest("invalid_messages", "'messages' must be an array", nil)
	}
	if len(f.PromptCacheKey) > 0 && f.PromptCacheKey[0] == '"' {
		// A malformed key only loses affinity; it is the engine's business
		// to reject it.
		rt.session, _ = jsonString(f.PromptCacheKey)
	}
	rt.previousResponseID, rt.store = f.PreviousResponseID, f.Store
	if len(f.ServiceTier) > 0 && string(f.ServiceTier) != "null" {
		tier, err := jsonString(f.ServiceTier)
		if err != nil || f.ServiceTier[0] != '"' {
			return routing{}, errBadRequest("invalid_service_tier", "'service_tier' must be a string: auto, default, flex or priority", err)
		}
		switch tier {
		case "auto", "default", "flex", "priority", "scale":
		default:
			return routing{}, errBadRequest("invalid_service_tier", "Unknown 'service_tier' "+strconv.Quote(tier)+": use auto, default, flex or priority", nil)
		}
		rt.tier = tier
	}
	for _, raw := range []json.RawMessage{f.MaxTokens, f.MaxCompletionTokens, f.MaxOutputTokens} {
		// A malformed bound is the engine's to reject; it only leaves
		// the request's cost at the default estimate.
		if n, err := strconv.Atoi(string(raw)); err == nil && n > 0 {
			rt.maxTokens = max(rt.maxTokens, n)
		}
	}
	return rt, nil
}

// jsonString decodes raw, a JSON string json.Valid accepted, as
// json.Unmarshal into a string would. A string without escapes, control
// bytes or invalid UTF-8 (which Unmarshal replaces) is its bytes between
// the quotes: that takes one allocation where Unmarshal took several.
func jsonString(raw []byte) (string, error) {
	if len(raw) >= 2 && raw[0] == '"' && raw[len(raw)-1] == '"' {
		in := raw[1 : len(raw)-1]
		plain := utf8.Valid(in)
		for _, c := range in {
			if c == '\\' || c == '"' || c < 0x20 {
				plain = false
				break
			}
		}
		if plain {
			return string(in), nil
		}
	}
	var s string
	err := json.Unmarshal(raw, &s)
	return s, err
}

// preallocBody is the largest declared body length given its buffer before
// the bytes arrive; past it the buffer grows with what is read, so that a
// client announcing a body it never sends holds no memory for it.
const preallocBody = 1 << 20

// readBody reads a request body up to limit bytes; a larger body is a 413.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, error) {
	if r.ContentLength > limit {
		return nil, errTooLarge(limit)
	}
	if r.ContentLength > 0 && r.ContentLength <= preallocBody {
		// The length is known and small: read it into a slice of that
		// size (a bytes.Buffer would grow once more for its MinRead),
		// and the server's reader ends the body there. A larger declared
		// length is not trusted with memory before its bytes arrive.
		b := make([]byte, r.ContentLength)
		if _, err := io.ReadFull(r.Body, b); err != nil {
			return nil, errBadRequest("body_read_failed", "Could not read the request body", err)
		}
		return b, nil
	}
	rd := http.MaxBytesReader(w, r.Body, limit)
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(rd); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, errTooLarge(limit)
		}
		return nil, errBadRequest("body_read_failed", "Could not read the request body", err)
	}
	return buf.Bytes(), nil
}

// sessionKey is the request's affinity key: X-Session-ID, else the body's
// prompt_cache_key. The "user" field names a person, not a conversation.
func sessionKey(r *http.Request, rt routing) string {
	if v := r.Header[headerSessionCanon]; len(v) > 0 && v[0] != "" {
		return v[0]
	}
	return rt.session
}
