package agent

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"

	"github.com/computeflux/computeflux/transport"
)

// An agent joins every relay it is given, each with its own handshake,
// registration and reconnect loop (stayJoined), and serves all of them: a
// relay lost leaves the agent serving the others while it reconnects to
// that one alone. What the agent reports (models, draining, the list of its
// relays, so that relays learn each other) goes to every relay.

// maxRelays bounds the relays one agent joins (the join info carries their
// addresses).
const maxRelays = 16

// relayLink is the agent's connection to one relay.
type relayLink struct {
	info    peer.AddrInfo
	addr    string        // as configured, with /p2p/<ID>
	changed chan struct{} // signalled (capacity 1) when the agent's info changes

	mu sync.Mutex // guards m
	m  *transport.Membership
}

// parseRelays turns the configured relay multiaddrs into links, rejecting
// duplicates.
func parseRelays(addrs []string) ([]*relayLink, error) {
	if len(addrs) > maxRelays {
		return nil, fmt.Errorf("agent: %d relays exceed %d", len(addrs), maxRelays)
	}
	var links []*relayLink
	for _, s := range addrs {
		ai, err := peer.AddrInfoFromString(s)
		if err != nil {
			return nil, fmt.Errorf("agent: relay address %q (a multiaddr ending in /p2p/<peer ID>): %w", s, err)
		}
		if slices.ContainsFunc(links, func(l *relayLink) bool { return l.info.ID == ai.ID }) {
			return nil, fmt.Errorf("agent: relay %s given twice", ai.ID)
		}
		links = append(links, &relayLink{info: *ai, addr: s, changed: make(chan struct{}, 1)})
	}
	return links, nil
}

// relayAddrs returns the configured relay list (Config.Relay, then
// Config.Relays).
func (c *Config) relayAddrs() []string {
	var out []string
	if c.Relay != "" {
		out = append(out, c.Relay)
	}
	for _, r := range c.Relays {
		if r != "" && !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	return out
}

// Relays returns the peer IDs of the relays the agent is configured with.
func (a *Agent) Relays() []peer.ID {
	out := make([]peer.ID, len(a.links))
	for i, l := range a.links {
		out[i] = l.info.ID
	}
	return out
}

// JoinedRelays returns the peer IDs of the relays the agent holds a
// registration with now.
func (a *Agent) JoinedRelays() []peer.ID {
	var out []peer.ID
	for _, l := range a.links {
		l.mu.Lock()
		if l.m != nil {
			out = append(out, l.info.ID)
		}
		l.mu.Unlock()
	}
	return out
}

// isRelay reports whether p is one of the agent's relays: only they may
// send it inference requests.
func (a *Agent) isRelay(p peer.ID) bool {
	for _, l := range a.links {
		if l.info.ID == p {
			return true
		}
	}
	return false
}

// relayInfos returns every relay's address info.
func (a *Agent) relayInfos() []peer.AddrInfo {
	out := make([]peer.AddrInfo, len(a.links))
	for i, l := range a.links {
		out[i] = l.info
	}
	return out
}

// circuitAddrs returns the addresses that reach member p: its direct
// addresses if it is one of our relays, else circuits through each of our
// relays (p holds a reservation with those it joined).
func (a *Agent) circuitAddrs(p peer.ID) []ma.Multiaddr {
	var out []ma.Multiaddr
	for _, l := range a.links {
		if l.info.ID == p {
			return l.info.Addrs
		}
		out = append(out, transport.CircuitAddrs(l.info, p)...)
	}
	return out
}

// gossipSeeds returns the relays to join the gossip through: those joined
// now, or every relay when none is.
func (a *Agent) gossipSeeds() []peer.ID {
	if ids := a.JoinedRelays(); len(ids) > 0 {
		return ids
	}
	return a.Relays()
}

// notifyLinks tells every relay loop that the agent's info changed.
func (a *Agent) notifyLinks() {
	for _, l := range a.links {
		select {
		case l.changed <- struct{}{}:
		default:
		}
	}
}

// runRelays keeps one registration per relay until ctx ends and returns
// those open then.
func (a *Agent) runRelays(ctx context.Context, h host.Host) []*transport.Membership {
	ms := make([]*transport.Membership, len(a.links))
	var wg sync.WaitGroup
	for i, l := range a.links {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ms[i] = a.stayJoined(ctx, h, l)
		}()
	}
	wg.Wait()
	return slices.DeleteFunc(ms, func(m *transport.Membership) bool { return m == nil })
}

// setMembership records l's registration (nil when it ended).
func (l *relayLink) setMembership(m *transport.Membership) {
	l.mu.Lock()
	l.m = m
	l.mu.Unlock()
}
