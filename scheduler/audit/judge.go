package audit

import "fmt"

// Participant is one engine's answer in an audit round: every participant
// got the same prompt with the same greedy decoding.
type Participant struct {
	// Agent names the agent (or provider endpoint) that answered.
	Agent string
	// Trusted marks an operator's reference: when a round has one, the
	// others are judged against it alone, and it gets no verdict.
	Trusted bool
	// Suspect marks an agent that is judged but whose answer does not count
	// as a reference for the others (a quarantined agent being re-audited).
	Suspect bool
	// Answer is what it answered.
	Answer Answer
}

// Rules say how a round of answers becomes verdicts. The zero value of
// each field means its default.
type Rules struct {
	// Tolerance is passed to Compare.
	Tolerance Tolerance
	// MinConsensus is the least number of other agents, agreeing with one
	// another, that must all disagree with an agent to convict it without
	// an operator's reference. If zero, DefaultMinConsensus.
	MinConsensus int
}

// DefaultMinConsensus is 3: with three, two agents lying together cannot
// outvote and convict the one honest agent beside them (they are not
// caught either: that takes an operator's reference), and four agents of a
// model are enough to convict one.
const DefaultMinConsensus = 3

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
	// references that were weighed.
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

// Judge turns one round into a verdict for each participant that is not
// Trusted, in order. Every pair of answers is compared once.
//
// With a trusted reference in the round, an agent agrees when it agrees
// with more trusted references than it disagrees with, and disagrees in
// the reverse case. Without one, the other agents are the references (the
// Suspect ones excepted): an agent disagrees when at least MinConsensus of
// them disagree with it while agreeing with one another, and more of them
// than agree with it; it agrees when at least as many agree as disagree.
// Everything else is inconclusive: no evidence either way.
func Judge(parts []Participant, r Rules) []Verdict {
	if r.MinConsensus <= 0 {
		r.MinConsensus = DefaultMinConsensus
	}
	n := len(parts)
	cmp := make([][]Comparison, n)
	for i := range cmp {
		cmp[i] = make([]Comparison, n)
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			c := Compare(parts[i].Answer, parts[j].Answer, r.Tolerance)
			cmp[i][j] = c
			// The mirror: the same outcome, sides swapped.
			m := c
			m.AOfB, m.BOfA = c.BOfA, c.AOfB
			cmp[j][i] = m
		}
	}
	trusted := false
	for _, p := range parts {
		trusted = trusted || p.Trusted
	}
	var out []Verdict
	for i, p := range parts {
		if p.Trusted {
			continue
		}
		v := Verdict{Agent: p.Agent, ByReference: trusted}
		var agreeing, disagreeing []int
		for j, q := range parts {
			if j == i || q.Trusted != trusted || (!trusted && q.Suspect) {
				continue
			}
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
		// The largest group of disagreeing references that agree with one
		// of them (a star around it): liars of different kinds do not add
		// up to a consensus.
		bloc, center := 0, -1
		for _, d := range disagreeing {
			k := 1
			for _, e := range disagreeing {
				if e != d && cmp[d][e].Outcome == Agree {
					k++
				}
			}
			if k > bloc {
				bloc, center = k, d
			}
		}
		switch {
		case trusted && v.Disagree > v.Agree:
			v.Outcome, v.Reason = Disagree, "disagrees with the operator's reference"
		case !trusted && bloc >= r.MinConsensus && bloc > v.Agree:
			v.Outcome = Disagree
			v.Reason = fmt.Sprintf("%d agents that agree with one another disagree with it", bloc)
		case v.Agree > 0 && v.Agree >= v.Disagree && !(trusted && v.Agree == v.Disagree):
			v.Outcome, v.Reason = Agree, "agrees with its references"
		case v.Agree+v.Disagree == 0:
			v.Outcome, v.Reason = Inconclusive, "no reference answered conclusively"
		case !trusted && v.Disagree > v.Agree:
			v.Outcome = Inconclusive
			v.Reason = fmt.Sprintf("disagrees with %d, short of a consensus of %d", bloc, r.MinConsensus)
		default:
			v.Outcome, v.Reason = Inconclusive, "references split"
		}
		switch {
		case v.Outcome == Disagree, len(agreeing) == 0 && center >= 0:
			v.Against, v.Evidence = parts[center].Agent, cmp[i][center]
		case len(agreeing) > 0:
			v.Against, v.Evidence = parts[agreeing[0]].Agent, cmp[i][agreeing[0]]
		}
		out = append(out, v)
	}
	return out
}
