package relay

import (
	"bytes"
	"encoding/json"
	"testing"
)

// routingSeeds are request bodies whose routing fields the scan must read
// exactly as json.Unmarshal does.
var routingSeeds = []string{
	`{"model":"m1","messages":[{"role":"user","content":"hi"}]}`,
	`{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}],"prompt_cache_key":"s1"}`,
	` {"messages":[{"content":"a \"quoted\" } ] { text"}], "model" : "m\u00e9" , "stream":false } `,
	`{"MODEL":"upper","Stream":true}`,
	`{"model":"first","model":"second"}`,
	`{"mod\u0065l":"escaped key"}`,
	`{"model":null,"stream":null,"messages":null}`,
	`{"model":1,"stream":"yes","messages":{}}`,
	`{"nested":{"model":"inner"},"model":"outer","list":[1,2.5e3,-0,true,false,null,"x"]}`,
	`{"ſtream":true,"model":"kelvin-s"}`,
	`{"model":"m1","input":"hi","previous_response_id":"resp_1","STORE":false}`,
	`{}`,
	`{"model":"m1"`,
	`{"model":"m1"} trailing`,
	`[1,2]`,
	`"str"`,
	``,
	`{"model":"m1",}`,
	"{\"model\":\"\xff\"}",
	"{\"\xff\":1,\"model\":\"m\"}",
}

func checkScanMatchesUnmarshal(t *testing.T, body []byte) {
	t.Helper()
	var want, got routingFields
	werr := json.Unmarshal(body, &want)
	gerr := scanRoutingFields(body, &got)
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("%q: Unmarshal err %v, scan err %v", body, werr, gerr)
	}
	if werr != nil {
		return
	}
	for _, p := range [][2]json.RawMessage{{want.Model, got.Model}, {want.Stream, got.Stream}, {want.PromptCacheKey, got.PromptCacheKey}, {want.Messages, got.Messages},
		{want.PreviousResponseID, got.PreviousResponseID}, {want.Store, got.Store}} {
		if !bytes.Equal(p[0], p[1]) || (p[0] == nil) != (p[1] == nil) {
			t.Fatalf("%q:\nUnmarshal %+v\nscan      %+v", body, want, got)
		}
	}
}

func TestScanRoutingFieldsMatchesUnmarshal(t *testing.T) {
	for _, s := range routingSeeds {
		checkScanMatchesUnmarshal(t, []byte(s))
	}
}

// FuzzScanRoutingFields checks the scan against json.Unmarshal on any body.
func FuzzScanRoutingFields(f *testing.F) {
	for _, s := range routingSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		checkScanMatchesUnmarshal(t, body)
	})
}

func BenchmarkParseRouting(b *testing.B) {
	body := []byte(`{"model":"m1","stream":true,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Tell me about the weather in Paris today, please."}],"max_tokens":256,"temperature":0.7}`)
	b.ReportAllocs()
	b.Run("scan", func(b *testing.B) {
		for b.Loop() {
			var f routingFields
			_ = scanRoutingFields(body, &f)
		}
	})
	b.Run("unmarshal", func(b *testing.B) {
		for b.Loop() {
			var f routingFields
			_ = json.Unmarshal(body, &f)
		}
	})
}
