package audit

import (
	"math/rand/v2"
	"sort"
	"time"
)

// Why says why a pair is due for an audit.
type Why int

const (
	// WhyRecheck: a quarantined pair's re-audit is due.
	WhyRecheck Why = iota
	// WhyNew: the pair was never audited.
	WhyNew
	// WhyFloor: the pair was not audited for Policy.FloorEvery.
	WhyFloor
	// WhySuspected: a violation or a disagreement asks for an audit soon;
	// paid from the budget.
	WhySuspected
	// WhyBudget: the budget has room, and the pair is the one least
	// recently audited.
	WhyBudget
)

var whyNames = [...]string{WhyRecheck: "recheck", WhyNew: "new", WhyFloor: "floor", WhySuspected: "suspected", WhyBudget: "budget"}

// String returns the reason's name, as logs and metrics show it.
func (w Why) String() string {
	if w < 0 || int(w) >= len(whyNames) {
		return "unknown"
	}
	return whyNames[w]
}

// Mandatory reports whether an audit for this reason is sent whether or
// not the budget has room (the floor, new pairs, quarantine re-audits).
func (w Why) Mandatory() bool { return w <= WhyFloor }

// Next returns the pair among live (the pairs the relay could route to
// now, quarantined ones included; operator references left out) that
// should be audited next, why, and false when none is due. affordable
// says whether the budget has room for a round: without it only a
// mandatory reason picks a pair.
//
// Order: quarantine re-audits that are due (earliest first), pairs never
// audited (first seen first), pairs past the floor, then, with room in the
// budget, suspected pairs and the pair least recently audited. A
// quarantined pair is audited only on its own schedule.
func (b *Book) Next(now time.Time, live []Key, affordable bool) (Key, Why, bool) {
	var best *Standing
	bestWhy := WhyBudget + 1
	// earlier orders two candidates of the same reason.
	earlier := func(s, t *Standing, why Why) bool {
		switch why {
		case WhyRecheck:
			return s.Quarantine.NextAudit.Before(t.Quarantine.NextAudit)
		case WhyNew:
			return s.Since.Before(t.Since)
		}
		return s.LastAudit.Before(t.LastAudit)
	}
	for _, k := range live {
		s := b.entry(now, k)
		var why Why
		switch {
		case s.Quarantine != nil && !now.Before(s.Quarantine.NextAudit):
			why = WhyRecheck
		case s.Quarantine != nil:
			continue
		case s.LastAudit.IsZero():
			why = WhyNew
		case now.Sub(s.LastAudit) >= b.p.FloorEvery:
			why = WhyFloor
		case !affordable:
			continue
		case s.Suspected:
			why = WhySuspected
		default:
			why = WhyBudget
		}
		if why < bestWhy || (why == bestWhy && (earlier(s, best, why) || (!earlier(best, s, why) && lessKey(s.Key, best.Key)))) {
			best, bestWhy = s, why
		}
	}
	if best == nil {
		return Key{}, 0, false
	}
	return best.Key, bestWhy, true
}

func lessKey(a, b Key) bool {
	if a.Model != b.Model {
		return a.Model < b.Model
	}
	return a.Agent < b.Agent
}

// References returns up to n other agents among live that serve
// subject's model and may answer as references: not quarantined, least
// recently audited first (a round judges every participant, so the
// references are audited too). Agents audited at the same time are taken
// in an order drawn from rng (by name when rng is nil), so that no agent
// can count on meeting the same references.
func (b *Book) References(now time.Time, subject Key, live []Key, n int, rng *rand.Rand) []Key {
	var cands []*Standing
	for _, k := range live {
		if k.Model != subject.Model || k.Agent == subject.Agent {
			continue
		}
		if s := b.entry(now, k); s.Quarantine == nil {
			cands = append(cands, s)
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].Agent < cands[j].Agent })
	if rng != nil {
		rng.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	}
	sort.SliceStable(cands, func(i, j int) bool { return cands[i].LastAudit.Before(cands[j].LastAudit) })
	out := make([]Key, 0, min(n, len(cands)))
	for _, s := range cands[:min(n, len(cands))] {
		out = append(out, s.Key)
	}
	return out
}

// Budget paces audits as a share of the tokens the fleet serves: each
// served token earns Fraction of a token of credit, each audit spends the
// tokens its round cost. Mandatory audits may spend past zero; the debt
// (at most Burst) is repaid by later traffic before the budget pays for
// another audit, so over a run with traffic the share stays at Fraction.
// The zero value is not usable: use NewBudget. Not safe for concurrent
// use.
type Budget struct {
	fraction, burst float64
	credit          float64
	served, spent   int64
}

// Defaults for NewBudget's zero arguments.
const (
	// DefaultFraction is 2% of the served tokens.
	DefaultFraction = 0.02
	// DefaultBurst is 16,384 tokens of credit at most: a quiet hour does
	// not save up for a storm of audits.
	DefaultBurst = 16384
)

// NewBudget returns a budget of fraction of the served tokens, with at
// most burst tokens of credit (or debt). Zero means the default; a
// negative fraction means no budget (only mandatory audits).
func NewBudget(fraction float64, burst int) *Budget {
	if fraction == 0 {
		fraction = DefaultFraction
	}
	if burst <= 0 {
		burst = DefaultBurst
	}
	return &Budget{fraction: max(fraction, 0), burst: float64(burst)}
}

// Served adds tokens the fleet served to clients.
func (b *Budget) Served(tokens int) {
	if tokens <= 0 {
		return
	}
	b.served += int64(tokens)
	b.credit = min(b.credit+b.fraction*float64(tokens), b.burst)
}

// Afford reports whether the budget has credit for an audit of cost tokens.
func (b *Budget) Afford(cost int) bool { return b.fraction > 0 && b.credit >= float64(cost) }

// Spend charges tokens an audit cost.
func (b *Budget) Spend(tokens int) {
	if tokens <= 0 {
		return
	}
	b.spent += int64(tokens)
	b.credit = max(b.credit-float64(tokens), -b.burst)
}

// Totals returns the tokens served and spent on audits so far.
func (b *Budget) Totals() (served, spent int64) { return b.served, b.spent }

// Fraction returns the budget's share of served tokens.
func (b *Budget) Fraction() float64 { return b.fraction }
