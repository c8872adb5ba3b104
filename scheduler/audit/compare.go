package audit

import (
	"fmt"
	"math"
	"time"
	"unicode/utf8"
)

// Answer is one engine's answer to an audit prompt.
type Answer struct {
	// Text is the generated text.
	Text string
	// Tokens are the generated tokens with their log-probabilities, when
	// the engine gave them (OpenAI's choices[].logprobs.content); nil
	// otherwise, and the comparison falls back to the text.
	Tokens []Token
}

// Token is one generated token and how likely the engine found it.
type Token struct {
	// Text is the token's text.
	Text string
	// Logprob is the natural log of the token's probability.
	Logprob float64
	// Top are the most likely tokens at this position (top_logprobs),
	// the chosen one usually among them. Empty when not asked for.
	Top []Alt
}

// Alt is one candidate token at a position and its log-probability.
type Alt struct {
	Text    string
	Logprob float64
}

// Outcome is what a comparison or an audit found.
type Outcome int

const (
	// Inconclusive: nothing to hold for or against the agent (an early
	// divergence between near-tied tokens, an empty answer on both sides,
	// no consensus).
	Inconclusive Outcome = iota
	// Agree: the answers come from the same model, as far as can be told.
	Agree
	// Disagree: the answers come from different models (or decoding).
	Disagree
)

var outcomeNames = [...]string{Inconclusive: "inconclusive", Agree: "agree", Disagree: "disagree"}

// String returns "inconclusive", "agree" or "disagree".
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return fmt.Sprintf("Outcome(%d)", int(o))
	}
	return outcomeNames[o]
}

// Tolerance says how far two answers of one model may differ: greedy
// decoding on batched or parallel kernels is not bit-exact, so two honest
// engines can part between two near-tied tokens and go on differently.
// The zero value of each field means the default named after it.
type Tolerance struct {
	// TieMargin: a divergence between tokens whose log-probabilities
	// differ by at most this much on both engines is a near tie.
	TieMargin float64
	// MinCommon: a near-tie divergence after at least this many agreeing
	// tokens is an agreement; earlier it is inconclusive. In text mode
	// it is counted in bytes, times 4 (four bytes to a token).
	MinCommon int
	// LateFraction (text mode, no logprobs to tell a tie): a divergence
	// after at least this fraction of the shorter answer (and MinCommon)
	// is taken as a tie, not a disagreement.
	LateFraction float64
	// LogprobGap: tokens that agree but whose log-probabilities differ by
	// more than this on average (over at least MinCommon tokens) come from
	// different weights: a disagreement.
	LogprobGap float64
}

// Defaults for the zero values of Tolerance.
const (
	// DefaultTieMargin is 0.5 nats: the two tokens' probabilities are
	// within a factor of 1.65 of each other, a gap that kernel
	// nondeterminism (differences around 1e-3 in the logits) cannot cross
	// from a clear choice but can flip from a close one.
	DefaultTieMargin = 0.5
	// DefaultMinCommon is 8 tokens.
	DefaultMinCommon = 8
	// DefaultLateFraction is one half of the shorter answer.
	DefaultLateFraction = 0.5
	// DefaultLogprobGap is 1 nat on average: a 4-bit quantization moves
	// logprobs by tenths of a nat, kernel noise by thousandths; a model of
	// another size by more than one.
	DefaultLogprobGap = 1.0
)

func (t Tolerance) populate() Tolerance {
	t.TieMargin = positiveOr(t.TieMargin, DefaultTieMargin)
	t.MinCommon = positiveOr(t.MinCommon, DefaultMinCommon)
	t.LateFraction = positiveOr(t.LateFraction, DefaultLateFraction)
	t.LogprobGap = positiveOr(t.LogprobGap, DefaultLogprobGap)
	return t
}

// positiveOr returns v, or def when v is not positive.
func positiveOr[T int | float64 | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

// Comparison is what Compare found between two answers, a and b.
type Comparison struct {
	Outcome Outcome
	// Tokens is true when the answers were compared token by token (both
	// gave logprobs); otherwise Common and Shorter count bytes.
	Tokens bool
	// Common is the length of the agreeing prefix.
	Common int
	// Shorter is the length of the shorter answer.
	Shorter int
	// NearTie is true when the answers parted between near-tied tokens.
	NearTie bool
	// AOfB is a's log-probability of b's token where they parted, BOfA the
	// reverse; NaN when unknown (no divergence, or the token was not among
	// the engine's top candidates).
	AOfB, BOfA float64
	// MeanGap is the mean absolute difference of the two engines'
	// log-probabilities over the agreeing tokens (token mode); NaN in text
	// mode.
	MeanGap float64
	// Reason says why, in a few words, for logs and the admin API.
	Reason string
}

// Compare compares two answers to the same greedy (or equally seeded)
// prompt. When both carry tokens with logprobs it walks the tokens: the
// answers agree up to where they part; a parting between near-tied tokens
// after MinCommon agreeing tokens is an agreement, earlier it tells
// nothing; a parting where either engine finds the other's token clearly
// worse is a disagreement, and so is an agreeing run whose probabilities
// differ by more than LogprobGap on average. Without logprobs it compares
// the texts: a late parting (LateFraction) is taken for a tie.
//
// An answer that is a prefix of the other agrees (one engine stopped
// earlier or was cut by max_tokens). Compare is symmetric in its outcome.
func Compare(a, b Answer, tol Tolerance) Comparison {
	tol = tol.populate()
	if a.Tokens != nil && b.Tokens != nil {
		return compareTokens(a.Tokens, b.Tokens, tol)
	}
	return compareText(a.Text, b.Text, tol)
}

func compareText(a, b string, tol Tolerance) Comparison {
	c := Comparison{AOfB: math.NaN(), BOfA: math.NaN(), MeanGap: math.NaN()}
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	// Count whole characters only: a parting inside a multi-byte rune
	// starts at the rune.
	for n > 0 && ((n < len(a) && !utf8.RuneStart(a[n])) || (n < len(b) && !utf8.RuneStart(b[n]))) {
		n--
	}
	c.Common, c.Shorter = n, min(len(a), len(b))
	minBytes := 4 * tol.MinCommon
	switch {
	case len(a) == 0 && len(b) == 0:
		c.Outcome, c.Reason = Inconclusive, "both answers empty"
	case c.Shorter == 0:
		if max(len(a), len(b)) >= minBytes {
			c.Outcome, c.Reason = Disagree, "one answer empty"
		} else {
			c.Outcome, c.Reason = Inconclusive, "one answer empty, the other short"
		}
	case n == c.Shorter:
		c.Outcome, c.Reason = Agree, "one answer is a prefix of the other"
	case n >= minBytes && float64(n) >= tol.LateFraction*float64(c.Shorter):
		c.Outcome, c.NearTie = Agree, true
		c.Reason = fmt.Sprintf("texts part late, at byte %d of %d", n, c.Shorter)
	default:
		c.Outcome = Disagree
		c.Reason = fmt.Sprintf("texts part at byte %d of %d", n, c.Shorter)
	}
	return c
}

func compareTokens(a, b []Token, tol Tolerance) Comparison {
	c := Comparison{Tokens: true, AOfB: math.NaN(), BOfA: math.NaN(), MeanGap: math.NaN()}
	n, gap := 0, 0.0
	for n < len(a) && n < len(b) && a[n].Text == b[n].Text {
		gap += math.Abs(a[n].Logprob - b[n].Logprob)
		n++
	}
	c.Common, c.Shorter = n, min(len(a), len(b))
	if n > 0 {
		c.MeanGap = gap / float64(n)
	}
	if len(a) == 0 && len(b) == 0 {
		c.Outcome, c.Reason = Inconclusive, "both answers empty"
		return c
	}
	if n == c.Shorter {
		if c.Shorter == 0 {
			if max(len(a), len(b)) >= tol.MinCommon {
				c.Outcome, c.Reason = Disagree, "one answer empty"
			} else {
				c.Outcome, c.Reason = Inconclusive, "one answer empty, the other short"
			}
			return c
		}
		if n >= tol.MinCommon && c.MeanGap > tol.LogprobGap {
			c.Outcome = Disagree
			c.Reason = fmt.Sprintf("same %d tokens, logprobs apart by %.2f nats on average", n, c.MeanGap)
			return c
		}
		c.Outcome, c.Reason = Agree, "one answer is a prefix of the other"
		return c
	}
	ta, tb := a[n], b[n]
	c.AOfB, c.BOfA = lookup(ta, tb.Text), lookup(tb, ta.Text)
	// How much worse each engine found the other's choice than its own.
	gapA, gapB := ta.Logprob-c.AOfB, tb.Logprob-c.BOfA
	// An engine that listed no candidates cannot tell: the other decides.
	tieA := math.IsNaN(gapA) || gapA <= tol.TieMargin
	tieB := math.IsNaN(gapB) || gapB <= tol.TieMargin
	switch {
	case math.IsNaN(gapA) && math.IsNaN(gapB):
		// Neither engine listed the other's token: no probabilities to
		// tell a tie, so judge the position as the text mode does.
		c.Reason = fmt.Sprintf("tokens part at %d of %d, neither listed the other's", n, c.Shorter)
		if n >= tol.MinCommon && float64(n) >= tol.LateFraction*float64(c.Shorter) {
			c.Outcome, c.NearTie = Agree, true
		} else {
			c.Outcome = Disagree
		}
	case tieA && tieB:
		c.NearTie = true
		if n >= tol.MinCommon {
			c.Outcome = Agree
			c.Reason = fmt.Sprintf("near tie at token %d of %d", n, c.Shorter)
		} else {
			c.Outcome = Inconclusive
			c.Reason = fmt.Sprintf("near tie early, at token %d", n)
		}
	default:
		c.Outcome = Disagree
		c.Reason = fmt.Sprintf("tokens part at %d of %d: %q vs %q, %.2f and %.2f nats apart", n, c.Shorter, ta.Text, tb.Text, nanTo(gapA, math.Inf(1)), nanTo(gapB, math.Inf(1)))
	}
	return c
}

// lookup returns t's log-probability of the token text at t's position:
// t's own when it chose it, from t.Top otherwise; when t listed candidates
// and text is not among them, it is at most the least of them, which is
// returned (the gap computed from it is then a lower bound); NaN when t
// listed none.
func lookup(t Token, text string) float64 {
	if t.Text == text {
		return t.Logprob
	}
	if len(t.Top) == 0 {
		return math.NaN()
	}
	least := math.Inf(1)
	for _, alt := range t.Top {
		if alt.Text == text {
			return alt.Logprob
		}
		least = min(least, alt.Logprob)
	}
	return least
}

func nanTo(v, d float64) float64 {
	if math.IsNaN(v) {
		return d
	}
	return v
}
