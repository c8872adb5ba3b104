package audit

import (
	"fmt"
	"math"
)

// Participant is one engine's answer to an audit prompt: every participant
// got the same request, the same seed included.
type Participant struct {
	// Agent names the agent (or provider endpoint) that answered.
	Agent string
	// Group names who stands behind the agent, as far as the relay can
	// tell (its network, see GroupOf): the participants of one group are
	// one voice, however many agents it runs. Empty means the agent's
	// name (a group of its own).
	Group string
	// Weight is the voice's weight, its tenure (see Tenure), in (0, 1];
	// zero means 1.
	Weight float64
	// Kind is the engine's kind ("vllm", "llama.cpp", ...; empty when
	// unknown). Under sampled decoding only answers of one kind compare:
	// engines of different kinds draw other tokens from the same seed.
	Kind string
	// Trusted marks an operator's reference: when a round has one that
	// compares with an agent, the agent is judged against it alone, and it
	// gets no verdict.
	Trusted bool
	// Suspect marks an agent that is judged but whose answer does not count
	// as a reference for the others (a quarantined agent being re-audited).
	Suspect bool
	// Answer is what it answered.
	Answer Answer
}

func (p *Participant) group() string {
	if p.Group == "" {
		return p.Agent
	}
	return p.Group
}

func (p *Participant) weight() float64 {
	if !(p.Weight > 0) || p.Weight > 1 {
		return 1
	}
	return p.Weight
}

// Rules say how a round of answers becomes verdicts. The zero value of
// each field means its default.
type Rules struct {
	// Tolerance is passed to Compare.
	Tolerance Tolerance
	// Sampled says the prompt was decoded with sampling under a shared
	// seed: then only answers of engines of one Kind compare.
	Sampled bool
	// MinVoices is the least number of independent groups, agreeing with
	// one another, that must disagree with an agent to convict it without
	// an operator's reference. If zero, DefaultMinVoices.
	MinVoices int
}

// DefaultMinVoices is 2: two independent voices that agree with one
// another convict a third that both disagree with, as long as they
// outweigh it and those agreeing with it. One voice against one decides
// nothing.
const DefaultMinVoices = 2

// Verdict is what one round found about one agent.
type Verdict struct {
	// Agent is the participant judged.
	Agent string
	// Outcome is Agree (clean), Disagree (convicting evidence) or
	// Inconclusive (no evidence either way).
	Outcome Outcome
	// ByReference is true when an operator's reference decided.
	ByReference bool
	// Agree, Disagree and Inconclusive count the comparisons with the
	// references (or voices) that were weighed.
	Agree, Disagree, Inconclusive int
	// Against is the reference whose comparison is shown in Evidence: for
	// a disagreement, one of those it disagreed with; otherwise the first
	// reference that agreed, if any.
	Against string
	// Evidence is that comparison (this agent's answer as a, the
	// reference's as b).
	Evidence Comparison
	// Reason says why, in a few words.
	Reason string
}

// comparable reports whether two participants' answers can be compared
// under r: always for greedy decoding, within one engine kind for sampled.
func comparable(a, b *Participant, r Rules) bool { return !r.Sampled || a.Kind == b.Kind }

var notComparable = Comparison{Outcome: Inconclusive, AOfB: math.NaN(), BOfA: math.NaN(), MeanGap: math.NaN(),
	Reason: "engines of different kinds: sampled answers do not compare"}

// Judge turns one round into a verdict for each participant that is not
// Trusted, in order. Every pair of comparable answers is compared once.
//
// With a trusted reference that compares with an agent, the agent agrees
// when it agrees with more trusted references than it disagrees with, and
// disagrees in the reverse case. Otherwise the other groups are the
// voices: each group votes once, through its heaviest answer that is not
// Suspect, and the agent's own group does not vote on it. The agent
// disagrees when at least MinVoices groups that agree with one another
// disagree with it and their weight passes the agent's own and that of
// the groups agreeing with it; it agrees when some group agrees and those
// agreeing weigh at least as much as those disagreeing. Everything else is
// inconclusive: no evidence either way.
func Judge(parts []Participant, r Rules) []Verdict {
	if r.MinVoices <= 0 {
		r.MinVoices = DefaultMinVoices
	}
	n := len(parts)
	cmp := make([][]Comparison, n)
	for i := range cmp {
		cmp[i] = make([]Comparison, n)
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			c := notComparable
			if comparable(&parts[i], &parts[j], r) {
				c = Compare(parts[i].Answer, parts[j].Answer, r.Tolerance)
			}
			cmp[i][j] = c
			// The mirror: the same outcome, sides swapped.
			m := c
			m.AOfB, m.BOfA = c.BOfA, c.AOfB
			cmp[j][i] = m
		}
	}
	// Each group's voice: its heaviest participant that may vote.
	rep := map[string]int{}
	for i := range parts {
		p := &parts[i]
		if p.Trusted || p.Suspect {
			continue
		}
		if j, ok := rep[p.group()]; !ok || p.weight() > parts[j].weight() {
			rep[p.group()] = i
		}
	}
	var out []Verdict
	for i := range parts {
		p := &parts[i]
		if p.Trusted {
			continue
		}
		var trusted []int
		for j := range parts {
			if parts[j].Trusted && comparable(p, &parts[j], r) {
				trusted = append(trusted, j)
			}
		}
		if len(trusted) > 0 {
			out = append(out, byReference(parts, cmp, i, trusted))
			continue
		}
		var voices []int
		for j := range parts {
			if j != i && !parts[j].Trusted && !parts[j].Suspect && parts[j].group() != p.group() && rep[parts[j].group()] == j {
				voices = append(voices, j)
			}
		}
		out = append(out, byVoices(parts, cmp, i, voices, r))
	}
	return out
}

// byReference judges parts[i] against the trusted references.
func byReference(parts []Participant, cmp [][]Comparison, i int, trusted []int) Verdict {
	v := Verdict{Agent: parts[i].Agent, ByReference: true}
	var agreeing, disagreeing []int
	for _, j := range trusted {
		switch cmp[i][j].Outcome {
		case Agree:
			agreeing = append(agreeing, j)
		case Disagree:
			disagreeing = append(disagreeing, j)
		default:
			v.Inconclusive++
		}
	}
	v.Agree, v.Disagree = len(agreeing), len(disagreeing)
	switch {
	case v.Disagree > v.Agree:
		v.Outcome, v.Reason = Disagree, "disagrees with the operator's reference"
	case v.Agree > v.Disagree:
		v.Outcome, v.Reason = Agree, "agrees with its references"
	case v.Agree+v.Disagree == 0:
		v.Outcome, v.Reason = Inconclusive, "no reference answered conclusively"
	default:
		v.Outcome, v.Reason = Inconclusive, "references split"
	}
	switch {
	case len(disagreeing) > 0 && (v.Outcome == Disagree || len(agreeing) == 0):
		v.Against, v.Evidence = parts[disagreeing[0]].Agent, cmp[i][disagreeing[0]]
	case len(agreeing) > 0:
		v.Against, v.Evidence = parts[agreeing[0]].Agent, cmp[i][agreeing[0]]
	}
	return v
}

// byVoices judges parts[i] by the other groups' voices.
func byVoices(parts []Participant, cmp [][]Comparison, i int, voices []int, r Rules) Verdict {
	v := Verdict{Agent: parts[i].Agent}
	var agreeing, disagreeing []int
	var agreeW, disagreeW float64
	for _, j := range voices {
		switch cmp[i][j].Outcome {
		case Agree:
			agreeing = append(agreeing, j)
			agreeW += parts[j].weight()
		case Disagree:
			disagreeing = append(disagreeing, j)
			disagreeW += parts[j].weight()
		default:
			v.Inconclusive++
		}
	}
	v.Agree, v.Disagree = len(agreeing), len(disagreeing)
	// The heaviest bloc of disagreeing voices that agree with one of them
	// (a star around it): liars of different kinds do not add up to a
	// consensus.
	blocN, blocW, center := 0, 0.0, -1
	for _, d := range disagreeing {
		k, w := 1, parts[d].weight()
		for _, e := range disagreeing {
			if e != d && cmp[d][e].Outcome == Agree {
				k++
				w += parts[e].weight()
			}
		}
		if w > blocW || (w == blocW && k > blocN) {
			blocN, blocW, center = k, w, d
		}
	}
	self := parts[i].weight()
	switch {
	case blocN >= r.MinVoices && blocW > agreeW+self:
		v.Outcome = Disagree
		v.Reason = fmt.Sprintf("%d independent agents that agree with one another disagree with it", blocN)
	case v.Agree > 0 && agreeW >= disagreeW:
		v.Outcome, v.Reason = Agree, "agrees with its references"
	case v.Agree+v.Disagree == 0:
		v.Outcome, v.Reason = Inconclusive, "no independent agent answered comparably"
	case v.Disagree > v.Agree:
		v.Outcome = Inconclusive
		v.Reason = fmt.Sprintf("disagrees with %d of weight %.2f, short of %d voices outweighing it and %d agreeing", blocN, blocW, r.MinVoices, v.Agree)
	default:
		v.Outcome, v.Reason = Inconclusive, "references split"
	}
	switch {
	case v.Outcome == Disagree, len(agreeing) == 0 && center >= 0:
		v.Against, v.Evidence = parts[center].Agent, cmp[i][center]
	case len(agreeing) > 0:
		v.Against, v.Evidence = parts[agreeing[0]].Agent, cmp[i][agreeing[0]]
	}
	return v
}
