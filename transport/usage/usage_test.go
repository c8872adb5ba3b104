package usage

import (
	"testing"

	"github.com/computeflux/computeflux/scheduler/jsonscan"
)

func TestRead(t *testing.T) {
	for _, tc := range []struct {
		name, obj string
		want      Counts
		ok        bool
	}{
		{"chat", `{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19,"prompt_tokens_details":{"cached_tokens":8}}`,
			Counts{Seen: true, Prompt: 12, Cached: 8, Completion: 7}, true},
		{"responses", `{"input_tokens":9,"input_tokens_details":{"cached_tokens":4},"output_tokens":2,"total_tokens":11}`,
			Counts{Seen: true, Prompt: 9, Cached: 4, Completion: 2}, true},
		{"messages", `{"input_tokens":3,"cache_read_input_tokens":100,"cache_creation_input_tokens":20,"output_tokens":5}`,
			Counts{Seen: true, Prompt: 123, Cached: 100, Completion: 5}, true},
		{"chat names first", `{"input_tokens":1,"prompt_tokens":2,"output_tokens":3,"completion_tokens":4}`,
			Counts{Seen: true, Prompt: 2, Completion: 4}, true},
		{"keys in any case", `{"Prompt_Tokens":6,"PROMPT_TOKENS_DETAILS":{"Cached_Tokens":2}}`,
			Counts{Seen: true, Prompt: 6, Cached: 2}, true},
		{"last duplicate", `{"prompt_tokens":1,"prompt_tokens":5}`, Counts{Seen: true, Prompt: 5}, true},
		{"escaped key", `{"prompt\u005ftokens":7}`, Counts{Seen: true, Prompt: 7}, true},
		{"escaped key in details", `{"prompt_tokens":7,"prompt_tokens_details":{"cached\u005ftokens":3}}`,
			Counts{Seen: true, Prompt: 7, Cached: 3}, true},
		{"not counts", `{"prompt_tokens":-3,"completion_tokens":"2","prompt_tokens_details":{"cached_tokens":null}}`, Counts{}, true},
		{"fraction", `{"prompt_tokens":3.5,"completion_tokens":2}`, Counts{Seen: true, Completion: 2}, true},
		{"empty", `{}`, Counts{}, true},
		{"null", `null`, Counts{}, false},
		{"array", `[1]`, Counts{}, false},
		{"truncated", `{"prompt_tokens":3,"completion_tok`, Counts{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c Counts
			if ok := c.Read([]byte(tc.obj)); ok != tc.ok || c != tc.want {
				t.Fatalf("Read(%s) = %+v, %v; want %+v, %v", tc.obj, c, ok, tc.want, tc.ok)
			}
			checkRead(t, []byte(tc.obj))
		})
	}
}

// TestReadMerges: the events of a Messages stream give the input and
// output counts apart; read one after the other, they make one Counts.
func TestReadMerges(t *testing.T) {
	var c Counts
	c.Read([]byte(`{"input_tokens":10,"cache_read_input_tokens":30,"output_tokens":1}`))
	c.Read([]byte(`{"output_tokens":42}`))
	if want := (Counts{Seen: true, Prompt: 40, Cached: 30, Completion: 42}); c != want {
		t.Fatalf("after both events: %+v; want %+v", c, want)
	}
}

// TestReadAllocates: the scan allocates nothing.
func TestReadAllocates(t *testing.T) {
	obj := []byte(`{"prompt_tokens":1200,"completion_tokens":70,"total_tokens":1270,"prompt_tokens_details":{"cached_tokens":1024}}`)
	var c Counts
	if n := testing.AllocsPerRun(100, func() { c.Read(obj) }); n != 0 {
		t.Fatalf("Read allocates %v times per call; want 0", n)
	}
}

// checkRead: Read decides as readJSON does; where encoding/json refuses
// the input, Read may still read what has an object's structure.
func checkRead(t *testing.T, obj []byte) {
	t.Helper()
	var got, want Counts
	ok := got.Read(obj)
	wok := want.readJSON(obj)
	if wok && (!ok || got != want) {
		t.Fatalf("Read(%q) = %+v, %v; encoding/json: %+v, %v", obj, got, ok, want, wok)
	}
	if !wok && ok && !jsonscan.Object(obj, func(_, _ []byte) {}) {
		t.Fatalf("Read(%q) = %+v, %v on what is not an object; encoding/json: %+v, %v", obj, got, ok, want, wok)
	}
}

// FuzzRead: the scan decides as encoding/json on any input.
func FuzzRead(f *testing.F) {
	for _, s := range []string{
		`{"prompt_tokens":12,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":8}}`,
		`{"input_tokens":3,"cache_read_input_tokens":100,"cache_creation_input_tokens":20,"output_tokens":5}`,
		`{"input_tokens":9,"input_tokens_details":{"cached_tokens":4},"output_tokens":2}`,
		`{"Prompt_Tokens":6,"prompt_tokens":7,"PROMPT_TOKENS_DETAILS":{"cached_tokens":2}}`,
		`{"prompt\u005ftokens":7,"ſrompt_tokens":1}`,
		`{"prompt_tokens_details":[],"input_tokens_details":{"cached_tokens":1}}`,
		`{"prompt_tokens": 007 ,"x":tru}`,
		` { } `, `null`, `[]`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(checkRead)
}
