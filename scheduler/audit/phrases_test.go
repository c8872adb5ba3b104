package audit

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// Text is made only of phrases K distinct clients used: a client's own
// words never appear, shared phrases do, and until enough clients share
// any the built-in vocabulary stands in.
func TestPhrasesOnlyWhatClientsShare(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	p := NewPhrases(3, 0, 0)
	shared := "please summarize the following meeting notes in three short bullet points"
	if got := p.Text(80, rng); !allVocabulary(got) {
		t.Fatalf("empty table wrote %q, want vocabulary text", got)
	}
	for c := range 2 {
		p.Observe(fmt.Sprintf("client-%d", c), shared)
	}
	if got := p.Text(80, rng); !allVocabulary(got) || p.Qualified() != 0 {
		t.Fatalf("two clients made %d trigrams qualify: %q", p.Qualified(), got)
	}
	p.Observe("client-2", shared)
	// A client's own sentence, repeated by that client: still its own.
	secret := "my account number is zx81-quux and my password is hunter2"
	for range 10 {
		p.Observe("client-0", secret)
	}
	if n := len(strings.Fields(shared)) - 2; p.Qualified() != n {
		t.Fatalf("%d trigrams qualified, want %d", p.Qualified(), n)
	}
	sharedWords := strings.Fields(shared)
	for range 50 {
		got := p.Text(120, rng)
		if len(got) < 120 {
			t.Fatalf("text of %d bytes for 120", len(got))
		}
		for _, w := range strings.Fields(got) {
			if !slices.Contains(sharedWords, w) {
				t.Fatalf("%q in %q: not a shared word", w, got)
			}
		}
		for _, w := range []string{"account", "zx81-quux", "password", "hunter2"} {
			if strings.Contains(got, w) {
				t.Fatalf("a client's own %q reached the text %q", w, got)
			}
		}
		if id := p.Ident(rng); !identLike(id) {
			t.Fatalf("identifier %q", id)
		}
	}
}

func TestPhrasesBounded(t *testing.T) {
	p := NewPhrases(2, 64, 128)
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range 2000 {
		var b strings.Builder
		for range 20 {
			fmt.Fprintf(&b, "w%d ", rng.IntN(500))
		}
		p.Observe(fmt.Sprintf("c%d", i%7), b.String())
	}
	if len(p.words) > 64 || len(p.grams) > 128 {
		t.Fatalf("%d words, %d trigrams: over the bounds 64, 128", len(p.words), len(p.grams))
	}
	// Long words (keys, data) are not kept, and break the chain.
	p = NewPhrases(1, 0, 0)
	p.Observe("c", "a b "+strings.Repeat("k", 40)+" c d e")
	if p.Qualified() != 1 {
		t.Fatalf("%d trigrams around a long word, want 1 (c d e)", p.Qualified())
	}
}

func allVocabulary(s string) bool {
	for _, w := range strings.Fields(s) {
		w = strings.ToLower(strings.TrimSuffix(w, "."))
		if !slices.Contains(Vocabulary, w) {
			return false
		}
	}
	return true
}

func identLike(s string) bool {
	a, b, ok := strings.Cut(s, "_")
	return ok && identWord(a) == a && identWord(b) == b && a != ""
}
