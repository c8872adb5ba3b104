package audit

import (
	"cmp"
	"hash/maphash"
	"math/rand/v2"
	"slices"
	"strings"
)

// Phrases makes up text for audit prompts out of the model's own traffic
// without repeating any client: it counts word trigrams of the prompts it
// is shown, and writes text only with trigrams that at least K distinct
// clients used. A phrase many clients share ("can you help me") is
// nobody's own; a phrase of one client never leaves the relay. The text
// reads like the traffic, in its words and its language, so that an
// agent cannot tell an audit by its vocabulary. Until trigrams qualify it
// writes sentences of a built-in vocabulary (Vocabulary).
//
// It is bounded (MaxWords, MaxTrigrams) and not safe for concurrent use.
type Phrases struct {
	k, maxWords, maxGrams int
	seed                  maphash.Seed

	ids   map[string]uint32 // word -> id
	words []string
	grams map[[3]uint32]*gram

	// The qualifying trigrams, rebuilt when stale: starts lists them,
	// next the third words that follow a pair.
	stale  bool
	starts [][3]uint32
	next   map[[2]uint32][]uint32
}

// gram is one trigram's distinct clients, up to K of them.
type gram struct {
	clients []uint64
}

// Defaults of NewPhrases.
const (
	// DefaultPhraseClients is 3 distinct clients for a trigram to be used.
	DefaultPhraseClients = 3
	// DefaultPhraseWords bounds the words remembered per model.
	DefaultPhraseWords = 1 << 14
	// DefaultPhraseTrigrams bounds the trigrams remembered per model.
	DefaultPhraseTrigrams = 1 << 15
	// maxPhraseWord: longer words (identifiers, keys, data) are not words.
	maxPhraseWord = 24
	// maxObserved bounds the bytes of one text read.
	maxObserved = 8 << 10
)

// NewPhrases returns an empty phrase table: a trigram counts once k
// distinct clients used it. Zero arguments mean the defaults.
func NewPhrases(k, maxWords, maxTrigrams int) *Phrases {
	return &Phrases{
		k: positiveOr(k, DefaultPhraseClients), maxWords: positiveOr(maxWords, DefaultPhraseWords),
		maxGrams: positiveOr(maxTrigrams, DefaultPhraseTrigrams), seed: maphash.MakeSeed(),
		ids: map[string]uint32{}, grams: map[[3]uint32]*gram{},
	}
}

// Observe reads one text a client sent (its first maxObserved bytes).
func (p *Phrases) Observe(client, text string) {
	if len(text) > maxObserved {
		text = text[:maxObserved]
	}
	ch := maphash.String(p.seed, client)
	var w [3]uint32
	have := 0
	for f := range strings.FieldsSeq(text) {
		id, ok := p.word(f)
		if !ok {
			have = 0 // a word that cannot be kept breaks the chain
			continue
		}
		w[0], w[1], w[2] = w[1], w[2], id
		if have++; have < 3 {
			continue
		}
		p.count(w, ch)
	}
}

func (p *Phrases) word(f string) (uint32, bool) {
	if len(f) > maxPhraseWord {
		return 0, false
	}
	if id, ok := p.ids[f]; ok {
		return id, true
	}
	if len(p.words) >= p.maxWords {
		return 0, false
	}
	id := uint32(len(p.words))
	p.words = append(p.words, f)
	p.ids[f] = id
	return id, true
}

func (p *Phrases) count(w [3]uint32, client uint64) {
	g := p.grams[w]
	if g == nil {
		if len(p.grams) >= p.maxGrams {
			p.evict()
		}
		g = &gram{}
		p.grams[w] = g
	}
	if len(g.clients) >= p.k {
		return
	}
	for _, c := range g.clients {
		if c == client {
			return
		}
	}
	g.clients = append(g.clients, client)
	if len(g.clients) == p.k {
		p.stale = true
	}
}

// evict drops one trigram that has not qualified, the one with the fewest
// clients of a few (map order is random: a random sample); a qualified
// one only when the sample holds no other.
func (p *Phrases) evict() {
	var victim [3]uint32
	best, seen := -1, 0
	for w, g := range p.grams {
		n := len(g.clients)
		if best < 0 || n < best {
			victim, best = w, n
		}
		if seen++; seen >= 8 {
			break
		}
	}
	if best >= p.k {
		p.stale = true
	}
	delete(p.grams, victim)
}

// Qualified returns the number of trigrams that may be written.
func (p *Phrases) Qualified() int {
	p.rebuild()
	return len(p.starts)
}

func (p *Phrases) rebuild() {
	if !p.stale && p.next != nil {
		return
	}
	p.stale = false
	p.starts = p.starts[:0]
	p.next = map[[2]uint32][]uint32{}
	for w, g := range p.grams {
		if len(g.clients) < p.k {
			continue
		}
		p.starts = append(p.starts, w)
		k := [2]uint32{w[0], w[1]}
		p.next[k] = append(p.next[k], w[2])
	}
	// Map order is random: sorted, a given rng draws the same text.
	slices.SortFunc(p.starts, func(a, b [3]uint32) int {
		return cmp.Or(cmp.Compare(a[0], b[0]), cmp.Compare(a[1], b[1]), cmp.Compare(a[2], b[2]))
	})
}

// Text returns about n bytes of text (at least one word): qualified
// trigrams chained where they overlap, or Vocabulary sentences.
func (p *Phrases) Text(n int, rng *rand.Rand) string {
	p.rebuild()
	if len(p.starts) == 0 {
		return vocabularyText(n, rng)
	}
	var b strings.Builder
	b.Grow(n + maxPhraseWord)
	add := func(id uint32) {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(p.words[id])
	}
	var ctx [2]uint32
	fresh := true
	for b.Len() < n {
		if !fresh {
			if f := p.next[ctx]; len(f) > 0 {
				id := f[rng.IntN(len(f))]
				add(id)
				ctx = [2]uint32{ctx[1], id}
				continue
			}
		}
		w := p.starts[rng.IntN(len(p.starts))]
		for _, id := range w {
			add(id)
		}
		ctx, fresh = [2]uint32{w[1], w[2]}, false
	}
	return b.String()
}

// Ident returns an identifier of two words that qualified (or of the
// vocabulary), lower case, joined by an underscore.
func (p *Phrases) Ident(rng *rand.Rand) string {
	p.rebuild()
	word := func() string {
		for range 8 {
			if len(p.starts) == 0 {
				break
			}
			w := p.starts[rng.IntN(len(p.starts))]
			if s := identWord(p.words[w[rng.IntN(3)]]); s != "" {
				return s
			}
		}
		return Vocabulary[rng.IntN(len(Vocabulary))]
	}
	return word() + "_" + word()
}

// identWord returns w lower-cased if it is letters only, else "".
func identWord(w string) string {
	for i := 0; i < len(w); i++ {
		if c := w[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z') {
			return ""
		}
	}
	return strings.ToLower(w)
}

// Vocabulary is the built-in text of audit prompts until a model's
// traffic gives phrases (Phrases): common English words.
var Vocabulary = strings.Fields(`the a of to and in is that for it as with on was be by this are from at or
an have not but which one all can their has had more when will there would other about time people into
some what out so up its who could them these than then now only first also new any two may like how
over such our even most after make many before must through back where much your way well should
because each just those how too here little world still between own see men work long get last day
might great old never year off come since against go came right used take three small large every
found house write read water story light river city garden morning letter music market school village
bridge window table history number question answer reason paper travel winter summer friend family
explain describe summarize compare list improve translate plan consider review suggest outline note`)

// vocabularyText returns about n bytes of sentences of Vocabulary.
func vocabularyText(n int, rng *rand.Rand) string {
	var b strings.Builder
	for b.Len() < n {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		words := 6 + rng.IntN(10)
		for i := range words {
			w := Vocabulary[rng.IntN(len(Vocabulary))]
			if i == 0 {
				w = strings.ToUpper(w[:1]) + w[1:]
			} else {
				b.WriteByte(' ')
			}
			b.WriteString(w)
		}
		b.WriteByte('.')
	}
	return b.String()
}
