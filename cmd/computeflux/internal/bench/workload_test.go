package bench

import (
	"math"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
)

func TestChatDeterministic(t *testing.T) {
	cfg := ChatConfig{Sessions: 50}
	a, err := Chat(cfg, 7)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Chat(cfg, 7)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave different workloads")
	}
	c, _ := Chat(cfg, 8)
	if reflect.DeepEqual(a.Sessions, c.Sessions) {
		t.Fatal("different seeds gave the same sessions")
	}
	if len(a.Sessions) != 50 || a.Requests() < 50 {
		t.Fatalf("%d sessions, %d requests", len(a.Sessions), a.Requests())
	}
	for i, s := range a.Sessions {
		if i > 0 && s.Start < a.Sessions[i-1].Start {
			t.Fatal("sessions not sorted by start")
		}
		if len(s.Turns) > 16 || s.Turns[0].Think != 0 {
			t.Fatalf("session %d: %d turns, first think %v", i, len(s.Turns), s.Turns[0].Think)
		}
		for _, tn := range s.Turns[1:] {
			if tn.Think <= 0 {
				t.Fatalf("session %d: a later turn without think time", i)
			}
		}
	}
}

func TestChatSkew(t *testing.T) {
	w, err := Chat(ChatConfig{Sessions: 400, HeavyShare: 0.05}, 1)
	if err != nil {
		t.Fatal(err)
	}
	heavy, total := 0, w.Requests()
	for i, s := range w.Sessions {
		if i%20 == 10 {
			heavy += len(s.Turns)
		}
	}
	// 5% of the sessions send a large share of the requests.
	if share := float64(heavy) / float64(total); share < 0.3 {
		t.Fatalf("heavy sessions send %.0f%% of the requests", 100*share)
	}
}

// The conversation a live client sends renders to the tokens the
// simulation builds turn by turn.
func TestConversationMatchesSimTokens(t *testing.T) {
	w, err := Chat(ChatConfig{Sessions: 3, SystemTokens: 100}, 3)
	if err != nil {
		t.Fatal(err)
	}
	eng, _ := simengine.NewEngine(simengine.EngineConfig{})
	for i := range w.Sessions {
		s := &w.Sessions[i]
		conv := newConversation(w, s)
		var inc []simengine.Token
		for k := range s.Turns {
			tn := &s.Turns[k]
			msgs := conv.next(tn)
			if k == 0 {
				inc = simengine.Tokenize(nil, imStart+"system\n"+w.System+imEnd+imStart+"user\n")
			} else {
				inc = simengine.Tokenize(inc, imEnd+imStart+"user\n")
			}
			inc = simengine.Tokenize(inc, simengine.Filler(tn.QuestionSeed, tn.QuestionTokens)+imEnd+genPrompt)
			whole := simengine.Tokenize(nil, render(msgs))
			if !reflect.DeepEqual(inc, whole) {
				t.Fatalf("session %d turn %d: incremental tokens differ from the rendered conversation", i, k)
			}
			req := &simengine.Request{Tokens: whole, MaxTokens: tn.MaxTokens}
			conv.answered(strings.Join(eng.AnswerText(req), ""))
			inc = append(inc, eng.Answer(req)...)
		}
	}
}

func TestReadTrace(t *testing.T) {
	f, err := os.Open("testdata/mooncake_head.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := ReadTrace(f, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 9 {
		t.Fatalf("%d records", len(recs))
	}
	if r := recs[1]; r.Timestamp != 0 || r.InputLength != 7322 || r.OutputLength != 490 || len(r.HashIDs) != 15 || r.HashIDs[14] != 27 {
		t.Fatalf("record 1: %+v", r)
	}
	w, err := TraceWorkload(recs, TraceConfig{}, 1)
	if err != nil {
		t.Fatal(err)
	}
	// Line 8 continues line 2 (all 14 full blocks), line 9 continues line 7.
	if len(w.Sessions) != 7 || w.Requests() != 9 {
		t.Fatalf("%d sessions, %d requests", len(w.Sessions), w.Requests())
	}
	for _, s := range w.Sessions {
		if len(s.Turns) == 2 {
			first, second := s.Turns[0], s.Turns[1]
			if !(first.InputTokens == 7322 && second.InputTokens == 7833) && !(first.InputTokens == 1477 && second.InputTokens == 2103) {
				t.Fatalf("unexpected session: %d then %d tokens", first.InputTokens, second.InputTokens)
			}
		}
	}
	// The six requests at timestamp 0 are spread over the 3 s bucket.
	var at0 []time.Duration
	for _, s := range w.Sessions {
		for _, tn := range s.Turns {
			if tn.At < 3*time.Second {
				at0 = append(at0, tn.At)
			}
		}
	}
	if len(at0) != 6 || at0[0] == at0[5] {
		t.Fatalf("bucket spread: %v", at0)
	}
	// Limits and malformed lines.
	f.Seek(0, 0)
	if recs, _ := ReadTrace(f, 4); len(recs) != 4 {
		t.Fatalf("limit 4 read %d", len(recs))
	}
	if _, err := ReadTrace(strings.NewReader("{\"timestamp\": 0, \"input_length\": 600, \"hash_ids\": [1]}\n"), 0); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("bad hash ids accepted: %v", err)
	}
	if _, err := ReadTrace(strings.NewReader("\n{oops\n"), 0); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Fatalf("malformed line: %v", err)
	}
}

func TestOracleChatByHand(t *testing.T) {
	// The template's token counts, as the engine tokenizes it.
	for text, want := range map[string]int{imStart + "system\n": 3, imEnd: 1, imStart + "user\n": 2, genPrompt: 3} {
		if got := simengine.CountTokens(text); got != want {
			t.Fatalf("%q is %d tokens, want %d", text, got, want)
		}
	}
	turn := Turn{QuestionTokens: 10, MaxTokens: 20}
	w := &Workload{Chat: true, System: simengine.Filler(1, 100), Sessions: []Session{
		{Key: "a", Turns: []Turn{turn, turn}}, {Key: "b", Turns: []Turn{turn, turn}},
	}}
	// First turn: 3 + 100 + 1 (system) + 2 + 10 + 1 (user) + 3 = 120 tokens;
	// the second: 120 + 20 answer + 1 + 2 + 10 + 1 + 3 = 157 tokens, of which
	// the previous 140 are cached in full blocks: 128. Session b's first turn
	// finds the 106-token system prefix: 96.
	want := float64(0+128+96+128) / float64(120+157+120+157)
	if got := Oracle(w, 16); math.Abs(got-want) > 1e-12 {
		t.Fatalf("oracle %v, want %v", got, want)
	}
}

// tinyTrace: B continues A (A's second block was cut at 488 tokens), C
// shares A's first block only, D repeats C.
func tinyTrace() *Workload {
	return &Workload{Sessions: []Session{
		{Key: "a", Turns: []Turn{
			{At: 0, Blocks: []uint64{1, 2}, InputTokens: 1000, MaxTokens: 5},
			{At: 10 * time.Second, Blocks: []uint64{1, 2, 3}, InputTokens: 1300, MaxTokens: 5},
		}},
		{Key: "c", Start: 20 * time.Second, Turns: []Turn{
			{At: 20 * time.Second, Blocks: []uint64{1, 4}, InputTokens: 600, MaxTokens: 5},
			{At: 30 * time.Second, Blocks: []uint64{1, 4}, InputTokens: 600, MaxTokens: 5},
		}},
	}}
}

func TestOracleTraceByHand(t *testing.T) {
	// Prompts are the text plus 6 template tokens (2 before, 4 after).
	// A: nothing cached. B: 2 + 512 + 488 shared tokens -> 992 in full
	// blocks. C: 2 + 512 -> 512. D: the same prompt as C -> (606-1)/16*16.
	want := float64(0+992+512+592) / float64(1006+1306+606+606)
	if got := Oracle(tinyTrace(), 16); math.Abs(got-want) > 1e-12 {
		t.Fatalf("oracle %v, want %v", got, want)
	}
}
