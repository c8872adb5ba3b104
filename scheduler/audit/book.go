package audit

import (
	"fmt"
	"sort"
	"time"
)

// Key names one agent serving one model: reputation is per model, so an
// agent honest about one model and lying about another loses only the one.
type Key struct {
	Agent, Model string
}

// Policy turns evidence into a score, a routing weight and quarantine.
// The zero value of each field means the default named after it.
type Policy struct {
	// Alpha is how far one verdict moves the score: toward 1 on a clean
	// audit, toward 0 on a convicting one.
	Alpha float64
	// QuarantineBelow: a convicting audit that leaves the score below this
	// quarantines the agent for the model.
	QuarantineBelow float64
	// FullWeightAt: a score at or above this routes at full weight; below
	// it the weight falls linearly, to 0 at QuarantineBelow.
	FullWeightAt float64
	// ReleaseAfter is the number of clean audits in a row that release an
	// agent from a quarantine the audits put it in.
	ReleaseAfter int
	// BackoffMin is the wait before re-auditing a quarantined agent; it
	// doubles with each convicting re-audit, up to BackoffMax.
	BackoffMin, BackoffMax time.Duration
	// FloorEvery: an agent serving a model is audited at least this often,
	// whatever the budget says, so that a small fleet is audited too.
	FloorEvery time.Duration
	// MaxEntries bounds the book: past it, the entries of clean agents
	// least recently audited are dropped (never a quarantined one).
	MaxEntries int
	// TenureFull is how long an agent must have been known for its vote
	// to weigh fully; a new one weighs TenureFloor, growing linearly.
	TenureFull time.Duration
	// TenureFloor is a new agent's vote's weight, in (0, 1].
	TenureFloor float64
}

// Defaults for the zero values of Policy.
const (
	// DefaultAlpha is 0.5: two convicting audits in a row take a clean
	// agent from 1 to 0.25, below the bar; one costs it two thirds of its
	// traffic until clean audits bring it back.
	DefaultAlpha = 0.5
	// DefaultQuarantineBelow is 0.3.
	DefaultQuarantineBelow = 0.3
	// DefaultFullWeightAt is 0.9: after one convicting audit, two clean
	// ones give an agent back its full share (0.5, 0.75, 0.875, 0.94).
	DefaultFullWeightAt = 0.9
	// DefaultReleaseAfter is 3 clean audits in a row.
	DefaultReleaseAfter = 3
	// DefaultBackoffMin is 30 s between re-audits of a quarantined agent.
	DefaultBackoffMin = 30 * time.Second
	// DefaultBackoffMax is 30 min.
	DefaultBackoffMax = 30 * time.Minute
	// DefaultFloorEvery is 10 min.
	DefaultFloorEvery = 10 * time.Minute
	// DefaultMaxEntries is 65536 agent-model pairs.
	DefaultMaxEntries = 1 << 16
	// DefaultTenureFull is a day: agents joined for a burst of voting
	// count a quarter as much as those serving since yesterday.
	DefaultTenureFull = 24 * time.Hour
	// DefaultTenureFloor is 0.25.
	DefaultTenureFloor = 0.25
)

// releaseScore is where a released agent starts again: between the bar and
// full weight, so it earns its share back with clean audits.
func (p Policy) releaseScore() float64 { return (p.QuarantineBelow + p.FullWeightAt) / 2 }

func (p Policy) populate() Policy {
	if p.Alpha <= 0 || p.Alpha > 1 {
		p.Alpha = DefaultAlpha
	}
	if p.QuarantineBelow <= 0 {
		p.QuarantineBelow = DefaultQuarantineBelow
	}
	if p.FullWeightAt <= p.QuarantineBelow || p.FullWeightAt > 1 {
		p.FullWeightAt = max(DefaultFullWeightAt, p.QuarantineBelow+(1-p.QuarantineBelow)/2)
	}
	if p.ReleaseAfter <= 0 {
		p.ReleaseAfter = DefaultReleaseAfter
	}
	if p.BackoffMin <= 0 {
		p.BackoffMin = DefaultBackoffMin
	}
	if p.BackoffMax < p.BackoffMin {
		p.BackoffMax = max(DefaultBackoffMax, p.BackoffMin)
	}
	if p.FloorEvery <= 0 {
		p.FloorEvery = DefaultFloorEvery
	}
	if p.MaxEntries <= 0 {
		p.MaxEntries = DefaultMaxEntries
	}
	if p.TenureFull <= 0 {
		p.TenureFull = DefaultTenureFull
	}
	if !(p.TenureFloor > 0) || p.TenureFloor > 1 {
		p.TenureFloor = DefaultTenureFloor
	}
	return p
}

// Validate reports a Policy that cannot work: a bar at or above 1.
func (p Policy) Validate() error {
	if p.QuarantineBelow >= 1 {
		return fmt.Errorf("audit: quarantine bar %.2f must be below 1", p.QuarantineBelow)
	}
	if p.Alpha < 0 || p.Alpha > 1 {
		return fmt.Errorf("audit: alpha %.2f must be within 0..1", p.Alpha)
	}
	return nil
}

// Evidence is one audit's finding kept on record.
type Evidence struct {
	// At is when the audit was judged.
	At time.Time
	// Audit is the audit's ID, as the relay logged it.
	Audit string
	// Against is the reference compared with.
	Against string
	// Reason says what differed.
	Reason string
}

// Quarantine is an agent's exclusion from one model's traffic.
type Quarantine struct {
	// Since is when it began.
	Since time.Time
	// ByOperator is true when the operator quarantined the agent by hand:
	// then only the operator releases it.
	ByOperator bool
	// Convicted is the audit that put the agent in quarantine (empty when
	// by hand: Reason says the operator's words).
	Convicted Evidence
	// Clean counts clean re-audits in a row since the last convicting one.
	Clean int
	// Backoff is the current wait between re-audits.
	Backoff time.Duration
	// NextAudit is when the agent is due for its next re-audit.
	NextAudit time.Time
}

// Standing is one agent-model pair's record: its score and the evidence
// behind it.
type Standing struct {
	Key
	// Score is in [0, 1]; 1 for an agent with no evidence against it.
	Score float64
	// Weight is the routing weight factor in [0, 1]: 0 in quarantine.
	Weight float64
	// Audits counts the conclusive audits; Agreements the clean ones among
	// them. Inconclusive counts audits that could hold nothing (timeouts,
	// overload, restarts, ties, no consensus).
	Audits, Agreements, Inconclusive int
	// Violations counts cheap-check findings on its answers.
	Violations int
	// LastAudit is when it was last audited, conclusively or not.
	LastAudit time.Time
	// LastDisagreement is the last convicting audit; zero At when none.
	LastDisagreement Evidence
	// LastViolation is the last cheap-check finding; zero At when none.
	LastViolation Evidence
	// Suspected is true when a violation or a disagreement since its last
	// clean audit asks for an audit soon.
	Suspected bool
	// Quarantine is non-nil while the agent is quarantined for the model.
	Quarantine *Quarantine
	// Since is when the pair was first seen (audited, checked or Seen).
	Since time.Time
}

// Change is what a recorded event did to a pair's routing.
type Change int

const (
	// Unchanged: the pair's routing state stayed as it was (its score may
	// have moved).
	Unchanged Change = iota
	// Quarantined: the pair was put in quarantine.
	Quarantined
	// Released: the pair left quarantine.
	Released
)

// Book keeps the standing of every agent-model pair. It is pure state:
// the caller passes the time of every event. It is not safe for concurrent
// use; the caller guards it.
type Book struct {
	p       Policy
	entries map[Key]*Standing
}

// NewBook returns an empty book under policy p (zero fields: defaults).
func NewBook(p Policy) *Book {
	return &Book{p: p.populate(), entries: make(map[Key]*Standing)}
}

// Policy returns the book's policy with its defaults filled in.
func (b *Book) Policy() Policy { return b.p }

func (b *Book) entry(now time.Time, k Key) *Standing {
	s, ok := b.entries[k]
	if !ok {
		b.evict()
		s = &Standing{Key: k, Score: 1, Weight: 1, Since: now}
		b.entries[k] = s
	}
	return s
}

// evict makes room for one entry: past MaxEntries, the clean entry least
// recently audited goes.
func (b *Book) evict() {
	if len(b.entries) < b.p.MaxEntries {
		return
	}
	var victim *Standing
	for _, s := range b.entries {
		if s.Quarantine != nil {
			continue
		}
		if victim == nil || s.LastAudit.Before(victim.LastAudit) {
			victim = s
		}
	}
	if victim != nil {
		delete(b.entries, victim.Key)
	}
}

// Seen notes that the agent serves the model, so that a new pair is due
// for its first audit at once.
func (b *Book) Seen(now time.Time, k Key) { b.entry(now, k) }

// Record applies one audit's verdict about k, judged at now under the
// audit ID audit, and reports whether the pair entered or left quarantine.
func (b *Book) Record(now time.Time, audit string, k Key, v Verdict) Change {
	s := b.entry(now, k)
	s.LastAudit = now
	q := s.Quarantine
	change := Unchanged
	switch v.Outcome {
	case Agree:
		s.Audits++
		s.Agreements++
		s.Suspected = false
		s.Score += b.p.Alpha * (1 - s.Score)
		if q != nil {
			q.Clean++
			q.NextAudit = now.Add(b.p.BackoffMin)
			if !q.ByOperator && q.Clean >= b.p.ReleaseAfter {
				s.Quarantine = nil
				s.Score = max(s.Score, b.p.releaseScore())
				change = Released
			}
		}
	case Disagree:
		s.Audits++
		s.Suspected = true
		s.Score -= b.p.Alpha * s.Score
		ev := Evidence{At: now, Audit: audit, Against: v.Against, Reason: v.Reason}
		if v.Evidence.Reason != "" {
			ev.Reason += ": " + v.Evidence.Reason
		}
		s.LastDisagreement = ev
		switch {
		case q != nil:
			q.Clean = 0
			q.Backoff = min(2*q.Backoff, b.p.BackoffMax)
			q.NextAudit = now.Add(q.Backoff)
		case s.Score < b.p.QuarantineBelow:
			s.Quarantine = &Quarantine{Since: now, Convicted: ev, Backoff: b.p.BackoffMin, NextAudit: now.Add(b.p.BackoffMin)}
			change = Quarantined
		}
	default:
		s.Inconclusive++
		if q != nil {
			q.NextAudit = now.Add(b.p.BackoffMin)
		}
	}
	s.Weight = b.weight(s)
	return change
}

// Violation records a cheap check's finding on one of k's answers: it is
// evidence, not a verdict, so it moves neither the score nor the weight,
// but marks the pair Suspected so that it is audited next.
func (b *Book) Violation(now time.Time, k Key, check, detail string) {
	s := b.entry(now, k)
	s.Violations++
	s.Suspected = true
	s.LastViolation = Evidence{At: now, Reason: check + ": " + detail}
}

// Quarantine puts k in quarantine by the operator's hand, with reason;
// only Release ends it. It reports whether k was not quarantined before.
func (b *Book) Quarantine(now time.Time, k Key, reason string) Change {
	s := b.entry(now, k)
	change := Unchanged
	if s.Quarantine == nil {
		s.Quarantine = &Quarantine{Since: now, Backoff: b.p.BackoffMin, NextAudit: now.Add(b.p.BackoffMin)}
		change = Quarantined
	}
	s.Quarantine.ByOperator = true
	s.Quarantine.Convicted = Evidence{At: now, Reason: "by the operator: " + reason}
	s.Weight = b.weight(s)
	return change
}

// Release ends k's quarantine by the operator's hand and restores its
// full score (the operator vouches for it; the evidence stays on record).
// It reports whether k was quarantined.
func (b *Book) Release(now time.Time, k Key) Change {
	s, ok := b.entries[k]
	if !ok {
		return Unchanged
	}
	change := Unchanged
	if s.Quarantine != nil {
		change = Released
	}
	s.Quarantine = nil
	s.Suspected = false
	s.Score = 1
	s.Weight = b.weight(s)
	return change
}

func (b *Book) weight(s *Standing) float64 {
	if s.Quarantine != nil {
		return 0
	}
	w := (s.Score - b.p.QuarantineBelow) / (b.p.FullWeightAt - b.p.QuarantineBelow)
	return min(max(w, 0), 1)
}

// Weight returns k's routing weight factor: 1 for an unknown pair, 0 in
// quarantine.
func (b *Book) Weight(k Key) float64 {
	if s, ok := b.entries[k]; ok {
		return s.Weight
	}
	return 1
}

// Voice returns the weight of k's vote in an audit (Participant.Weight):
// its tenure, from TenureFloor for an agent first known at since (zero:
// when the book first saw the pair) to 1 after TenureFull, times its
// score, so that an agent convicted lately counts for less.
func (b *Book) Voice(now time.Time, k Key, since time.Time) float64 {
	s := b.entry(now, k)
	if since.IsZero() || s.Since.Before(since) {
		since = s.Since
	}
	t := b.p.TenureFloor + (1-b.p.TenureFloor)*float64(now.Sub(since))/float64(b.p.TenureFull)
	return max(min(t, 1)*s.Score, 1e-3)
}

// Quarantined reports whether k is in quarantine.
func (b *Book) Quarantined(k Key) bool {
	s, ok := b.entries[k]
	return ok && s.Quarantine != nil
}

// Standing returns a copy of k's record, and false for an unknown pair.
func (b *Book) Standing(k Key) (Standing, bool) {
	s, ok := b.entries[k]
	if !ok {
		return Standing{}, false
	}
	return s.copy(), true
}

func (s *Standing) copy() Standing {
	c := *s
	if s.Quarantine != nil {
		q := *s.Quarantine
		c.Quarantine = &q
	}
	return c
}

// Standings returns a copy of every record, by agent then model.
func (b *Book) Standings() []Standing {
	out := make([]Standing, 0, len(b.entries))
	for _, s := range b.entries {
		out = append(out, s.copy())
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Agent != out[j].Agent {
			return out[i].Agent < out[j].Agent
		}
		return out[i].Model < out[j].Model
	})
	return out
}

// Len returns the number of pairs on record.
func (b *Book) Len() int { return len(b.entries) }
