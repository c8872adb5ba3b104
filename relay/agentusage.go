package relay

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/relay/ledger"
)

// AgentUsage is the answer to `computeflux agent usage`: what one agent
// served through this relay, by model, and nothing about anyone else.
type AgentUsage struct {
	// Agent is the name the agent joined under.
	Agent string `json:"agent"`
	// Note says why the report starts later than asked, when it does.
	Note string `json:"note,omitempty"`
	ledger.Report
}

// claimAgent records, at its join, which identity serves under an agent
// name, unless another did first (ledger.ClaimAgent).
func (r *Relay) claimAgent(name string, p peer.ID) {
	if l := r.cfg.Ledger; l != nil {
		if owner, err := l.ClaimAgent(name, p.String()); err != nil {
			r.log.Warn().Err(err).Str("agent", name).Msg("usage ledger: the agent's name could not be claimed")
		} else if owner != p.String() {
			r.log.Info().Str("agent", name).Stringer("peer", p).Str("first_peer", owner).
				Msg("agent name first served by another identity: this one sees only its own registration's usage")
		}
	}
}

// agentUsage answers an agent's owner (transport.AgentUsageProtocol; the
// transport checked the join secret and the agent key's signature). The
// ledger keeps rows by agent name; the relay knows which name a key holds
// while its agent is joined, and which key served under a name first. The
// first key sees the name's whole history; another one (a new identity,
// or someone who took the name while its agent was away) only what was
// served from the first whole hour of its current registration on.
func (r *Relay) agentUsage(agent peer.ID, since string) ([]byte, error) {
	l := r.cfg.Ledger
	if l == nil {
		return nil, errors.New("this relay keeps no usage ledger (it runs without --ledger-file)")
	}
	name, joined, ok := r.reg.registration(agent)
	if !ok {
		return nil, fmt.Errorf("agent %s is not joined to this relay right now: the relay knows which agent name a key holds while its agent is joined", agent)
	}
	now := r.cfg.Clock.Now()
	t, err := ledger.ParseSince(since, now)
	if err != nil {
		return nil, err
	}
	owner, err := l.ClaimAgent(name, agent.String())
	if err != nil {
		return nil, fmt.Errorf("the usage ledger cannot be read: %w", err)
	}
	ans := AgentUsage{Agent: name}
	if owner != agent.String() {
		start := joined.Truncate(time.Hour).Add(time.Hour)
		if t.Before(start) {
			t = start
			ans.Note = fmt.Sprintf("another identity served as %s before this one: the report starts at %s, the first whole hour of this registration", name, start.UTC().Format(time.RFC3339))
		}
		if t.After(now) {
			ans.Report = ledger.Report{Since: t, Until: now.UTC(), By: ledger.ByModel.String(), Rows: []ledger.ReportRow{}, Ledger: l.Health()}
			return json.Marshal(ans)
		}
	}
	if ans.Report, err = l.AgentUsage(t, name); err != nil {
		return nil, fmt.Errorf("the usage ledger cannot be read: %w", err)
	}
	return json.Marshal(ans)
}
