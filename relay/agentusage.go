package relay

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/relay/ledger"
)

// AgentUsage is the answer to `computeflux agent usage`: what one agent
// served through this relay, by model, and nothing about anyone else.
type AgentUsage struct {
	// Agent is the name the agent joined under.
	Agent string `json:"agent"`
	ledger.Report
}

// agentUsage answers an agent's owner (transport.AgentUsageProtocol; the
// transport checked the join secret and the agent key's signature). The
// ledger keeps rows by agent name, and the relay knows which name a key
// holds while its agent is joined.
func (r *Relay) agentUsage(agent peer.ID, since string) ([]byte, error) {
	l := r.cfg.Ledger
	if l == nil {
		return nil, errors.New("this relay keeps no usage ledger (it runs without --ledger-file)")
	}
	name, ok := r.reg.Name(agent)
	if !ok {
		return nil, fmt.Errorf("agent %s is not joined to this relay right now: the relay knows which agent name a key holds while its agent is joined", agent)
	}
	now := r.cfg.Clock.Now()
	t, err := ledger.ParseSince(since, now)
	if err != nil {
		return nil, err
	}
	rep, err := l.AgentUsage(t, name)
	if err != nil {
		return nil, fmt.Errorf("the usage ledger cannot be read: %w", err)
	}
	return json.Marshal(AgentUsage{Agent: name, Report: rep})
}
