package audit

import (
	"strings"
	"testing"
	"time"
)

func TestCheckAnswer(t *testing.T) {
	base := Observed{Model: "m1", Answered: "m1", PromptText: 1000, RequestBytes: 1200, Messages: 2, CompletionText: 200}
	use := func(p, c, cached int) *Usage { return &Usage{Prompt: p, Completion: c, Cached: cached} }
	tests := []struct {
		name string
		edit func(o *Observed)
		want string // checks found, space-separated
	}{
		{name: "honest", edit: func(o *Observed) { o.Usage = use(260, 50, 128) }},
		{name: "no usage, no model: nothing to check", edit: func(o *Observed) { o.Answered = "" }},
		{name: "another model named", edit: func(o *Observed) { o.Answered = "llama-3.1-8b"; o.Usage = use(260, 50, 0) }, want: "model"},
		{name: "model spelled by llama.cpp", edit: func(o *Observed) { o.Answered = "/models/M1.gguf" }},
		{name: "model spelled by Ollama", edit: func(o *Observed) { o.Answered = "m1:latest" }},
		{name: "model spelled with an org", edit: func(o *Observed) { o.Model = "meta-llama/Llama-3.1-8B"; o.Answered = "llama-3.1-8b" }},
		{name: "cached beyond prompt", edit: func(o *Observed) { o.Usage = use(260, 50, 300) }, want: "cached"},
		{name: "prompt tokens beyond bytes", edit: func(o *Observed) { o.Usage = use(1200+3*64+1, 50, 0) }, want: "prompt_tokens"},
		{name: "prompt tokens at the upper bound", edit: func(o *Observed) { o.Usage = use(1200+3*64, 50, 0) }},
		{name: "prompt tokens too few", edit: func(o *Observed) { o.Usage = use(1000/32-1, 50, 0) }, want: "prompt_tokens"},
		{name: "short prompt has no lower bound", edit: func(o *Observed) { o.PromptText = 100; o.RequestBytes = 150; o.Usage = use(1, 50, 0) }},
		{name: "media lifts the upper bound", edit: func(o *Observed) { o.Media = true; o.Usage = use(3000, 50, 0) }},
		{name: "completion beyond text", edit: func(o *Observed) { o.Usage = use(260, 209, 0) }, want: "completion_tokens"},
		{name: "completion at the bound", edit: func(o *Observed) { o.Usage = use(260, 208, 0) }},
		{name: "reasoning tokens count", edit: func(o *Observed) { o.Usage = &Usage{Prompt: 260, Completion: 900, Reasoning: 700} }},
		{name: "negative counts", edit: func(o *Observed) { o.Usage = use(-1, 5, 0) }, want: "usage"},
		{name: "several at once", edit: func(o *Observed) { o.Answered = "x"; o.Usage = use(5, 5000, 6) }, want: "model cached prompt_tokens completion_tokens"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := base
			tc.edit(&o)
			var got []string
			for _, f := range CheckAnswer(o, Limits{}) {
				got = append(got, f.Check)
				if f.Detail == "" {
					t.Errorf("%s without detail", f.Check)
				}
			}
			if g := strings.Join(got, " "); g != tc.want {
				t.Errorf("findings %q, want %q", g, tc.want)
			}
		})
	}
}

func TestLoadCheck(t *testing.T) {
	var c LoadCheck
	now := t0
	sample := func(published, measured int, age time.Duration) bool {
		now = now.Add(time.Second)
		_, found := c.Sample(now, now.Add(-age), published, measured)
		return found
	}
	// Honest: published at or above what this relay has in flight, or
	// within the slack of gossip lag.
	for range 20 {
		if sample(3, 5, 0) {
			t.Fatal("finding within the slack")
		}
	}
	// Four short samples, then one fine: the count starts again.
	for range 4 {
		if sample(0, 8, 0) {
			t.Fatal("finding before 5 in a row")
		}
	}
	sample(8, 8, 0)
	for range 4 {
		if sample(0, 8, 0) {
			t.Fatal("finding before 5 in a row, after a reset")
		}
	}
	if !sample(0, 8, 0) {
		t.Fatal("no finding after 5 short samples in a row")
	}
	// Stale figures are not compared.
	for range 10 {
		if sample(0, 8, time.Minute) {
			t.Fatal("finding on a stale figure")
		}
	}
}
