package relay

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"math/rand/v2"
	"strconv"

	"github.com/computeflux/computeflux/scheduler/audit"
	"github.com/computeflux/computeflux/scheduler/jsonscan"
)

// What an agent gets of a generation request, while audits run: the
// client's request with a seed of the relay's where the client set none,
// and pseudonyms for the fields that name a person or a conversation
// (user, safety_identifier, prompt_cache_key). Every chat and completions
// request the relay forwards to an agent gets both, so that audits, which
// carry seeds (sampled answers compare only under a shared seed) and such
// fields, look like any other request; and a contributor never learns the
// names a client gives its users. Provider endpoints get the request as
// the client sent it.

// Paths of the generation APIs that get a seed.
const (
	pathChat        = "/v1/chat/completions"
	pathCompletions = "/v1/completions"
)

// pseudonyms maps identity values to pseudonyms of the same shape, keyed
// by a secret of the relay: the same value always gets the same
// pseudonym, and nothing maps one back.
type pseudonyms struct{ key []byte }

func newPseudonyms(secret []byte) pseudonyms {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("computeflux pseudonyms v1"))
	return pseudonyms{key: m.Sum(nil)}
}

// of returns v's pseudonym: a string of v's shape (audit.Shaped) drawn
// from HMAC(key, v).
func (ps pseudonyms) of(v string) string {
	m := hmac.New(sha256.New, ps.key)
	m.Write([]byte(v))
	var seed [32]byte
	copy(seed[:], m.Sum(nil))
	return audit.Shaped(v, rand.New(rand.NewChaCha8(seed)))
}

// relaySeed draws the seed the relay sets on a request without one: a
// non-negative 31-bit integer, which every engine's parser takes.
func relaySeed() uint32 { return rand.Uint32() >> 1 }

// forwardBody returns body as an agent gets it: a seed where the client
// set none, and, when pseudo is set, pseudonyms for the identity fields.
// body must be a JSON object (parseRouting checked it).
func forwardBody(body []byte, seed uint32, pseudo func(string) string) []byte {
	seeded := false
	type span struct{ start, end int }
	var ids []span
	base := cap(body)
	jsonscan.Object(body, func(key, val []byte) {
		switch string(key) {
		case "seed":
			seeded = true
		case "user", "safety_identifier", "prompt_cache_key":
			if pseudo != nil && len(val) > 1 && val[0] == '"' {
				start := base - cap(val)
				ids = append(ids, span{start, start + len(val)})
			}
		}
	})
	out := make([]byte, 0, len(body)+24)
	i := 0
	if !seeded {
		open := jsonscan.SkipSpace(body, 0) + 1 // past '{'
		out = append(out, body[:open]...)
		out = append(out, `"seed":`...)
		out = strconv.AppendUint(out, uint64(seed), 10)
		if j := jsonscan.SkipSpace(body, open); j < len(body) && body[j] != '}' {
			out = append(out, ',')
		}
		i = open
	}
	for _, sp := range ids {
		var v string
		if json.Unmarshal(body[sp.start:sp.end], &v) != nil {
			continue
		}
		out = append(out, body[i:sp.start]...)
		out = appendJSONString(out, pseudo(v))
		i = sp.end
	}
	return append(out, body[i:]...)
}

// appendJSONString appends s as a JSON string, without the HTML escapes
// of json.Marshal (clients' encoders write none).
func appendJSONString(b []byte, s string) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s)
	return append(b, bytes.TrimSuffix(buf.Bytes(), []byte("\n"))...)
}

// seedBytes is forwardBody with a fresh seed and no pseudonyms: what the
// auditor's prompts get (their identity fields are pseudonyms already).
func seedBytes(body []byte) []byte { return forwardBody(body, relaySeed(), nil) }

// pseudonymSecret derives the pseudonyms' secret from the relay's identity
// key when it has one (the same pseudonyms across restarts), else from
// random bytes.
func pseudonymSecret(identity []byte) []byte {
	if len(identity) > 0 {
		return identity
	}
	var b [32]byte
	for i := 0; i < len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], rand.Uint64())
	}
	return b[:]
}
