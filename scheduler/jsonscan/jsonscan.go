// Package jsonscan walks JSON without decoding it, allocating nothing: it
// finds where a value ends and hands out the raw bytes of an object's keys
// and values, which alias the input. It checks structure (brackets,
// strings, commas and colons), not the spelling of numbers and literals:
// a true result does not mean json.Valid, and a caller that must refuse
// what encoding/json refuses asks encoding/json too. Nesting deeper than
// MaxDepth fails, so hostile input cannot blow the stack or the time.
//
// Keys come as written, escapes kept. PlainKey tells the keys whose
// matching KeyEqualFold decides exactly as encoding/json matches keys to
// struct fields; the others are for encoding/json itself.
//
// The relay's routing fields, the prefix index's prompt hashing, the
// usage readers of relay and agent and the stream framer all read
// requests and answers through it.
package jsonscan

import "bytes"

// MaxDepth bounds nesting.
const MaxDepth = 256

// IsSpace reports whether c is JSON white space.
func IsSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// SkipSpace returns the index of the first byte at or after i that is not
// white space (len(b) when there is none).
func SkipSpace(b []byte, i int) int {
	for i < len(b) && IsSpace(b[i]) {
		i++
	}
	return i
}

// SkipValue returns the index just past the JSON value that starts at b[i]
// (after any space), and whether a whole value is there.
func SkipValue(b []byte, i int) (int, bool) {
	depth := 0
	for {
		i = SkipSpace(b, i)
		if i >= len(b) {
			return i, false
		}
		switch c := b[i]; c {
		case '"':
			j, ok := SkipString(b, i)
			if !ok {
				return j, false
			}
			i = j
		case '{', '[':
			depth++
			if depth > MaxDepth {
				return i, false
			}
			i++
			continue
		case '}', ']':
			if depth == 0 {
				return i, false
			}
			depth--
			i++
		case ',', ':':
			if depth == 0 {
				return i, false
			}
			i++
			continue
		default:
			j := i
			for j < len(b) && !IsSpace(b[j]) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ':' {
				j++
			}
			if j == i {
				return i, false
			}
			i = j
		}
		if depth == 0 {
			return i, true
		}
	}
}

// SkipString returns the index just past the string literal whose opening
// quote is b[i], and whether it is closed.
func SkipString(b []byte, i int) (int, bool) {
	i++
	for {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return len(b), false
		}
		i += j
		// Count the backslashes before the quote.
		k := i - 1
		for k >= 0 && b[k] == '\\' {
			k--
		}
		i++
		if (i-2-k)%2 == 0 {
			return i, true
		}
	}
}

// Object calls f with each top-level key (without its quotes) and raw
// value of the JSON object b, in order, and reports whether b has an
// object's shape, surrounding space allowed.
func Object(b []byte, f func(key, val []byte)) bool {
	i := SkipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return false
	}
	i = SkipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return len(bytes.TrimSpace(b[i+1:])) == 0
	}
	for {
		i = SkipSpace(b, i)
		if i >= len(b) || b[i] != '"' {
			return false
		}
		ke, ok := SkipString(b, i)
		if !ok {
			return false
		}
		key := b[i+1 : ke-1]
		i = SkipSpace(b, ke)
		if i >= len(b) || b[i] != ':' {
			return false
		}
		vs := SkipSpace(b, i+1)
		ve, ok := SkipValue(b, vs)
		if !ok {
			return false
		}
		f(key, b[vs:ve])
		i = SkipSpace(b, ve)
		if i >= len(b) {
			return false
		}
		if b[i] == '}' {
			return len(bytes.TrimSpace(b[i+1:])) == 0
		}
		if b[i] != ',' {
			return false
		}
		i++
	}
}

// PlainObject is Object for readers that match keys as encoding/json
// does: it calls f with the plain keys only (PlainKey) and reports false
// when the scan fails or any key is not plain, which leaves the verdict to
// encoding/json.
func PlainObject(b []byte, f func(key, val []byte)) bool {
	plain := true
	return Object(b, func(k, v []byte) {
		if !PlainKey(k) {
			plain = false
			return
		}
		f(k, v)
	}) && plain
}

// Array calls f with each element of the JSON array b until f returns
// false, and reports whether it went through a well-formed array.
func Array(b []byte, f func(v []byte) bool) bool {
	i := SkipSpace(b, 0)
	if i >= len(b) || b[i] != '[' {
		return false
	}
	i = SkipSpace(b, i+1)
	if i < len(b) && b[i] == ']' {
		return true
	}
	for {
		vs := SkipSpace(b, i)
		ve, ok := SkipValue(b, vs)
		if !ok {
			return false
		}
		if !f(b[vs:ve]) {
			return false
		}
		i = SkipSpace(b, ve)
		if i >= len(b) {
			return false
		}
		if b[i] == ']' {
			return true
		}
		if b[i] != ',' {
			return false
		}
		i++
	}
}

// PlainKey reports whether a raw key (as Object gives it) has no escapes
// and only ASCII bytes, so that KeyEqualFold matches it as encoding/json
// matches a key to a field.
func PlainKey(k []byte) bool {
	for _, c := range k {
		if c == '\\' || c >= 0x80 {
			return false
		}
	}
	return true
}

// KeyEqualFold reports whether the plain key k equals the lower-case ASCII
// name s regardless of case, as encoding/json matches keys to fields.
func KeyEqualFold(k []byte, s string) bool {
	if len(k) != len(s) {
		return false
	}
	for i := range len(k) {
		c := k[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// Count reads a JSON count: a non-negative decimal integer of at most 18
// digits, without the allocation strconv's error path costs.
func Count(v []byte) (int64, bool) {
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}
