package audit

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

func verdictsOf(vs []Verdict) string {
	letter := map[Outcome]string{Agree: "a", Disagree: "d", Inconclusive: "i"}
	var out []string
	for _, v := range vs {
		out = append(out, v.Agent+":"+letter[v.Outcome])
	}
	return strings.Join(out, " ")
}

// An item answered by two honest agents at once judges later agents one at
// a time, each of a group never sent it; an item answered by one waits for
// a second, and then judges the first too.
func TestBankReplays(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	rng := rand.New(rand.NewPCG(1, 2))
	b := NewBank(BankPolicy{})
	var r Rules
	part := func(agent, group string, a Answer) Participant {
		return Participant{Agent: agent, Group: group, Kind: "llama.cpp", Answer: a}
	}

	it := NewItem("i1", "m", []byte(`{}`), nil, true, t0)
	if got := verdictsOf(it.Answer(r, part("h1", "g1", honest), part("h2", "g2", honest))); got != "h1:a h2:a" {
		t.Fatalf("two honest alone: %s", got)
	}
	if !b.Keep(t0, it) {
		t.Fatal("not kept")
	}
	if got := b.For(t0, "m", "g1", "llama.cpp", true, r, rng); got != nil {
		t.Fatal("offered to a group that answered it")
	}
	if got := b.For(t0, "m", "g3", "vllm", true, r, rng); got != nil {
		t.Fatal("sampled item offered to an engine of another kind")
	}
	if got := b.For(t0, "m", "g3", "llama.cpp", true, r, rng); got != it {
		t.Fatalf("no item for a new group: %v", got)
	}
	if got := verdictsOf(it.Answer(r, part("liar", "g3", liar))); got != "liar:d" {
		t.Errorf("replay to a liar: %s", got)
	}
	if got := verdictsOf(it.Answer(r, part("h3", "g4", honest))); got != "h3:a" {
		t.Errorf("replay to an honest agent: %s", got)
	}
	if b.For(t0, "m", "g3", "llama.cpp", true, r, rng) != nil {
		t.Error("offered twice to one group")
	}

	// One answer only: it waits for another group's.
	lone := NewItem("i2", "m", []byte(`{}`), nil, true, t0)
	if got := verdictsOf(lone.Answer(r, part("x", "gx", liar))); got != "x:i" {
		t.Fatalf("alone: %s", got)
	}
	b.Keep(t0, lone)
	if b.For(t0, "m", "gy", "llama.cpp", true, r, rng) == lone {
		t.Fatal("an item of one answer offered as judging")
	}
	if got := b.For(t0, "m", "gy", "llama.cpp", false, r, rng); got != lone {
		t.Fatalf("the waiting item not offered: %v", got)
	}
	if got := verdictsOf(lone.Answer(r, part("y", "gy", honest))); got != "y:i" {
		t.Fatalf("one against one: %s", got)
	}
	// A third agrees with the second: the first, judged only now, and
	// the second disagree and agree.
	if got := verdictsOf(lone.Answer(r, part("z", "gz", honest))); got != "x:d y:a z:a" {
		t.Errorf("third answer: %s", got)
	}
	if got := verdictsOf(lone.Answer(r, part("w", "gw", honest))); got != "w:a" {
		t.Errorf("a fourth answer judges again only the new one: %s", got)
	}

	// A quarantined agent's answers no longer vote; items expire.
	b.Distrust("h1", "m")
	b.Distrust("h2", "m")
	b.Distrust("h3", "m")
	if got := b.For(t0, "m", "g9", "llama.cpp", true, r, rng); got != lone {
		t.Errorf("item of distrusted answers offered: %v", got)
	}
	if b.For(t0.Add(DefaultBankTTL), "m", "g9", "llama.cpp", true, r, rng) != nil || b.Len() != 0 {
		t.Errorf("%d items past their TTL", b.Len())
	}
}

func TestBankBounded(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	b := NewBank(BankPolicy{PerModel: 4, MaxBytes: 4 << 10})
	for i := range 100 {
		it := NewItem("i", []string{"m1", "m2", "m3"}[i%3], make([]byte, 200), nil, false, t0.Add(time.Duration(i)*time.Second))
		it.Answer(Rules{}, Participant{Agent: "a", Answer: Answer{Text: strings.Repeat("x", 100)}})
		b.Keep(t0.Add(time.Duration(i)*time.Second), it)
		if b.bytes > 4<<10 || len(b.items["m1"]) > 4 {
			t.Fatalf("after %d items: %d bytes, %d items of m1", i+1, b.bytes, len(b.items["m1"]))
		}
	}
	if b.Len() != 12 {
		t.Errorf("%d items kept, want 4 per model", b.Len())
	}
}
