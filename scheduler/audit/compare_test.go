package audit

import (
	"math"
	"strconv"
	"strings"
	"testing"
)

// toks builds tokens from "text:logprob" pairs split by spaces; a token
// may carry alternatives after a '|': "a:-0.1|b:-0.3|c:-2".
func toks(spec string) []Token {
	var out []Token
	for _, f := range strings.Fields(spec) {
		alts := strings.Split(f, "|")
		t := Token{}
		for i, a := range alts {
			text, lp := splitLP(a)
			if i == 0 {
				t.Text, t.Logprob = text, lp
			}
			if len(alts) > 1 {
				t.Top = append(t.Top, Alt{Text: text, Logprob: lp})
			}
		}
		out = append(out, t)
	}
	return out
}

func splitLP(s string) (string, float64) {
	i := strings.LastIndexByte(s, ':')
	lp, err := strconv.ParseFloat(s[i+1:], 64)
	if err != nil {
		panic(err)
	}
	return s[:i], lp
}

// same returns n tokens "t0".."tn-1" with logprob lp and no alternatives.
func same(n int, lp float64) []Token {
	out := make([]Token, n)
	for i := range out {
		out[i] = Token{Text: string(rune('a' + i%26)), Logprob: lp}
	}
	return out
}

func with(base []Token, more ...Token) []Token {
	return append(append([]Token(nil), base...), more...)
}

func TestCompare(t *testing.T) {
	eight := same(8, -0.1)
	three := same(3, -0.1)
	tests := []struct {
		name       string
		a, b       Answer
		tol        Tolerance
		want       Outcome
		common     int
		nearTie    bool
		wantReason string
	}{
		{name: "identical text", a: Answer{Text: "The capital of France is Paris."}, b: Answer{Text: "The capital of France is Paris."}, want: Agree, common: 31},
		{name: "text prefix (one stopped earlier)", a: Answer{Text: "The capital of France is Paris."}, b: Answer{Text: "The capital of France is Paris. It is"}, want: Agree, common: 31},
		{name: "text parts early", a: Answer{Text: "Paris is the capital of France, and it is large."}, b: Answer{Text: "The capital of France is Paris, a large city."}, want: Disagree, common: 0},
		{name: "text parts late", a: Answer{Text: "The capital of France is Paris, a city of light"}, b: Answer{Text: "The capital of France is Paris, a city on the Seine"}, want: Agree, common: 40, nearTie: true},
		{name: "text parts half way but under MinCommon", a: Answer{Text: "abcdefXXXXXX"}, b: Answer{Text: "abcdefYYYYYY"}, want: Disagree, common: 6},
		{name: "text parts inside a rune", a: Answer{Text: "caf\u00e9 au lait"}, b: Answer{Text: "caf\u00e8 au lait"}, want: Disagree, common: 3},
		{name: "both empty", a: Answer{}, b: Answer{}, want: Inconclusive},
		{name: "one empty, other long", a: Answer{}, b: Answer{Text: strings.Repeat("word ", 10)}, want: Disagree},
		{name: "one empty, other short", a: Answer{}, b: Answer{Text: "ok"}, want: Inconclusive},

		{name: "tokens identical", a: Answer{Tokens: eight}, b: Answer{Tokens: eight}, want: Agree, common: 8},
		{name: "tokens prefix", a: Answer{Tokens: eight}, b: Answer{Tokens: with(eight, Token{Text: "z", Logprob: -1})}, want: Agree, common: 8},
		{name: "near tie late", a: Answer{Tokens: with(eight, toks("x:-0.6|y:-0.8")...)}, b: Answer{Tokens: with(eight, toks("y:-0.65|x:-0.7")...)}, want: Agree, common: 8, nearTie: true},
		{name: "near tie early", a: Answer{Tokens: with(three, toks("x:-0.6|y:-0.8")...)}, b: Answer{Tokens: with(three, toks("y:-0.65|x:-0.7")...)}, want: Inconclusive, common: 3, nearTie: true},
		{name: "clear choice apart", a: Answer{Tokens: with(eight, toks("x:-0.05|y:-3.5")...)}, b: Answer{Tokens: with(eight, toks("y:-0.1|x:-2.9")...)}, want: Disagree, common: 8},
		{name: "one side sure, other tied", a: Answer{Tokens: with(eight, toks("x:-0.05|y:-3.5")...)}, b: Answer{Tokens: with(eight, toks("y:-0.6|x:-0.7")...)}, want: Disagree, common: 8},
		{name: "other's token not in top: bound decides", a: Answer{Tokens: with(eight, toks("x:-0.05|w:-4")...)}, b: Answer{Tokens: with(eight, toks("y:-0.6|x:-0.7")...)}, want: Disagree, common: 8},
		{name: "no alternatives listed, early", a: Answer{Tokens: with(three, toks("x:-0.1")...)}, b: Answer{Tokens: with(three, toks("y:-0.1")...)}, want: Disagree, common: 3},
		{name: "no alternatives listed, late", a: Answer{Tokens: with(eight, toks("x:-0.1")...)}, b: Answer{Tokens: with(eight, toks("y:-0.1")...)}, want: Agree, common: 8, nearTie: true},
		{name: "one lists, one does not: the lister says tie", a: Answer{Tokens: with(eight, toks("x:-0.6|y:-0.7")...)}, b: Answer{Tokens: with(eight, toks("y:-0.1")...)}, want: Agree, common: 8, nearTie: true},
		{name: "same tokens, logprobs far apart", a: Answer{Tokens: same(10, -0.1)}, b: Answer{Tokens: same(10, -1.5)}, want: Disagree, common: 10, wantReason: "logprobs apart"},
		{name: "same tokens, kernel noise", a: Answer{Tokens: same(10, -0.1)}, b: Answer{Tokens: same(10, -0.102)}, want: Agree, common: 10},
		{name: "same tokens, gap tolerated by a wider tolerance", a: Answer{Tokens: same(10, -0.1)}, b: Answer{Tokens: same(10, -1.5)}, tol: Tolerance{LogprobGap: 2}, want: Agree, common: 10},
		{name: "tokens on one side only: text mode", a: Answer{Text: "abc", Tokens: same(3, -0.1)}, b: Answer{Text: "abd"}, want: Disagree, common: 2},
		{name: "tokens both empty", a: Answer{Tokens: []Token{}}, b: Answer{Tokens: []Token{}}, want: Inconclusive},
		{name: "tokens one empty, other long", a: Answer{Tokens: []Token{}}, b: Answer{Tokens: eight}, want: Disagree},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := Compare(tc.a, tc.b, tc.tol)
			if c.Outcome != tc.want || c.Common != tc.common || c.NearTie != tc.nearTie {
				t.Fatalf("got %v common %d tie %v (%s), want %v common %d tie %v", c.Outcome, c.Common, c.NearTie, c.Reason, tc.want, tc.common, tc.nearTie)
			}
			if tc.wantReason != "" && !strings.Contains(c.Reason, tc.wantReason) {
				t.Errorf("reason %q, want it to say %q", c.Reason, tc.wantReason)
			}
			// Symmetric in its outcome.
			if r := Compare(tc.b, tc.a, tc.tol); r.Outcome != c.Outcome || r.Common != c.Common {
				t.Errorf("reversed: %v common %d, forward %v common %d", r.Outcome, r.Common, c.Outcome, c.Common)
			}
		})
	}
}

func TestCompareCrossLogprobs(t *testing.T) {
	a := Answer{Tokens: with(same(8, -0.1), toks("x:-0.05|y:-3.5")...)}
	b := Answer{Tokens: with(same(8, -0.1), toks("y:-0.1|q:-2.9")...)}
	c := Compare(a, b, Tolerance{})
	if c.AOfB != -3.5 {
		t.Errorf("a's logprob of b's token: %v, want -3.5", c.AOfB)
	}
	// x is not among b's candidates: at most the least of them.
	if c.BOfA != -2.9 {
		t.Errorf("b's logprob of a's token: %v, want the bound -2.9", c.BOfA)
	}
	if math.Abs(c.MeanGap) > 1e-12 {
		t.Errorf("mean gap over identical prefix %v, want 0", c.MeanGap)
	}
}

func FuzzCompare(f *testing.F) {
	f.Add("The capital of France is Paris.", "The capital of France is Lyon.", 0.5)
	f.Add("", "x", 0.0)
	f.Fuzz(func(t *testing.T, a, b string, frac float64) {
		tol := Tolerance{LateFraction: frac}
		c := Compare(Answer{Text: a}, Answer{Text: b}, tol)
		r := Compare(Answer{Text: b}, Answer{Text: a}, tol)
		if c.Outcome != r.Outcome || c.Common != r.Common {
			t.Fatalf("not symmetric: %+v vs %+v", c, r)
		}
		if c.Common > c.Shorter || a[:c.Common] != b[:c.Common] {
			t.Fatalf("common %d of %q and %q", c.Common, a, b)
		}
		if a == b && a != "" && c.Outcome != Agree {
			t.Fatalf("identical %q: %v", a, c.Outcome)
		}
	})
}
