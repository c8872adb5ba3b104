package simengine

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

type respJSON struct {
	ID     string `json:"id"`
	Object string `json:"object"`
	Status string `json:"status"`
	Output []struct {
		Content []struct {
			Type, Text string
		} `json:"content"`
	} `json:"output"`
	Usage struct {
		InputTokens        int `json:"input_tokens"`
		InputTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
		OutputTokens int `json:"output_tokens"`
	} `json:"usage"`
}

// TestResponsesConversation runs a three-turn previous_response_id
// conversation, the middle turn streamed: each follow-up hits the cache of
// the whole earlier conversation, and GET and DELETE work on stored ids.
func TestResponsesConversation(t *testing.T) {
	ts := startServer(t, Config{})
	instr := "You are a terse assistant. " + Filler(5, 200)
	resp, body := ts.post(t, "/v1/responses", map[string]any{"model": DefaultModel, "instructions": instr, "input": "Hello", "max_output_tokens": 20})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("turn 1: %d %s", resp.StatusCode, body)
	}
	var r1 respJSON
	if err := json.Unmarshal(body, &r1); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(r1.ID, "resp_") || r1.Object != "response" || r1.Status != "completed" ||
		len(r1.Output) != 1 || r1.Output[0].Content[0].Type != "output_text" || r1.Output[0].Content[0].Text == "" {
		t.Fatalf("turn 1: %s", body)
	}
	if r1.Usage.InputTokensDetails.CachedTokens != 0 || r1.Usage.OutputTokens != 20 {
		t.Fatalf("turn 1 usage %+v", r1.Usage)
	}

	// Turn 2, streamed: events named as the Responses API names them.
	resp, body = ts.post(t, "/v1/responses", map[string]any{"model": DefaultModel, "input": []map[string]any{
		{"role": "user", "content": []map[string]string{{"type": "input_text", "text": "More"}}}},
		"previous_response_id": r1.ID, "stream": true, "max_output_tokens": 5})
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("turn 2: %d %s", resp.StatusCode, body)
	}
	var names []string
	var completed respJSON
	var deltas strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		if name, ok := strings.CutPrefix(sc.Text(), "event: "); ok {
			names = append(names, name)
		}
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			var ev struct {
				Type     string          `json:"type"`
				Delta    string          `json:"delta"`
				Response json.RawMessage `json:"response"`
			}
			if err := json.Unmarshal([]byte(data), &ev); err != nil {
				t.Fatalf("event %q: %v", data, err)
			}
			if ev.Type != names[len(names)-1] {
				t.Fatalf("event: %s with type %s", names[len(names)-1], ev.Type)
			}
			deltas.WriteString(ev.Delta)
			if ev.Type == "response.completed" {
				_ = json.Unmarshal(ev.Response, &completed)
			}
		}
	}
	want := "response.created response.in_progress response.output_item.added response.content_part.added " +
		strings.Repeat("response.output_text.delta ", 5) +
		"response.output_text.done response.content_part.done response.output_item.done response.completed"
	if got := strings.Join(names, " "); got != want {
		t.Fatalf("events\n got %s\nwant %s", got, want)
	}
	if completed.Output[0].Content[0].Text != deltas.String() {
		t.Fatalf("completed text %q, deltas %q", completed.Output[0].Content[0].Text, deltas.String())
	}
	prevTokens := r1.Usage.InputTokens + r1.Usage.OutputTokens
	if c := completed.Usage.InputTokensDetails.CachedTokens; c != prevTokens/16*16 {
		t.Fatalf("turn 2 cached %d, want %d (the whole first turn, in full blocks)", c, prevTokens/16*16)
	}

	// Turn 3 continues turn 2.
	resp, body = ts.post(t, "/v1/responses", map[string]any{"model": DefaultModel, "input": "Again", "previous_response_id": completed.ID})
	var r3 respJSON
	if err := json.Unmarshal(body, &r3); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("turn 3: %d %s", resp.StatusCode, body)
	}
	prevTokens = completed.Usage.InputTokens + completed.Usage.OutputTokens
	if c := r3.Usage.InputTokensDetails.CachedTokens; c != prevTokens/16*16 {
		t.Fatalf("turn 3 cached %d, want %d", c, prevTokens/16*16)
	}

	// GET returns the stored object; DELETE removes it; then 404.
	get, err := ts.client.Get(ts.url + "/v1/responses/" + r1.ID)
	if err != nil {
		t.Fatal(err)
	}
	var got respJSON
	_ = json.NewDecoder(get.Body).Decode(&got)
	get.Body.Close()
	if get.StatusCode != http.StatusOK || got.ID != r1.ID || got.Output[0].Content[0].Text != r1.Output[0].Content[0].Text {
		t.Fatalf("GET: %d %+v", get.StatusCode, got)
	}
	del, _ := http.NewRequest(http.MethodDelete, ts.url+"/v1/responses/"+r1.ID, nil)
	dr, err := ts.client.Do(del)
	if err != nil {
		t.Fatal(err)
	}
	dr.Body.Close()
	if dr.StatusCode != http.StatusOK {
		t.Fatalf("DELETE: %d", dr.StatusCode)
	}
	resp, body = ts.post(t, "/v1/responses", map[string]any{"model": DefaultModel, "input": "x", "previous_response_id": r1.ID})
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), `"code":"previous_response_not_found"`) || !strings.Contains(string(body), `"param":"previous_response_id"`) {
		t.Fatalf("deleted previous: %d %s", resp.StatusCode, body)
	}
	// store:false is not kept.
	_, body = ts.post(t, "/v1/responses", map[string]any{"model": DefaultModel, "input": "x", "store": false, "max_output_tokens": 2})
	var r4 respJSON
	_ = json.Unmarshal(body, &r4)
	if g, _ := ts.client.Get(ts.url + "/v1/responses/" + r4.ID); g == nil || g.StatusCode != http.StatusNotFound {
		t.Fatalf("store:false response was stored")
	} else {
		g.Body.Close()
	}
	for _, bad := range []string{`{"model":"computeflux-sim"}`, `{"input":[{"type":"function_call"}]}`, `{"input":""}`} {
		if resp, body := ts.post(t, "/v1/responses", bad); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: %d %s", bad, resp.StatusCode, body)
		}
	}
}
