package transport

import (
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	rcmgr "github.com/libp2p/go-libp2p/p2p/host/resource-manager"
	"github.com/libp2p/go-libp2p/p2p/net/connmgr"
	libp2pquic "github.com/libp2p/go-libp2p/p2p/transport/quic"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"
)

// DefaultListenAddrs are the addresses a host listens on when
// HostConfig.ListenAddrs is empty: QUIC on a random UDP port, IPv4 and IPv6.
var DefaultListenAddrs = []string{"/ip4/0.0.0.0/udp/0/quic-v1", "/ip6/::/udp/0/quic-v1"}

// HostConfig configures NewHost. The zero value is a host with an ephemeral
// identity listening on DefaultListenAddrs and logging nowhere.
type HostConfig struct {
	// ListenAddrs are QUIC multiaddrs (/ip4|ip6/.../udp/N/quic-v1). Empty
	// means DefaultListenAddrs.
	ListenAddrs []string
	// IdentityFile holds the Ed25519 key (see LoadOrCreateIdentity). Empty
	// means a new ephemeral identity.
	IdentityFile string
	// Key, if set, is the identity, and IdentityFile is ignored (for callers
	// that loaded it already with LoadOrCreateIdentity).
	Key crypto.PrivKey
	// Logger receives the start-up line (peer ID and addresses). The zero
	// value discards.
	Logger zerolog.Logger
	// Options are appended after ours, so they can add NAT traversal, relay
	// and hole punching settings. They cannot replace the transport, the
	// resource manager or the connection manager.
	Options []libp2p.Option
	// RelayLimits, when set, says that the host runs the circuit relay
	// service with these limits (see RelayNATOptions): its resource manager
	// then also grants the streams and memory they need
	// (RelayResourceLimits), which Options cannot do. Nil means no relay
	// service limits are merged.
	RelayLimits *RelayLimits
}

// Connection manager watermarks: a relay keeps one connection per agent and
// must not trim them. Joined peers are also protected (see ServeJoin), so
// these only bound unknown connections.
const (
	connLowWater  = 2048
	connHighWater = 4096
	connGrace     = time.Minute
)

// NewHost builds a libp2p host that speaks QUIC only, with its identity from
// cfg.IdentityFile, resource limits sized for a relay serving many agents,
// and logs its peer ID and full multiaddrs (with /p2p/<ID>) at info level.
func NewHost(cfg HostConfig) (host.Host, error) {
	listen := cfg.ListenAddrs
	if len(listen) == 0 {
		listen = DefaultListenAddrs
	}
	addrs := make([]ma.Multiaddr, 0, len(listen))
	for _, s := range listen {
		a, err := ma.NewMultiaddr(s)
		if err != nil {
			return nil, fmt.Errorf("listen address %q: %w", s, err)
		}
		if _, err := a.ValueForProtocol(ma.P_QUIC_V1); err != nil {
			return nil, fmt.Errorf("listen address %q: only QUIC (/udp/N/quic-v1) is supported", s)
		}
		addrs = append(addrs, a)
	}
	key := cfg.Key
	if key == nil {
		var err error
		if key, err = LoadOrCreateIdentity(cfg.IdentityFile); err != nil {
			return nil, err
		}
	}
	rm, err := rcmgr.NewResourceManager(rcmgr.NewFixedLimiter(resourceLimits(cfg.RelayLimits)))
	if err != nil {
		return nil, fmt.Errorf("resource manager: %w", err)
	}
	cm, err := connmgr.NewConnManager(connLowWater, connHighWater, connmgr.WithGracePeriod(connGrace))
	if err != nil {
		rm.Close()
		return nil, fmt.Errorf("connection manager: %w", err)
	}
	opts := []libp2p.Option{
		libp2p.Identity(key),
		libp2p.NoTransports,
		libp2p.Transport(libp2pquic.NewTransport),
		libp2p.ListenAddrs(addrs...),
		libp2p.ResourceManager(rm),
		libp2p.ConnectionManager(cm),
		libp2p.UserAgent("computeflux"),
	}
	opts = append(opts, cfg.Options...)
	h, err := libp2p.New(opts...)
	if err != nil {
		// libp2p closes the resource manager on failure only once it owns it;
		// closing twice is harmless.
		rm.Close()
		cm.Close()
		return nil, fmt.Errorf("libp2p host: %w", err)
	}
	ev := cfg.Logger.Info().Str("peer_id", h.ID().String())
	full := FullAddrs(h)
	strs := make([]string, len(full))
	for i, a := range full {
		strs[i] = a.String()
	}
	ev.Strs("addrs", strs).Msg("libp2p host listening")
	return h, nil
}

// FullAddrs returns h's listen addresses with /p2p/<peer ID> appended: what
// another peer needs to dial it.
func FullAddrs(h host.Host) []ma.Multiaddr {
	info := peer.AddrInfo{ID: h.ID(), Addrs: h.Addrs()}
	out, err := peer.AddrInfoToP2pAddrs(&info)
	if err != nil {
		return nil
	}
	return out
}

// resourceLimits starts from libp2p's defaults scaled to this machine and
// raises what a relay with many agents needs: QUIC uses one UDP socket, so
// connections cost no file descriptor, and each agent holds one connection
// with a join stream, its in-flight inference streams and gossip streams.
// With relay limits, the circuit relay service's entries are merged in.
func resourceLimits(relay *RelayLimits) rcmgr.ConcreteLimitConfig {
	scaling := rcmgr.DefaultLimits
	libp2p.SetDefaultServiceLimits(&scaling)
	streams := rcmgr.ResourceLimits{
		StreamsInbound:  4096,
		StreamsOutbound: 4096,
		Streams:         8192,
	}
	partial := rcmgr.PartialLimitConfig{
		System: rcmgr.ResourceLimits{
			ConnsInbound:    8192,
			ConnsOutbound:   1024,
			Conns:           8192,
			StreamsInbound:  65536,
			StreamsOutbound: 65536,
			Streams:         131072,
		},
		// Streams sit in the transient scope until their protocol is
		// negotiated: a burst of agents reconnecting after a relay restart
		// must fit.
		Transient: rcmgr.ResourceLimits{
			ConnsInbound:   1024,
			Conns:          1024,
			StreamsInbound: 4096,
			Streams:        8192,
		},
		// One agent: a relay may run as many inference streams to it as the
		// engine can take (QUIC itself caps a connection at 256 incoming
		// streams).
		PeerDefault: rcmgr.ResourceLimits{
			StreamsInbound:  1024,
			StreamsOutbound: 1024,
			Streams:         2048,
		},
		Protocol: map[protocol.ID]rcmgr.ResourceLimits{
			InferProtocol:        {StreamsInbound: 65536, StreamsOutbound: 65536, Streams: 131072},
			JoinProtocol:         {StreamsInbound: 16384, StreamsOutbound: 64, Streams: 16384},
			GossipPacketProtocol: streams,
			GossipStreamProtocol: streams,
		},
		ProtocolPeer: map[protocol.ID]rcmgr.ResourceLimits{
			InferProtocol: {StreamsInbound: 1024, StreamsOutbound: 1024, Streams: 2048},
			// One registration per agent; a few more while a reconnect
			// replaces a stale one.
			JoinProtocol: {StreamsInbound: 4, StreamsOutbound: 4, Streams: 8},
		},
	}
	if relay != nil {
		// Apply fills only the entries ours leave at their default: the
		// relay service and the circuit protocols, which we do not set.
		partial.Apply(RelayResourceLimits(*relay))
	}
	return partial.Build(scaling.AutoScale())
}
