package audit

import (
	"fmt"
	"net/netip"
)

// Independence says which agents count as one voice in an audit: one
// person can join many agents with the join secret every contributor
// holds, so agents behind one network are taken for one person's.
type Independence int

const (
	// ByNetwork (the default): agents whose addresses share an IPv4 /24
	// or an IPv6 /48 are one voice, as Bitcoin's and Tor's peer
	// selection group addresses (they use /16: a coarser net).
	ByNetwork Independence = iota
	// ByAddress: agents behind one IP address are one voice.
	ByAddress
	// ByAgent: every agent is a voice of its own; for a fleet whose
	// agents the operator knows.
	ByAgent
)

var independenceNames = [...]string{ByNetwork: "network", ByAddress: "address", ByAgent: "agent"}

// String returns "network", "address" or "agent".
func (in Independence) String() string {
	if in < 0 || int(in) >= len(independenceNames) {
		return fmt.Sprintf("Independence(%d)", int(in))
	}
	return independenceNames[in]
}

// ParseIndependence parses String's names.
func ParseIndependence(s string) (Independence, error) {
	for i, n := range independenceNames {
		if s == n {
			return Independence(i), nil
		}
	}
	return 0, fmt.Errorf("audit: independence %q: want network, address or agent", s)
}

// Group returns the group (Participant.Group) of the agent named agent
// seen at addr: its network, its address, or its name. An agent whose
// address is unknown (a provider endpoint) is a group of its own.
func (in Independence) Group(agent string, addr netip.Addr) string {
	if !addr.IsValid() || in == ByAgent {
		return "agent:" + agent
	}
	addr = addr.Unmap()
	if in == ByAddress {
		return addr.String()
	}
	bits := 24
	if addr.Is6() {
		bits = 48
	}
	p, err := addr.Prefix(bits)
	if err != nil {
		return addr.String()
	}
	return p.String()
}
