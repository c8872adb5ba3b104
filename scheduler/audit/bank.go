package audit

import (
	"math/rand/v2"
	"time"
)

// Item is one audit prompt and the answers it has had. A round sends it to
// an agent and its references at once; the Bank keeps it while its answers
// can judge others, and sends it later to one agent at a time, each from a
// group that has not seen it. An agent audited from the bank gets a prompt
// no agent of its network was ever sent, alone: there is nothing to
// compare notes on, and a small fleet is audited even when its agents are
// seldom online together.
type Item struct {
	// ID names the item in logs and the admin API.
	ID string
	// Model is the model it audits.
	Model string
	// Body and Header are the request, exactly as sent (seed included).
	Body   []byte
	Header map[string][]string
	// Sampled is true for a prompt decoded with sampling.
	Sampled bool
	// Created is when it was first sent.
	Created time.Time
	// Cost is the tokens one answer cost, for the budget of a replay.
	Cost int

	parts  []Participant
	judged map[string]bool // agents given a conclusive verdict by it
	seen   map[string]bool // groups that were sent it
}

// NewItem returns an item with no answers yet.
func NewItem(id, model string, body []byte, header map[string][]string, sampled bool, now time.Time) *Item {
	return &Item{ID: id, Model: model, Body: body, Header: header, Sampled: sampled, Created: now,
		judged: map[string]bool{}, seen: map[string]bool{}}
}

// Saw records that group was sent the item, whether or not it answered.
func (it *Item) Saw(group string) { it.seen[group] = true }

// Seen reports whether group was sent the item.
func (it *Item) Seen(group string) bool { return it.seen[group] }

// Answers returns the number of answers it holds.
func (it *Item) Answers() int { return len(it.parts) }

// Answer adds the answers of ps, who were just sent the item, and judges
// all its answers again under r. It returns a verdict for each of ps, and
// the first conclusive verdict of an earlier participant that had none
// (its answer, given earlier, is judged now that others answered too).
func (it *Item) Answer(r Rules, ps ...Participant) []Verdict {
	r.Sampled = it.Sampled
	fresh := map[string]bool{}
	for _, p := range ps {
		it.Saw(p.group())
		it.parts = append(it.parts, p)
		fresh[p.Agent] = true
	}
	var out []Verdict
	for _, v := range Judge(it.parts, r) {
		switch {
		case fresh[v.Agent]:
		case it.judged[v.Agent] || v.Outcome == Inconclusive:
			continue
		}
		if v.Outcome != Inconclusive {
			it.judged[v.Agent] = true
		}
		out = append(out, v)
	}
	return out
}

// Distrust marks agent's answers as a suspect's: they no longer count for
// others (the agent was quarantined).
func (it *Item) Distrust(agent string) {
	for i := range it.parts {
		if it.parts[i].Agent == agent {
			it.parts[i].Suspect = true
		}
	}
}

// judges reports whether the item's answers can judge an answer of an
// engine of kind from an agent of a group that has not seen it: a trusted
// answer that compares with it, or MinVoices groups that compare with it
// and agree with one another.
func (it *Item) judges(kind string, r Rules) bool {
	r.Sampled = it.Sampled
	if r.MinVoices <= 0 {
		r.MinVoices = DefaultMinVoices
	}
	probe := Participant{Kind: kind}
	var voices []*Participant
	for i := range it.parts {
		p := &it.parts[i]
		if p.Suspect || !comparable(&probe, p, r) {
			continue
		}
		if p.Trusted {
			return true
		}
		voices = append(voices, p)
	}
	for i, a := range voices {
		groups := map[string]bool{a.group(): true}
		for _, b := range voices[i+1:] {
			if !groups[b.group()] && Compare(a.Answer, b.Answer, r.Tolerance).Outcome == Agree {
				groups[b.group()] = true
			}
		}
		if len(groups) >= r.MinVoices {
			return true
		}
	}
	return false
}

// comparesWith reports whether some answer not a suspect's compares with
// an engine of kind.
func (it *Item) comparesWith(kind string) bool {
	probe := Participant{Kind: kind}
	for i := range it.parts {
		if !it.parts[i].Suspect && comparable(&probe, &it.parts[i], Rules{Sampled: it.Sampled}) {
			return true
		}
	}
	return false
}

// BankPolicy bounds a Bank. The zero value of each field means its
// default.
type BankPolicy struct {
	// TTL is how long an item is used: an engine update may change what
	// an honest engine answers to the same seed.
	TTL time.Duration
	// PerModel bounds the items kept per model.
	PerModel int
	// MaxBytes bounds the bytes of all items' requests and answers.
	MaxBytes int
}

// Defaults for the zero values of BankPolicy.
const (
	// DefaultBankTTL is one hour.
	DefaultBankTTL = time.Hour
	// DefaultBankPerModel is 32 items.
	DefaultBankPerModel = 32
	// DefaultBankBytes is 16 MiB.
	DefaultBankBytes = 16 << 20
)

// Bank keeps audit items whose answers can judge others, per model. It is
// pure state, not safe for concurrent use; the caller passes the time.
type Bank struct {
	p     BankPolicy
	items map[string][]*Item // by model, oldest first
	bytes int
}

// NewBank returns an empty bank under p.
func NewBank(p BankPolicy) *Bank {
	p.TTL = positiveOr(p.TTL, DefaultBankTTL)
	p.PerModel = positiveOr(p.PerModel, DefaultBankPerModel)
	p.MaxBytes = positiveOr(p.MaxBytes, DefaultBankBytes)
	return &Bank{p: p, items: map[string][]*Item{}}
}

// Size returns the bytes the item holds: its request and its answers.
func (it *Item) Size() int {
	n := len(it.Body)
	for _, p := range it.parts {
		n += len(p.Answer.Text) + 16*len(p.Answer.Tokens)
	}
	return n
}

// Keep adds it to the bank, and reports whether it did: an item with an
// answer that is not a suspect's, of a bounded size. One whose answers
// cannot judge yet waits for more (For with judging false), which is how
// a fleet whose agents are seldom online together is audited. A kept
// item's answers must not change but through Answer and Distrust.
func (b *Bank) Keep(now time.Time, it *Item) bool {
	b.expire(now)
	ok := false
	for _, p := range it.parts {
		ok = ok || !p.Suspect
	}
	if !ok || it.Size() > b.p.MaxBytes/4 {
		return false
	}
	list := b.items[it.Model]
	if len(list) >= b.p.PerModel {
		b.bytes -= list[0].Size()
		list = list[1:]
	}
	b.items[it.Model] = append(list, it)
	b.bytes += it.Size()
	for b.bytes > b.p.MaxBytes {
		b.dropOldest()
	}
	return true
}

// For returns an item for model that group was never sent, drawn at
// random; nil when there is none. With judging, only an item whose
// answers can judge an answer of an engine of kind; without, only one
// that cannot yet but has an answer of that kind (or any, for greedy
// prompts) to compare with. The caller sends it and calls Answer.
func (b *Bank) For(now time.Time, model, group, kind string, judging bool, r Rules, rng *rand.Rand) *Item {
	b.expire(now)
	var cands []*Item
	for _, it := range b.items[model] {
		if it.Seen(group) || it.judges(kind, r) != judging {
			continue
		}
		if judging || it.comparesWith(kind) {
			cands = append(cands, it)
		}
	}
	if len(cands) == 0 {
		return nil
	}
	return cands[rng.IntN(len(cands))]
}

// Grew accounts for an answer added to a kept item.
func (b *Bank) Grew(it *Item, before int) {
	b.bytes += it.Size() - before
	for b.bytes > b.p.MaxBytes {
		b.dropOldest()
	}
}

// Distrust marks agent's answers in the model's items as a suspect's.
func (b *Bank) Distrust(agent, model string) {
	for _, it := range b.items[model] {
		it.Distrust(agent)
	}
}

// Len returns the number of items kept.
func (b *Bank) Len() int {
	n := 0
	for _, l := range b.items {
		n += len(l)
	}
	return n
}

func (b *Bank) expire(now time.Time) {
	for m, list := range b.items {
		i := 0
		for i < len(list) && now.Sub(list[i].Created) >= b.p.TTL {
			b.bytes -= list[i].Size()
			i++
		}
		switch {
		case i == len(list):
			delete(b.items, m)
		case i > 0:
			b.items[m] = list[i:]
		}
	}
}

func (b *Bank) dropOldest() {
	var oldest string
	for m, list := range b.items {
		if oldest == "" || list[0].Created.Before(b.items[oldest][0].Created) {
			oldest = m
		}
	}
	if oldest == "" {
		b.bytes = 0
		return
	}
	list := b.items[oldest]
	b.bytes -= list[0].Size()
	if len(list) == 1 {
		delete(b.items, oldest)
	} else {
		b.items[oldest] = list[1:]
	}
}
