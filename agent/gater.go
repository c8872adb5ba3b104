package agent

import (
	"github.com/libp2p/go-libp2p/core/control"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"

	"github.com/computeflux/computeflux/transport"
)

// gater refuses inbound connections from peers that are neither one of our
// relays nor a member of their gossip (a joined agent the relay told us of), before
// any protocol runs on them: a stranger who finds an agent's address learns
// nothing from it, not even identify's listen addresses and protocols.
// Outbound connections are ours to make.
type gater struct{ a *Agent }

var _ interface {
	InterceptPeerDial(peer.ID) bool
	InterceptAddrDial(peer.ID, ma.Multiaddr) bool
	InterceptAccept(network.ConnMultiaddrs) bool
	InterceptSecured(network.Direction, peer.ID, network.ConnMultiaddrs) bool
	InterceptUpgraded(network.Conn) (bool, control.DisconnectReason)
} = gater{}

func (gater) InterceptPeerDial(peer.ID) bool                                  { return true }
func (gater) InterceptAddrDial(peer.ID, ma.Multiaddr) bool                    { return true }
func (gater) InterceptAccept(network.ConnMultiaddrs) bool                     { return true }
func (gater) InterceptUpgraded(network.Conn) (bool, control.DisconnectReason) { return true, 0 }

func (g gater) InterceptSecured(dir network.Direction, p peer.ID, _ network.ConnMultiaddrs) bool {
	if dir != network.DirInbound || g.a.isRelay(p) {
		return true
	}
	gs := g.a.Gossip()
	return gs != nil && gs.Known(p)
}

// publicAddrs is the agent's address factory: it announces only addresses
// another peer could use, the public ones (by cfg.PublicCIDRs) and relayed
// ones, never LAN, loopback or private IPv6 addresses.
func (a *Agent) publicAddrs(addrs []ma.Multiaddr) []ma.Multiaddr {
	out := addrs[:0:0]
	for _, m := range addrs {
		if transport.IsPublicAddr(m, a.cfg.PublicCIDRs) || isRelayed(m) {
			out = append(out, m)
		}
	}
	return out
}

func isRelayed(m ma.Multiaddr) bool {
	_, err := m.ValueForProtocol(ma.P_CIRCUIT)
	return err == nil
}
