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
)
