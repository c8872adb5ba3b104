package transport

import "github.com/libp2p/go-libp2p/core/protocol"

// Protocol IDs spoken between relays and agents. The last element is the
// wire version; an incompatible change gets a new ID, never a changed meaning.
const (
	// JoinProtocol carries the join handshake and, after it, the agent's
	// registration: the stream stays open while the agent is a member.
	JoinProtocol protocol.ID = "/computeflux/join/1.0.0"
	// InferProtocol carries one HTTP/1.1 request and its response per stream.
	InferProtocol protocol.ID = "/computeflux/infer/1.0.0"
	// GossipPacketProtocol carries memberlist packets (its UDP side).
	GossipPacketProtocol protocol.ID = "/computeflux/gossip/packet/1.0.0"
	// GossipStreamProtocol carries memberlist streams (push/pull state sync).
	GossipStreamProtocol protocol.ID = "/computeflux/gossip/stream/1.0.0"
	// PrefixProtocol carries an agent's prefix index (which KV-cache blocks
	// its engine holds) to a relay: a snapshot, then batched deltas (see
	// AppendPrefixFrame). The agent opens it after joining.
	PrefixProtocol protocol.ID = "/computeflux/prefix/1.0.0"
	// SessionsProtocol carries session bindings, and what clients with a
	// budget spent, from one relay to a peer relay (relay/peering).
	SessionsProtocol protocol.ID = "/computeflux/sessions/3.0.0"
	// SessionsProtocolV2 is SessionsProtocol without spending: relays of
	// the previous version still share bindings with this one.
	SessionsProtocolV2 protocol.ID = "/computeflux/sessions/2.0.0"
	// AgentUsageProtocol lets an agent's owner ask a relay what the agent
	// served (`computeflux agent usage`), and nothing about anyone else.
	//
	// The asker needs no running agent: it dials from a host of its own (any
	// identity), runs the framed handshake proving the join secret, and sends
	// as the hello's payload an AgentUsageRequest naming the agent's peer ID
	// with the agent key's signature over the protocol's label, the relay's
	// peer ID and the asker's peer ID. The signature proves the asker holds
	// the agent's key; binding it to both peer IDs (which libp2p
	// authenticates) makes it worthless on any other connection. The relay
	// answers with one frame: the report as JSON, or a reject with the reason.
	AgentUsageProtocol protocol.ID = "/computeflux/agent-usage/1.0.0"
)
