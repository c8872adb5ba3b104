package transport

// NAT traversal: which addresses count as public, the circuit relay v2 service
// a ComputeFlux relay runs for admitted peers, and the agent side (forced
// private reachability, a static relay reservation, DCUtR hole punching) with
// a way to tell which path a connection to a peer takes.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/config"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"github.com/libp2p/go-libp2p/p2p/host/autorelay"
	bhost "github.com/libp2p/go-libp2p/p2p/host/basic"
	rcmgr "github.com/libp2p/go-libp2p/p2p/host/resource-manager"
	circuitproto "github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/proto"
	"github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/relay"
	"github.com/libp2p/go-libp2p/p2p/protocol/holepunch"
	ma "github.com/multiformats/go-multiaddr"
	manet "github.com/multiformats/go-multiaddr/net"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.uber.org/fx"
)

// HolePunchProtocol is the DCUtR protocol ID. An agent registers it once it
// knows one of its own public addresses; AgentNAT.Ready reports that.
const HolePunchProtocol protocol.ID = holepunch.Protocol

// ParsePublicCIDRs parses address ranges (e.g. "100.64.0.0/10") for the
// PublicCIDRs fields of RelayNATConfig and AgentNATConfig. An empty list is
// valid and means go-multiaddr's own notion of public only.
func ParsePublicCIDRs(list []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(list))
	for _, s := range list {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("public CIDR %q: %w", s, err)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// IsPublicAddr reports whether a's IP counts as publicly routable: either
// go-multiaddr says so (manet.IsPublicAddr) or the IP lies in one of extra.
//
// Why the extra ranges exist: go-libp2p only hole punches with addresses that
// manet.IsPublicAddr accepts, and that function sees RFC 6598 carrier-grade
// NAT space (100.64.0.0/10) as private and benchmarking or documentation space
// (198.18.0.0/15, 192.0.2.0/24, ...) as unroutable. A deployment whose
// "internet" is such a range (a carrier network, a lab, a WAN between sites)
// would otherwise never start DCUtR. The setting is per host, never global:
// it feeds only the address lists this file builds (the DCUtR service's own
// addresses and the relay's reservation addresses); go-multiaddr's process
// wide tables (manet.Private4, manet.Unroutable4) stay untouched, so identify,
// the dialer and every other host in the process behave as before.
func IsPublicAddr(a ma.Multiaddr, extra []netip.Prefix) bool {
	if manet.IsPublicAddr(a) {
		return true
	}
	if len(extra) == 0 || len(a) == 0 {
		return false
	}
	var ip netip.Addr
	switch c := a[0]; c.Protocol().Code {
	case ma.P_IP4, ma.P_IP6:
		var ok bool
		ip, ok = netip.AddrFromSlice(c.RawValue())
		if !ok {
			return false
		}
		ip = ip.Unmap()
	default:
		return false
	}
	for _, p := range extra {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// isCircuit reports whether a is a relayed (p2p-circuit) address.
func isCircuit(a ma.Multiaddr) bool {
	_, err := a.ValueForProtocol(ma.P_CIRCUIT)
	return err == nil
}

// Path is the kind of connection a host holds to a peer.
type Path int

const (
	// PathNone means no connection at all.
	PathNone Path = iota
	// PathRelayed means only relayed (circuit v2, limited) connections.
	PathRelayed
	// PathDirect means at least one direct connection (dialed, or hole punched).
	PathDirect
)

// String returns "none", "relayed" or "direct".
func (p Path) String() string {
	switch p {
	case PathRelayed:
		return "relayed"
	case PathDirect:
		return "direct"
	default:
		return "none"
	}
}

// IsRelayedConn reports whether c runs through a relay's circuit.
func IsRelayedConn(c network.Conn) bool {
	return isCircuit(c.RemoteMultiaddr()) || c.Stat().Limited
}

// PathTo returns the best path h currently holds to p. libp2p opens new
// streams on a direct connection when one exists, so PathDirect also means
// new streams (gossip included) take the direct path.
func PathTo(h host.Host, p peer.ID) Path {
	path := PathNone
	for _, c := range h.Network().ConnsToPeer(p) {
		if !IsRelayedConn(c) {
			return PathDirect
		}
		path = PathRelayed
	}
	return path
}

// CircuitAddrs returns the addresses that reach target through relay's
// circuit, one per relay address: <relay addr>/p2p/<relay>/p2p-circuit/p2p/<target>.
func CircuitAddrs(relayInfo peer.AddrInfo, target peer.ID) []ma.Multiaddr {
	suffix, err := ma.NewMultiaddr("/p2p/" + relayInfo.ID.String() + "/p2p-circuit/p2p/" + target.String())
	if err != nil {
		return nil
	}
	out := make([]ma.Multiaddr, 0, len(relayInfo.Addrs))
	for _, a := range relayInfo.Addrs {
		if isCircuit(a) {
			continue
		}
		out = append(out, a.Encapsulate(suffix))
	}
	return out
}

// RelayLimits bounds the circuits a ComputeFlux relay carries between peers.
// Circuits carry gossip (memberlist probes, acks, piggy-backed updates and
// push/pull syncs) between agents that have no direct path, and the DCUtR
// exchange that usually replaces them by a direct path. Inference never goes
// through a circuit: the relay talks to each agent over the connection the
// agent dialed. The zero value of every field means the default in brackets.
type RelayLimits struct {
	// Duration is the lifetime of one relayed connection before the relay
	// resets it and the peers redial [30m]. libp2p's default of 2 minutes
	// would make an agent behind a symmetric NAT lose its gossip path every
	// two minutes.
	Duration time.Duration
	// Data is the number of bytes relayed in each direction of one relayed
	// connection before it is reset [16 MiB]. Gossip between two members is a
	// few hundred bytes a second at most (a probe and ack every second or so,
	// plus a push/pull of at most 512 bytes of metadata per member every 30 s):
	// 16 MiB lasts the whole Duration with a wide margin even for 50 members,
	// where libp2p's 128 KiB default would not last a minute.
	Data int64
	// MaxCircuits is the number of simultaneous relayed connections per peer
	// [256]: an agent behind a symmetric NAT gossips with every other member
	// through the relay. The relay's host must also grant the streams (see
	// RelayResourceLimits); libp2p's default resource limits stop at 64.
	MaxCircuits int
	// MaxReservations is the number of peers that may hold a reservation at
	// once [4096]; only admitted peers get one.
	MaxReservations int
	// MaxReservationsPerIP is the number of reservations from one IP [64]:
	// several agents may share one home or carrier-grade NAT address.
	MaxReservationsPerIP int
	// ReservationTTL is how long a reservation lasts unless refreshed [1h];
	// agents refresh theirs every minute.
	ReservationTTL time.Duration
	// BufferSize is the per-direction copy buffer of a circuit [4 KiB], enough
	// for one memberlist packet at a time.
	BufferSize int
}

func (l *RelayLimits) populate() {
	if l.Duration == 0 {
		l.Duration = 30 * time.Minute
	}
	if l.Data == 0 {
		l.Data = 16 << 20
	}
	if l.MaxCircuits == 0 {
		l.MaxCircuits = 256
	}
	if l.MaxReservations == 0 {
		l.MaxReservations = 4096
	}
	if l.MaxReservationsPerIP == 0 {
		l.MaxReservationsPerIP = 64
	}
	if l.ReservationTTL == 0 {
		l.ReservationTTL = time.Hour
	}
	if l.BufferSize == 0 {
		l.BufferSize = 4 << 10
	}
}

func (l RelayLimits) validate() error {
	switch {
	case l.Duration < 0, l.Data < 0, l.MaxCircuits < 0, l.MaxReservations < 0,
		l.MaxReservationsPerIP < 0, l.ReservationTTL < 0, l.BufferSize < 0:
		return errors.New("relay limits must not be negative")
	case l.ReservationTTL < 2*time.Minute:
		return errors.New("relay reservation TTL under 2m: agents refresh every minute")
	}
	return nil
}

// RelayResourceLimits returns the resource-manager limits the relay service
// needs to honour l. libp2p's defaults allow 64 relay streams per peer, which
// would cap circuits per peer well below MaxCircuits; a relay's host merges
// these entries (Service, ServicePeer, Protocol, ProtocolPeer) into its limit
// configuration. Each circuit holds two streams in the relay service (the
// hop stream from its source, the stop stream to its destination) and two
// copy buffers; a reservation holds a hop stream while it is made.
func RelayResourceLimits(l RelayLimits) rcmgr.PartialLimitConfig {
	l.populate()
	perPeer := rcmgr.LimitVal(l.MaxCircuits + 8)
	// The relay carries at most MaxCircuits per peer, but nothing bounds the
	// sum except this: four circuits' worth of streams per reserved peer.
	total := rcmgr.LimitVal(4 * l.MaxReservations)
	buf := int64(2 * l.BufferSize)
	service := rcmgr.ResourceLimits{
		Streams: total, StreamsInbound: total, StreamsOutbound: total,
		Memory: rcmgr.LimitVal64(buf*int64(total) + 16<<20),
	}
	peerLimits := rcmgr.ResourceLimits{
		Streams: perPeer, StreamsInbound: perPeer, StreamsOutbound: perPeer,
		Memory: rcmgr.LimitVal64(buf*int64(perPeer) + 1<<20),
	}
	proto := rcmgr.ResourceLimits{Streams: total, StreamsInbound: total, StreamsOutbound: total}
	protoPeer := rcmgr.ResourceLimits{Streams: perPeer, StreamsInbound: perPeer, StreamsOutbound: perPeer}
	return rcmgr.PartialLimitConfig{
		Service:     map[string]rcmgr.ResourceLimits{relay.ServiceName: service},
		ServicePeer: map[string]rcmgr.ResourceLimits{relay.ServiceName: peerLimits},
		Protocol: map[protocol.ID]rcmgr.ResourceLimits{
			circuitproto.ProtoIDv2Hop: proto, circuitproto.ProtoIDv2Stop: proto,
		},
		ProtocolPeer: map[protocol.ID]rcmgr.ResourceLimits{
			circuitproto.ProtoIDv2Hop: protoPeer, circuitproto.ProtoIDv2Stop: protoPeer,
		},
	}
}

// RelayNATConfig configures the NAT-traversal side of a ComputeFlux relay.
type RelayNATConfig struct {
	// Admit decides which peers may hold a reservation and open circuits (both
	// ends of a circuit must be admitted). It is called on every reservation
	// and circuit request, concurrently, and must not block; it may consult
	// state built after the host (the relay's registry of joined agents).
	// Required: a nil Admit is an error, never "everyone".
	Admit func(peer.ID) bool
	// PublicCIDRs are address ranges counted as public on top of
	// go-multiaddr's own (see IsPublicAddr). The relay puts its addresses in
	// these ranges into reservations it grants.
	PublicCIDRs []netip.Prefix
	// Limits bounds the circuits; the zero value means the defaults.
	Limits RelayLimits
	// Counters, if set, counts reservations, circuits and relayed bytes.
	Counters *RelayCounters
}

// aclFilter admits reservations and circuits for admitted peers only.
type aclFilter struct{ admit func(peer.ID) bool }

func (a aclFilter) AllowReserve(p peer.ID, _ ma.Multiaddr) bool { return a.admit(p) }

func (a aclFilter) AllowConnect(src peer.ID, _ ma.Multiaddr, dst peer.ID) bool {
	return a.admit(src) && a.admit(dst)
}

// RelayNATOptions returns the libp2p options of a ComputeFlux relay: public
// reachability forced (the relay runs on a public host; without it libp2p's
// relay service waits for AutoNAT to confirm what we already know) and a
// circuit v2 relay service with cfg's ACL and limits. Append them to the
// host's options (HostConfig.Options).
func RelayNATOptions(cfg RelayNATConfig) ([]libp2p.Option, error) {
	if cfg.Admit == nil {
		return nil, errors.New("relay NAT config: Admit is required")
	}
	cfg.Limits.populate()
	if err := cfg.Limits.validate(); err != nil {
		return nil, fmt.Errorf("relay NAT config: %w", err)
	}
	l := cfg.Limits
	res := relay.DefaultResources()
	res.Limit = &relay.RelayLimit{Duration: l.Duration, Data: l.Data}
	res.ReservationTTL = l.ReservationTTL
	res.MaxReservations = l.MaxReservations
	res.MaxCircuits = l.MaxCircuits
	res.BufferSize = l.BufferSize
	res.MaxReservationsPerIP = l.MaxReservationsPerIP
	// The ASN bound protects open relays from one provider's peers; ours only
	// serves admitted peers, many of whom share a home ISP.
	res.MaxReservationsPerASN = l.MaxReservations
	extra := slices.Clone(cfg.PublicCIDRs)
	svc := []relay.Option{
		relay.WithResources(res),
		relay.WithACL(aclFilter{admit: cfg.Admit}),
		relay.WithReservationAddressFilter(func(a ma.Multiaddr) bool { return IsPublicAddr(a, extra) }),
	}
	if cfg.Counters != nil {
		svc = append(svc, relay.WithMetricsTracer(relayTracer{cfg.Counters}))
	}
	return []libp2p.Option{
		libp2p.ForceReachabilityPublic(),
		libp2p.EnableRelayService(svc...),
	}, nil
}

// AgentNATConfig configures the NAT-traversal side of an agent (any peer
// behind NAT that reaches others through our relay).
type AgentNATConfig struct {
	// Relays are the static relays to hold a reservation with. Required.
	Relays []peer.AddrInfo
	// PublicCIDRs are address ranges counted as public on top of
	// go-multiaddr's own (see IsPublicAddr): own addresses in them, as seen
	// by the relay, are offered to peers for hole punching.
	PublicCIDRs []netip.Prefix
	// ReservationBackoff is how long autorelay waits after a refused or failed
	// reservation before asking again [5s]; libp2p's default is one hour, far
	// too long when the refusal only means "not joined yet".
	ReservationBackoff time.Duration
	// RelayMinInterval is the minimum time between two looks at the relay
	// list [1s] (libp2p: 30s). With one static relay a look costs nothing.
	RelayMinInterval time.Duration
	// PunchTimeout bounds one hole-punch attempt [3s]; DCUtR makes up to
	// three, so a punch that cannot succeed (symmetric NAT) gives up after
	// about three times this. QUIC caps an attempt at 5 s anyway.
	PunchTimeout time.Duration
	// PunchRetry is how long after an inbound relayed connection appeared
	// the hole punch is started again when DCUtR, which starts once per
	// connection, gave up before punching (a stream that failed, a peer
	// that had no address to offer yet) [5s]. It is tried at most
	// punchRetries times; a punch that ran and failed (a symmetric NAT) is
	// not tried again.
	PunchRetry time.Duration
	// OnUpgrade, if set, is called when a direct connection to a peer appears
	// while a relayed one exists (a hole punch, or a direct dial, won), with
	// the time since the first relayed connection to that peer. It is called
	// from libp2p's connection notifier: it must not block.
	OnUpgrade func(p peer.ID, after time.Duration)
	// Registerer receives libp2p's hole punching and autorelay metrics; nil
	// keeps them in a private registry.
	Registerer prometheus.Registerer
	// Logger gets hole-punch outcomes at debug level.
	Logger zerolog.Logger
}

func (c *AgentNATConfig) populate() {
	if c.ReservationBackoff == 0 {
		c.ReservationBackoff = 5 * time.Second
	}
	if c.RelayMinInterval == 0 {
		c.RelayMinInterval = time.Second
	}
	if c.PunchTimeout == 0 {
		c.PunchTimeout = 3 * time.Second
	}
	if c.PunchRetry == 0 {
		c.PunchRetry = 5 * time.Second
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
}

func (c *AgentNATConfig) validate() error {
	if len(c.Relays) == 0 {
		return errors.New("agent NAT config: at least one relay is required")
	}
	for _, r := range c.Relays {
		if r.ID == "" || len(r.Addrs) == 0 {
			return errors.New("agent NAT config: a relay needs a peer ID and an address")
		}
	}
	if c.ReservationBackoff < 0 || c.RelayMinInterval < 0 || c.PunchTimeout < 0 || c.PunchRetry < 0 {
		return errors.New("agent NAT config: durations must not be negative")
	}
	return nil
}

// NATStats counts an agent's NAT traversal events since its host started.
type NATStats struct {
	// HolePunches counts finished hole-punch attempts, on either side.
	HolePunches uint64
	// HolePunchSuccesses counts the attempts that produced a direct connection.
	HolePunchSuccesses uint64
	// HolePunchErrors counts DCUtR exchanges that ended before a punch,
	// on either side; PunchRetries the punches started again after one
	// (AgentNATConfig.PunchRetry).
	HolePunchErrors, PunchRetries uint64
	// Upgrades counts direct connections that appeared while a relayed one to
	// the same peer existed.
	Upgrades uint64
	// Reservations is the number of relay reservations currently held.
	Reservations int64
}

// AgentNAT is the NAT-traversal machinery of one agent host. Build it with
// NewAgentNAT, pass Options to the host constructor, then use it to learn
// when the host is ready for hole punching and which path a peer takes. One
// AgentNAT serves one host. Its methods are safe for concurrent use.
type AgentNAT struct {
	cfg AgentNATConfig

	mu   sync.Mutex // guards the following fields
	host host.Host  // set when the host starts
	svc  *holepunch.Service
	// relayed are the peers we hold only relayed connections to, since
	// the first of them appeared.
	relayed map[peer.ID]*relayedPeer
	// joined are the relays we hold a registration with (SetJoined); the
	// reservation is asked for only then. joinedCh is closed and replaced
	// on every change.
	joined   map[peer.ID]bool
	joinedCh chan struct{}

	punches, punchOK, punchErrors, retries, upgrades atomic.Uint64
	reservations                                     atomic.Int64
}

// NewAgentNAT checks cfg and fills its defaults.
func NewAgentNAT(cfg AgentNATConfig) (*AgentNAT, error) {
	cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg.Relays = slices.Clone(cfg.Relays)
	cfg.PublicCIDRs = slices.Clone(cfg.PublicCIDRs)
	return &AgentNAT{
		cfg:      cfg,
		relayed:  make(map[peer.ID]*relayedPeer),
		joined:   make(map[peer.ID]bool),
		joinedCh: make(chan struct{}),
	}, nil
}

// SetJoined tells whether we hold a registration with relay. A relay grants
// a reservation to joined peers only, and a refused request costs the
// reservation backoff, so the reservation is asked for once joined. Losing
// every connection to the relay also counts as no longer joined.
func (n *AgentNAT) SetJoined(relay peer.ID, joined bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.joined[relay] == joined {
		return
	}
	if joined {
		n.joined[relay] = true
	} else {
		delete(n.joined, relay)
	}
	close(n.joinedCh)
	n.joinedCh = make(chan struct{})
}

// relaySource is autorelay's peer source: the static relays we are joined
// to, as soon as there is one.
func (n *AgentNAT) relaySource(ctx context.Context, num int) <-chan peer.AddrInfo {
	out := make(chan peer.AddrInfo, len(n.cfg.Relays))
	go func() {
		defer close(out)
		for {
			n.mu.Lock()
			var ready []peer.AddrInfo
			for _, r := range n.cfg.Relays {
				if n.joined[r.ID] && len(ready) < num {
					ready = append(ready, r)
				}
			}
			ch := n.joinedCh
			n.mu.Unlock()
			if len(ready) > 0 {
				for _, r := range ready {
					out <- r
				}
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-ch:
			}
		}
	}()
	return out
}

// Options returns the libp2p options of an agent host: private reachability
// forced (it is behind NAT; AutoNAT need not find out), the circuit relay
// client, autorelay with a reservation at the static relays and shortened
// backoffs, and a DCUtR hole-punching service that uses this config's notion
// of public addresses.
//
// The DCUtR service is built here rather than with libp2p.EnableHolePunching,
// which hands the service host addresses filtered through
// manet.IsPublicAddr only and so never starts when the outside of the NAT is
// in, e.g., 100.64.0.0/10 or 198.18.0.0/15. The two must not be combined: the
// options fail if EnableHolePunching is set. The service registers
// /libp2p/dcutr once the relay has told the host its outside address.
func (n *AgentNAT) Options() []libp2p.Option {
	inner := autorelay.NewMetricsTracer(autorelay.WithRegisterer(n.cfg.Registerer))
	return []libp2p.Option{
		func(c *config.Config) error {
			if c.EnableHolePunching {
				return errors.New("transport: AgentNAT runs its own hole punching; do not also pass libp2p.EnableHolePunching")
			}
			return nil
		},
		libp2p.ForceReachabilityPrivate(),
		libp2p.EnableRelay(),
		// The static relays, handed to autorelay only once joined (see
		// SetJoined): what autorelay.WithStaticRelays does, gated.
		libp2p.EnableAutoRelayWithPeerSource(n.relaySource,
			autorelay.WithMinCandidates(len(n.cfg.Relays)),
			autorelay.WithMaxCandidates(len(n.cfg.Relays)),
			autorelay.WithNumRelays(len(n.cfg.Relays)),
			autorelay.WithBackoff(n.cfg.ReservationBackoff),
			autorelay.WithMinInterval(n.cfg.RelayMinInterval),
			autorelay.WithBootDelay(0),
			autorelay.WithMetricsTracer(&reservationTracer{MetricsTracer: inner, n: n}),
		),
		libp2p.WithFxOption(fx.Invoke(n.start)),
	}
}

// start builds the hole-punching service when the host starts and closes it
// when the host stops.
func (n *AgentNAT) start(bh *bhost.BasicHost, obs bhost.ObservedAddrsManager, lc fx.Lifecycle) {
	addrs := func() []ma.Multiaddr {
		all := bh.AllAddrs()
		if obs != nil {
			// One observer (our relay) is enough to offer an address for a punch.
			all = append(all, obs.Addrs(1)...)
		}
		all = ma.Unique(all)
		return slices.DeleteFunc(all, func(a ma.Multiaddr) bool {
			return isCircuit(a) || !IsPublicAddr(a, n.cfg.PublicCIDRs)
		})
	}
	notifiee := &network.NotifyBundle{ConnectedF: n.connected, DisconnectedF: n.disconnected}
	lc.Append(fx.Hook{
		OnStart: func(context.Context) error {
			svc, err := holepunch.NewService(bh, bh.IDService(), addrs,
				holepunch.DirectDialTimeout(n.cfg.PunchTimeout),
				holepunch.WithMetricsAndEventTracer(
					holepunch.NewMetricsTracer(holepunch.WithRegisterer(n.cfg.Registerer)),
					punchTracer{n}),
			)
			if err != nil {
				return fmt.Errorf("hole punching service: %w", err)
			}
			n.mu.Lock()
			n.host, n.svc = bh, svc
			n.mu.Unlock()
			bh.Network().Notify(notifiee)
			return nil
		},
		OnStop: func(context.Context) error {
			bh.Network().StopNotify(notifiee)
			n.mu.Lock()
			svc := n.svc
			n.svc = nil
			for p := range n.relayed {
				n.dropRelayedLocked(p)
			}
			n.mu.Unlock()
			if svc != nil {
				return svc.Close()
			}
			return nil
		},
	})
}

// punchRetries bounds the punches AgentNAT starts again for one peer
// while it stays relayed.
const punchRetries = 2

// relayedPeer is a peer we reach only through a relay.
type relayedPeer struct {
	since   time.Time
	punched bool // a punch (or the direct dial before it) ran
	retries int
	timer   *time.Timer // the next retry, for an inbound connection
}

func (n *AgentNAT) connected(_ network.Network, c network.Conn) {
	p := c.RemotePeer()
	now := time.Now()
	if IsRelayedConn(c) {
		n.mu.Lock()
		rp := n.relayed[p]
		if rp == nil {
			rp = &relayedPeer{since: now}
			n.relayed[p] = rp
		}
		// DCUtR starts on the side the relayed connection came in to;
		// that side also tries again if it gave up before punching.
		if c.Stat().Direction == network.DirInbound && rp.timer == nil {
			rp.timer = time.AfterFunc(n.cfg.PunchRetry, func() { n.retryPunch(p, rp) })
		}
		n.mu.Unlock()
		return
	}
	n.mu.Lock()
	rp, ok := n.relayed[p]
	n.dropRelayedLocked(p)
	n.mu.Unlock()
	if !ok {
		return
	}
	n.upgrades.Add(1)
	n.cfg.Logger.Debug().Str("peer", p.String()).Dur("after", now.Sub(rp.since)).Msg("direct path to peer")
	if n.cfg.OnUpgrade != nil {
		n.cfg.OnUpgrade(p, now.Sub(rp.since))
	}
}

// dropRelayedLocked forgets that p is reached only through a relay.
func (n *AgentNAT) dropRelayedLocked(p peer.ID) {
	if rp := n.relayed[p]; rp != nil {
		if rp.timer != nil {
			rp.timer.Stop()
		}
		delete(n.relayed, p)
	}
}

// retryPunch starts the hole punch to p again if it is still reached only
// through the relay and DCUtR gave up before punching, then schedules the
// next look.
func (n *AgentNAT) retryPunch(p peer.ID, rp *relayedPeer) {
	n.mu.Lock()
	svc, h := n.svc, n.host
	if n.relayed[p] != rp || rp.punched || rp.retries >= punchRetries || svc == nil || h == nil {
		n.mu.Unlock()
		return
	}
	rp.retries++
	retry := rp.retries
	rp.timer = time.AfterFunc(n.cfg.PunchRetry, func() { n.retryPunch(p, rp) })
	n.mu.Unlock()
	// Ready: the service has its public addresses, so DirectConnect does
	// not wait for them (which it would past the service's Close).
	if PathTo(h, p) != PathRelayed || !n.Ready() {
		return
	}
	n.retries.Add(1)
	n.cfg.Logger.Debug().Str("peer", p.String()).Int("retry", retry).Msg("hole punch started again")
	go func() {
		if err := svc.DirectConnect(p); err != nil {
			n.cfg.Logger.Debug().Str("peer", p.String()).Err(err).Msg("hole punch retry")
		}
	}()
}

// sawPunch notes, from DCUtR's events, that a punch to p ran.
func (n *AgentNAT) sawPunch(p peer.ID) {
	n.mu.Lock()
	if rp := n.relayed[p]; rp != nil {
		rp.punched = true
	}
	n.mu.Unlock()
}

func (n *AgentNAT) disconnected(nw network.Network, c network.Conn) {
	p := c.RemotePeer()
	relayed := false
	for _, other := range nw.ConnsToPeer(p) {
		if IsRelayedConn(other) {
			relayed = true
		}
	}
	if !relayed {
		n.mu.Lock()
		n.dropRelayedLocked(p)
		n.mu.Unlock()
	}
	if len(nw.ConnsToPeer(p)) == 0 {
		n.SetJoined(p, false)
	}
}

// Ready reports whether the host can take part in a hole punch: it holds a
// reservation with a relay (so peers can reach it through a circuit) and has
// registered /libp2p/dcutr (so the peer that receives the relayed connection
// finds the protocol when it starts the punch, which it does only once).
// Dial other agents through the relay only once both sides are ready.
func (n *AgentNAT) Ready() bool {
	n.mu.Lock()
	h := n.host
	n.mu.Unlock()
	if h == nil || n.reservations.Load() <= 0 {
		return false
	}
	return slices.Contains(h.Mux().Protocols(), HolePunchProtocol)
}

// WaitReady polls Ready until it holds or ctx ends.
func (n *AgentNAT) WaitReady(ctx context.Context) error {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for !n.Ready() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for relay reservation and hole punching: %w", ctx.Err())
		case <-t.C:
		}
	}
	return nil
}

// Stats returns the counters since the host started.
func (n *AgentNAT) Stats() NATStats {
	return NATStats{
		HolePunches:        n.punches.Load(),
		HolePunchSuccesses: n.punchOK.Load(),
		HolePunchErrors:    n.punchErrors.Load(),
		PunchRetries:       n.retries.Load(),
		Upgrades:           n.upgrades.Load(),
		Reservations:       n.reservations.Load(),
	}
}

// punchTracer counts hole-punch outcomes from the DCUtR service's events.
type punchTracer struct{ n *AgentNAT }

func (t punchTracer) Trace(evt *holepunch.Event) {
	log := t.n.cfg.Logger
	var end *holepunch.EndHolePunchEvt
	switch e := evt.Evt.(type) {
	case *holepunch.EndHolePunchEvt:
		end = e
		t.n.sawPunch(evt.Remote)
	case *holepunch.StartHolePunchEvt:
		t.n.sawPunch(evt.Remote)
		return
	case *holepunch.ProtocolErrorEvt:
		// DCUtR gave up before punching (a stream that failed, a peer with
		// no public address to offer yet): retryPunch starts it again.
		t.n.punchErrors.Add(1)
		log.Debug().Str("peer", evt.Remote.String()).Str("error", e.Error).Msg("hole punch not started")
		return
	case *holepunch.DirectDialEvt:
		t.n.sawPunch(evt.Remote)
		log.Debug().Str("peer", evt.Remote.String()).Bool("success", e.Success).
			Dur("elapsed", e.EllapsedTime).Str("error", e.Error).Msg("direct dial before a hole punch")
		return
	default:
		return
	}
	t.n.punches.Add(1)
	if end.Success {
		t.n.punchOK.Add(1)
	}
	log.Debug().Str("peer", evt.Remote.String()).Bool("success", end.Success).
		Dur("elapsed", end.EllapsedTime).Str("error", end.Error).Msg("hole punch")
}

// reservationTracer keeps libp2p's autorelay metrics and counts the
// reservations held, which autorelay does not otherwise expose while the
// relay's addresses are outside go-multiaddr's public ranges.
type reservationTracer struct {
	autorelay.MetricsTracer
	n *AgentNAT
}

func (r *reservationTracer) ReservationRequestFinished(isRefresh bool, err error) {
	r.MetricsTracer.ReservationRequestFinished(isRefresh, err)
	if !isRefresh && err == nil {
		r.n.reservations.Add(1)
	}
}

func (r *reservationTracer) ReservationEnded(cnt int) {
	r.MetricsTracer.ReservationEnded(cnt)
	r.n.reservations.Add(-int64(cnt))
}
