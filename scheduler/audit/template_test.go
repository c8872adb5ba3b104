package audit

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// fixedText is a TextSource of one repeated word.
type fixedText struct{}

func (fixedText) Text(n int, _ *rand.Rand) string { return strings.Repeat("w", max(n, 1)) }
func (fixedText) Ident(rng *rand.Rand) string     { return Shaped("aaaaaa", rng) }

// A chat request as the OpenAI Python SDK sends it (spaced separators,
// non-ASCII escaped), with every field a front end sets.
const richRequest = `{"messages": [{"role": "system", "content": "You are Zelda's travel helper."}, ` +
	`{"role": "user", "content": [{"type": "text", "text": "Plan a trip to Z\u00fcrich for Quentin"}]}, ` +
	`{"role": "assistant", "content": null, "tool_calls": [{"id": "call_9XyZ12", "type": "function", "function": {"name": "zurich_weather", "arguments": "{\"city\": \"Z\\u00fcrich\", \"days\": 3}"}}]}, ` +
	`{"role": "tool", "tool_call_id": "call_9XyZ12", "content": "sunny, 21 C"}], ` +
	`"model": "llama-3.1-8b", "temperature": 0.8, "top_p": 0.95, "max_tokens": 48, "stop": ["\nUser:"], "stream": true, ` +
	`"stream_options": {"include_usage": true}, "user": "quentin@zelda.example", "seed": 42, ` +
	`"tools": [{"type": "function", "function": {"name": "zurich_weather", "description": "Weather for Zelda's trips", ` +
	`"parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}, "days": {"type": "integer"}}, "required": ["city"]}}}], ` +
	`"tool_choice": {"type": "function", "function": {"name": "zurich_weather"}}, "response_format": {"type": "json_object"}, "metadata": {"tenant": "zelda-42"}}`

// clientWords are words of richRequest's client: none may reach an audit.
var clientWords = []string{"Zelda", "Quentin", "rich", "zurich", "trip", "city", "days", "sunny", "tenant", "9XyZ12", "travel", "helper"}

func TestTemplateKeepsTheFormAndNothingElse(t *testing.T) {
	pseudo := func(s string) string { return "p-" + strings.Repeat("x", len(s)) }
	tp, err := Capture([]byte(richRequest), pseudo, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !tp.Sampled || !tp.Stream || tp.MaxTokens != 48 || tp.Messages != 4 || !tp.Seeded {
		t.Errorf("template %+v", tp)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	out := tp.Fill("llama-3.1-8b", fixedText{}, rng)
	if !json.Valid(out) {
		t.Fatalf("filled request is not JSON: %s", out)
	}
	for _, w := range clientWords {
		if bytes.Contains(bytes.ToLower(out), bytes.ToLower([]byte(w))) {
			t.Errorf("the client's %q is in the audit: %s", w, out)
		}
	}
	if got, want := topKeys(t, out), topKeys(t, []byte(richRequest)); !slices.Equal(got, want) {
		t.Errorf("fields %v, want %v", got, want)
	}
	var a, c map[string]any
	json.Unmarshal(out, &a)
	json.Unmarshal([]byte(richRequest), &c)
	for _, k := range []string{"model", "temperature", "top_p", "max_tokens", "stop", "stream", "stream_options", "seed", "response_format"} {
		if ja, jc := mustJSON(a[k]), mustJSON(c[k]); ja != jc {
			t.Errorf("%s: %s, the client's %s", k, ja, jc)
		}
	}
	if a["user"] != pseudo("quentin@zelda.example") {
		t.Errorf("user %v, want the pseudonym", a["user"])
	}
	// Roles and lengths.
	msgs := a["messages"].([]any)
	for i, m := range c["messages"].([]any) {
		if r1, r2 := m.(map[string]any)["role"], msgs[i].(map[string]any)["role"]; r1 != r2 {
			t.Errorf("message %d: role %v, the client's %v", i, r2, r1)
		}
	}
	if s := msgs[0].(map[string]any)["content"].(string); len(s) != len("You are Zelda's travel helper.") {
		t.Errorf("system content %q: length %d", s, len(s))
	}
	// One made-up name for the tool wherever the client named it, and
	// the same for the property required and in the arguments.
	tools := a["tools"].([]any)
	fn := tools[0].(map[string]any)["function"].(map[string]any)
	name := fn["name"].(string)
	choice := a["tool_choice"].(map[string]any)["function"].(map[string]any)["name"]
	call := msgs[2].(map[string]any)["tool_calls"].([]any)[0].(map[string]any)["function"].(map[string]any)
	if choice != name || call["name"] != name {
		t.Errorf("tool names %q, %q, %q: want one name", name, choice, call["name"])
	}
	params := fn["parameters"].(map[string]any)
	props := params["properties"].(map[string]any)
	req := params["required"].([]any)[0].(string)
	if _, ok := props[req]; !ok || len(props) != 2 || params["type"] != "object" {
		t.Errorf("schema %v: required %q is not a property", params, req)
	}
	var args map[string]any
	if err := json.Unmarshal([]byte(call["arguments"].(string)), &args); err != nil {
		t.Fatalf("arguments %q: %v", call["arguments"], err)
	}
	if _, ok := args[req]; !ok || len(args) != 2 {
		t.Errorf("arguments %v do not name the tool's properties %v", args, props)
	}
	// The tool call's ID: one made-up ID of the engine's form for both.
	id, ref := msgs[2].(map[string]any)["tool_calls"].([]any)[0].(map[string]any)["id"].(string), msgs[3].(map[string]any)["tool_call_id"]
	if id != ref || !strings.HasPrefix(id, "call_") || len(id) != len("call_9XyZ12") {
		t.Errorf("tool call ID %q, referred to as %q", id, ref)
	}
	// The client's formatting: spaced separators, non-ASCII escaped.
	if !bytes.Contains(out, []byte(`", "`)) || !bytes.Contains(out, []byte(`": `)) {
		t.Errorf("separators not the client's: %.200s", out)
	}
}

func TestTemplateFormatting(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct{ body, want string }{
		{`{"model":"m","messages":[{"role":"user","content":"hi there"}]}`, `{"model":"m","messages":[{"role":"user","content":"wwwwwwww"}]}`},
		{`{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}`, `{"model": "m", "messages": [{"role": "user", "content": "ww"}], "temperature": 0}`},
	} {
		tp, err := Capture([]byte(tc.body), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := string(tp.Fill("m", fixedText{}, rng)); got != tc.want {
			t.Errorf("%s:\n got %s\nwant %s", tc.body, got, tc.want)
		}
	}
	// Text with non-ASCII is escaped as the client escaped it.
	for _, tc := range []struct {
		body string
		want string
	}{
		{`{"model":"m","messages":[{"role":"user","content":"caf\u00e9"}]}`, `"caf\u00e9 <b>"`},
		{"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"caf\u00e9\"}]}", "\"caf\u00e9 <b>\""},
	} {
		tp, err := Capture([]byte(tc.body), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		got := tp.Fill("m", textOf("caf\u00e9 <b>"), rng)
		if !bytes.Contains(got, []byte(tc.want)) {
			t.Errorf("%s: %s, want %s in it", tc.body, got, tc.want)
		}
	}
}

type textOf string

func (s textOf) Text(int, *rand.Rand) string { return string(s) }
func (s textOf) Ident(*rand.Rand) string     { return "x_y" }

func TestTemplateRefuses(t *testing.T) {
	for _, body := range []string{
		`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:"}}]}]}`,
		`{"model":"m","prompt":"completions"}`,
		`{"model":"m","messages":[]}`,
		`[1,2]`,
		`{"model":"m","messages":[{"role":"user","content":"a"}]} trailing`,
		`{"model":"m","messages":[{"role":"user","content":"a"}],"user":{"id":1}}`,
		`{"model":"m","messages":` + strings.Repeat("[", 40) + strings.Repeat("]", 40) + `}`,
	} {
		if _, err := Capture([]byte(body), nil, nil); err == nil {
			t.Errorf("%.80s: taken as a template", body)
		}
	}
	if greedy, err := Capture([]byte(`{"model":"m","messages":[{"role":"user","content":"a"}],"temperature":0.0}`), nil, nil); err != nil || greedy.Sampled {
		t.Errorf("temperature 0.0: sampled %v, %v", greedy != nil && greedy.Sampled, err)
	}
}

func TestShaped(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, s := range []string{"user-1234", "7f3a9c2e-0b1d-4e5f-8a6b-1c2d3e4f5a6b", "Alice Smith", "a.b@c.de"} {
		got := Shaped(s, rng)
		if len(got) != len(s) || got == s {
			t.Errorf("Shaped(%q) = %q", s, got)
		}
		if m1, m2 := shapeMask(s), shapeMask(got); !bytes.Equal(m1, m2) && !strings.Contains(s, "-") {
			t.Errorf("Shaped(%q) = %q: shape %s, want %s", s, got, m2, m1)
		}
	}
}

func FuzzTemplate(f *testing.F) {
	f.Add([]byte(richRequest))
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"\ud83d\ude00"}]}],"tools":[{"function":{"parameters":{"properties":{"a":{}}}}}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		tp, err := Capture(body, func(s string) string { return s }, func(string) {})
		if err != nil {
			return
		}
		if !json.Valid(body) {
			t.Fatalf("captured a template from invalid JSON %q", body)
		}
		out := tp.Fill("m", textOf("t\"e\\x\u00e9\n"), rand.New(rand.NewPCG(1, 1)))
		if !json.Valid(out) {
			t.Fatalf("filled %q from %q: not JSON", out, body)
		}
		if a, b := topKeys(t, out), topKeys(t, body); !slices.Equal(a, b) {
			t.Fatalf("fields %v from %v", a, b)
		}
	})
}

func topKeys(t testing.TB, b []byte) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("not an object: %s", b)
	}
	var keys []string
	for dec.More() {
		k, _ := dec.Token()
		keys = append(keys, k.(string))
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestSetFields(t *testing.T) {
	body := `{"model": "m", "user" : "u-1",  "messages":[{"role":"user","content":"user"}],"safety_identifier":"x","seed":3}`
	got := string(SetFields([]byte(body), map[string]string{"user": "v-22", "safety_identifier": "y\"z", "absent": "no"}))
	want := `{"model": "m", "user" : "v-22",  "messages":[{"role":"user","content":"user"}],"safety_identifier":"y\"z","seed":3}`
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
	if got := string(SetFields([]byte(`[1]`), map[string]string{"user": "x"})); got != `[1]` {
		t.Errorf("not an object: %s", got)
	}
}
