package simengine

import "testing"

func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_completion_tokens":3}`,
		`{"messages":[{"role":"assistant","content":null},{"role":"user","content":"x"}],"n":1}`,
		`{"prompt":"Once upon","max_tokens":2}`,
		`{"prompt":["one"]}`,
		`{"prompt":[1,2,3,4294967295]}`,
		`{"prompt":[-1]}`,
		`{"messages":[{"role":"<|x|>","content":"x"}]}`,
		`{`, `null`, `[]`, `{"prompt":null}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, parse := range []func([]byte) (*genRequest, error){parseChat, parseCompletion} {
			g, err := parse(body)
			if err != nil {
				if toAPIError(err).Status != 400 {
					t.Fatalf("parse error maps to %d: %v", toAPIError(err).Status, err)
				}
				continue
			}
			if len(g.tokens) == 0 || g.maxTokens < 0 {
				t.Fatalf("accepted unusable request %+v from %q", g, body)
			}
			if g.prompt != "" && CountTokens(g.prompt) != len(g.tokens) {
				t.Fatalf("token count mismatch for %q", g.prompt)
			}
		}
		_, _, _ = parseEmbedding(body)
	})
}

// FuzzParseResponses: any Responses API body is parsed or refused with an
// APIError, never a panic.
func FuzzParseResponses(f *testing.F) {
	f.Add([]byte(`{"model":"m","input":"hi","instructions":"be brief"}`))
	f.Add([]byte(`{"input":[{"role":"user","content":[{"type":"input_text","text":"x"}]}],"previous_response_id":"resp_1","stream":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		g, _, err := parseResponses(b, func(id string) (string, bool) { return "<|im_start|>user\nold<|im_end|>\n", id == "resp_1" })
		if err == nil && (g == nil || len(g.tokens) == 0) {
			t.Fatalf("parsed %q to an empty request", b)
		}
		if err != nil {
			if _, ok := err.(*APIError); !ok {
				t.Fatalf("error %T %v", err, err)
			}
		}
	})
}
