package jsonscan

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

var seeds = []string{
	`{}`, ` { } `, `{"a":1}`, `{"a":"x\"y","b":[1,{"c":null}],"d":true}`,
	`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`,
	`{"k\u00e9y":1,"K":2,"k":3}`, `{"a":1,}`, `{"a" 1}`, `{"a":}`, `{"a":1}x`, `{"a":"\\"}`,
	`[1,2,[3]]`, `[]`, `[1,]`, `"s"`, `12`, `{"a":tru}`, `{"a":[}`, ``, `{`,
	strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1),
	`{"a":` + strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth) + `}`,
}

// pairs decodes the top-level members of a valid object with encoding/json:
// raw keys as Object gives them are compared after unquoting.
func pairs(t *testing.T, b []byte) (keys []string, vals [][]byte) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("%q: opening token %v, %v", b, tok, err)
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("%q: key: %v", b, err)
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("%q: value: %v", b, err)
		}
		keys = append(keys, tok.(string))
		vals = append(vals, v)
	}
	return keys, vals
}

// tooDeep reports whether b may nest deeper than MaxDepth (a crude count
// that can only overestimate).
func tooDeep(b []byte) bool {
	return bytes.Count(b, []byte("{"))+bytes.Count(b, []byte("[")) > MaxDepth
}

func check(t *testing.T, b []byte) {
	var keys []string
	var vals [][]byte
	okObj := Object(b, func(k, v []byte) {
		var s string
		if err := json.Unmarshal(append(append([]byte{'"'}, k...), '"'), &s); err != nil {
			s = "\x00undecodable"
		}
		keys = append(keys, s)
		vals = append(vals, v)
	})
	first := SkipSpace(b, 0)
	valid := json.Valid(b)
	isObj := valid && first < len(b) && b[first] == '{'
	switch {
	case isObj && !okObj && !tooDeep(b):
		t.Fatalf("Object(%q) refused a valid object", b)
	case isObj && okObj:
		wk, wv := pairs(t, b)
		if len(wk) != len(keys) {
			t.Fatalf("Object(%q): keys %q, encoding/json %q", b, keys, wk)
		}
		for i := range wk {
			if wk[i] != keys[i] || !bytes.Equal(wv[i], vals[i]) {
				t.Fatalf("Object(%q): member %d %q=%q, encoding/json %q=%q", b, i, keys[i], vals[i], wk[i], wv[i])
			}
		}
	case valid && !isObj && okObj:
		t.Fatalf("Object(%q) took a valid non-object for an object", b)
	}

	if valid && !tooDeep(b) {
		end, ok := SkipValue(b, 0)
		if !ok || SkipSpace(b, end) != len(b) {
			t.Fatalf("SkipValue(%q) = %d, %v on a valid document", b, end, ok)
		}
	}

	var elems [][]byte
	okArr := Array(b, func(v []byte) bool { elems = append(elems, v); return true })
	if isArr := valid && first < len(b) && b[first] == '['; isArr && !tooDeep(b) {
		var want []json.RawMessage
		if err := json.Unmarshal(b, &want); err != nil {
			t.Fatal(err)
		}
		if !okArr || len(want) != len(elems) {
			t.Fatalf("Array(%q) = %v with %q, encoding/json %q", b, okArr, elems, want)
		}
		for i := range want {
			if !bytes.Equal(bytes.TrimSpace(want[i]), elems[i]) {
				t.Fatalf("Array(%q): element %d %q, encoding/json %q", b, i, elems[i], want[i])
			}
		}
	}

	// PlainObject matches Object on plain keys and refuses others.
	plainKeys := 0
	okPlain := PlainObject(b, func(k, _ []byte) {
		if !PlainKey(k) {
			t.Fatalf("PlainObject(%q) gave the key %q", b, k)
		}
		plainKeys++
	})
	if okPlain && (!okObj || plainKeys != len(keys)) {
		t.Fatalf("PlainObject(%q) = true with %d keys; Object %v with %d", b, plainKeys, okObj, len(keys))
	}
}

func TestScanSeeds(t *testing.T) {
	for _, s := range seeds {
		check(t, []byte(s))
	}
	if Object([]byte(`{"a":1,}`), func(_, _ []byte) {}) {
		t.Error("a trailing comma passed")
	}
	if !Object([]byte(`{"a":tru}`), func(_, _ []byte) {}) {
		t.Error("a misspelt literal failed: the scan checks structure, not scalars")
	}
	if _, ok := SkipValue([]byte(seeds[len(seeds)-2]), 0); ok {
		t.Errorf("nesting of %d levels passed", MaxDepth+1)
	}
}

func TestKeys(t *testing.T) {
	for _, c := range []struct {
		k, s  string
		plain bool
		eq    bool
	}{
		{"model", "model", true, true}, {"MoDeL", "model", true, true}, {"mode", "model", true, false},
		{`mod\u0065l`, "model", false, false}, {"modél", "model", false, false},
	} {
		if PlainKey([]byte(c.k)) != c.plain {
			t.Errorf("PlainKey(%q) = %v", c.k, !c.plain)
		}
		if c.plain && KeyEqualFold([]byte(c.k), c.s) != c.eq {
			t.Errorf("KeyEqualFold(%q, %q) = %v", c.k, c.s, !c.eq)
		}
	}
	for v, want := range map[string]int64{"0": 0, "42": 42, "999999999999999999": 999999999999999999} {
		if n, ok := Count([]byte(v)); !ok || n != want {
			t.Errorf("Count(%q) = %d, %v", v, n, ok)
		}
	}
	for _, v := range []string{"", "-1", "1.5", "1e3", "null", "1000000000000000000"} {
		if _, ok := Count([]byte(v)); ok {
			t.Errorf("Count(%q) passed", v)
		}
	}
}

// FuzzScan: on any input, what the scan gives for valid JSON is what
// encoding/json decodes.
func FuzzScan(f *testing.F) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(check)
}

func BenchmarkObject(b *testing.B) {
	body := []byte(`{"model":"m1","stream":true,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Tell me about the weather in Paris today, please."}],"max_tokens":256,"temperature":0.7}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		Object(body, func(_, _ []byte) {})
	}
}
