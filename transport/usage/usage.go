// Package usage reads what an answer says about its tokens: the usage
// object of an OpenAI-style answer or stream chunk, in the names of the
// Chat Completions, Responses and Messages APIs. The agent reads it to
// correct its prefix index, the relay to record the ledger; both read it
// with Counts.Read.
//
// Read decides as its encoding/json reference (readJSON) does: keys are
// matched as encoding/json matches a struct's fields (case-insensitively,
// escapes decoded, the last of duplicates kept), and a count is a
// non-negative decimal integer, anything else (null, a string, a
// fraction, a negative number) being absent. It scans without allocating;
// a key it cannot match byte for byte (escaped or non-ASCII) sends the
// whole object to the reference. The scan checks the object's structure
// and the values it reads, not every scalar: an object malformed only in
// some other scalar (`tru`) is still read, where encoding/json would refuse
// it.
package usage

import (
	"encoding/json"

	"github.com/computeflux/computeflux/scheduler/jsonscan"
)

// Counts is what an answer said about its tokens. The zero value says
// nothing.
type Counts struct {
	// Seen reports that some count was read.
	Seen bool
	// Prompt is the prompt's tokens, cached ones included; Cached those
	// of them the engine's prefix cache held; Completion the answer's.
	Prompt, Cached, Completion int64
}

// fields are the values of a usage object that Read looks at, nil when
// absent.
type fields struct {
	prompt, input           []byte // prompt_tokens, input_tokens
	completion, output      []byte // completion_tokens, output_tokens
	promptDetails, inDetail []byte // prompt_tokens_details, input_tokens_details
	cacheRead, cacheCreated []byte // cache_read_input_tokens, cache_creation_input_tokens
}

// Read reads the usage object obj into c and reports whether obj is a
// JSON object. Counts present replace what c held and absent ones keep it,
// so the events of a Messages stream, which give the input and output
// counts apart, add up to one Counts. The names:
//
//   - the prompt: prompt_tokens, or else input_tokens; a Messages usage's
//     input_tokens leave out the cache's reads and writes
//     (cache_read_input_tokens, cache_creation_input_tokens), so when
//     either is present the prompt is their sum;
//   - cached: prompt_tokens_details.cached_tokens, or else
//     input_tokens_details.cached_tokens, or else cache_read_input_tokens;
//   - the completion: completion_tokens, or else output_tokens.
func (c *Counts) Read(obj []byte) bool {
	var f fields
	if !jsonscan.PlainObject(obj, f.set) {
		return c.readJSON(obj)
	}
	var pd, id []byte
	for _, d := range [...]struct{ v, cached *[]byte }{{&f.promptDetails, &pd}, {&f.inDetail, &id}} {
		if v := *d.v; len(v) > 0 && v[0] == '{' {
			if !jsonscan.PlainObject(v, func(k, v []byte) {
				if jsonscan.KeyEqualFold(k, "cached_tokens") {
					*d.cached = v
				}
			}) {
				return c.readJSON(obj)
			}
		}
	}
	c.apply(&f, pd, id)
	return true
}

// set notes the value of key k, as Read's scan passes it.
func (f *fields) set(k, v []byte) {
	for _, n := range [...]struct {
		name string
		v    *[]byte
	}{
		{"prompt_tokens", &f.prompt}, {"input_tokens", &f.input},
		{"completion_tokens", &f.completion}, {"output_tokens", &f.output},
		{"prompt_tokens_details", &f.promptDetails}, {"input_tokens_details", &f.inDetail},
		{"cache_read_input_tokens", &f.cacheRead}, {"cache_creation_input_tokens", &f.cacheCreated},
	} {
		if jsonscan.KeyEqualFold(k, n.name) {
			*n.v = v
			return
		}
	}
}

// apply sets c from a usage object's fields and the cached_tokens of its
// two details objects (pd, id; nil when absent).
func (c *Counts) apply(f *fields, pd, id []byte) {
	prompt, okP := first(f.prompt, f.input)
	read, okR := jsonscan.Count(f.cacheRead)
	created, okW := jsonscan.Count(f.cacheCreated)
	if okP && (okR || okW) {
		prompt += read + created
	}
	cached, okC := first(pd, id)
	if !okC && okR {
		cached, okC = read, true
	}
	completion, okT := first(f.completion, f.output)
	for _, n := range [...]struct {
		v  int64
		ok bool
		to *int64
	}{{prompt, okP, &c.Prompt}, {cached, okC, &c.Cached}, {completion, okT, &c.Completion}} {
		if n.ok {
			*n.to = n.v
			c.Seen = true
		}
	}
}

// first returns the first of a and b that is a count.
func first(a, b []byte) (int64, bool) {
	if n, ok := jsonscan.Count(a); ok {
		return n, true
	}
	return jsonscan.Count(b)
}

// wire is a usage object as encoding/json reads it for readJSON.
type wire struct {
	Prompt        json.RawMessage `json:"prompt_tokens"`
	Input         json.RawMessage `json:"input_tokens"`
	Completion    json.RawMessage `json:"completion_tokens"`
	Output        json.RawMessage `json:"output_tokens"`
	PromptDetails json.RawMessage `json:"prompt_tokens_details"`
	InputDetails  json.RawMessage `json:"input_tokens_details"`
	CacheRead     json.RawMessage `json:"cache_read_input_tokens"`
	CacheCreated  json.RawMessage `json:"cache_creation_input_tokens"`
}

// details is a details object as encoding/json reads it for readJSON.
type details struct {
	Cached json.RawMessage `json:"cached_tokens"`
}

// readJSON is Read with encoding/json: the reference it keeps to, and its
// path for the objects its scan does not decide.
func (c *Counts) readJSON(obj []byte) bool {
	var w wire
	if i := jsonscan.SkipSpace(obj, 0); i >= len(obj) || obj[i] != '{' || json.Unmarshal(obj, &w) != nil {
		return false
	}
	cached := func(v json.RawMessage) []byte {
		var d details
		if len(v) == 0 || v[0] != '{' || json.Unmarshal(v, &d) != nil {
			return nil
		}
		return d.Cached
	}
	f := fields{prompt: w.Prompt, input: w.Input, completion: w.Completion, output: w.Output,
		cacheRead: w.CacheRead, cacheCreated: w.CacheCreated}
	c.apply(&f, cached(w.PromptDetails), cached(w.InputDetails))
	return true
}
