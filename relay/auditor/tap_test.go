package auditor

import (
	"bytes"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// TestAnswerTap writes answers through the tap in pieces of every size
// and checks that they pass unchanged and that what the checks read
// (usage, model, sizes) comes out of both shapes of answer.
func TestAnswerTap(t *testing.T) {
	var stream strings.Builder
	for i := range 300 {
		fmt.Fprintf(&stream, "data: {\"model\":\"m1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"w%d \"}}]}\n\n", i)
	}
	stream.WriteString("data: {\"model\":\"m1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":300,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n")
	plain := `{"model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2}}`
	for _, piece := range []int{1, 7, 100, 4096, 5000, 1 << 20} {
		for _, tc := range []struct {
			body   string
			stream bool
			want   audit.Usage
			text   int
		}{
			{stream.String(), true, audit.Usage{Prompt: 12, Completion: 300, Cached: 4}, stream.Len()},
			{plain, false, audit.Usage{Prompt: 9, Completion: 2}, len("hello there")},
		} {
			rec := httptest.NewRecorder()
			tap := NewTap(rec)
			for b := []byte(tc.body); len(b) > 0; {
				k := min(piece, len(b))
				if _, err := tap.Write(b[:k]); err != nil {
					t.Fatal(err)
				}
				b = b[k:]
			}
			if !bytes.Equal(rec.Body.Bytes(), []byte(tc.body)) {
				t.Fatalf("piece %d: the answer changed on its way", piece)
			}
			var o audit.Observed
			events, ok := tap.observed(&o, tc.stream)
			if wantEvents := strings.Count(tc.body, "data: "); events != wantEvents {
				t.Errorf("piece %d: %d events, want %d", piece, events, wantEvents)
			}
			if !ok || o.Usage == nil || *o.Usage != tc.want || o.Answered != "m1" || o.CompletionText != tc.text {
				t.Errorf("piece %d stream %v: %+v usage %+v", piece, tc.stream, o, o.Usage)
			}
			tap.Release()
		}
	}
	// An error status is no answer to check.
	rec := httptest.NewRecorder()
	tap := NewTap(rec)
	tap.WriteHeader(502)
	_, _ = tap.Write([]byte(plain))
	if _, ok := tap.observed(&audit.Observed{}, false); ok {
		t.Error("a 502 was checked as an answer")
	}
}
