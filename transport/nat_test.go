package transport

import (
	"context"
	"io"
	"net/netip"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	rcmgr "github.com/libp2p/go-libp2p/p2p/host/resource-manager"
	"github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/relay"
	libp2pquic "github.com/libp2p/go-libp2p/p2p/transport/quic"
	ma "github.com/multiformats/go-multiaddr"
)

func TestIsPublicAddr(t *testing.T) {
	lab := []netip.Prefix{netip.MustParsePrefix("198.18.0.0/16"), netip.MustParsePrefix("100.64.0.0/10")}
	for _, tc := range []struct {
		addr  string
		extra []netip.Prefix
		want  bool
	}{
		{"/ip4/8.8.8.8/udp/4001/quic-v1", nil, true},
		{"/ip6/2606:4700::1/udp/4001/quic-v1", nil, true},
		{"/ip4/198.18.0.10/udp/4001/quic-v1", nil, false}, // benchmarking range: unroutable to go-multiaddr
		{"/ip4/100.64.1.2/udp/4001/quic-v1", nil, false},  // carrier-grade NAT: private to go-multiaddr
		{"/ip4/198.18.0.10/udp/4001/quic-v1", lab, true},
		{"/ip4/198.19.0.2/udp/4001/quic-v1", lab, false}, // outside the listed /16
		{"/ip4/100.64.1.2/udp/4001/quic-v1", lab, true},
		{"/ip4/192.168.1.2/udp/4001/quic-v1", lab, false},
		{"/ip6/::ffff:198.18.0.10/udp/4001/quic-v1", lab, true},
		{"/dns4/relay.example.com/udp/4001/quic-v1", lab, true},
		{"/p2p-circuit", lab, false},
	} {
		t.Run(tc.addr, func(t *testing.T) {
			if got := IsPublicAddr(ma.StringCast(tc.addr), tc.extra); got != tc.want {
				t.Errorf("IsPublicAddr(%s, %v) = %v, want %v", tc.addr, tc.extra, got, tc.want)
			}
		})
	}
}

func TestParsePublicCIDRs(t *testing.T) {
	got, err := ParsePublicCIDRs([]string{"198.18.0.0/15", "100.64.1.9/10"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []netip.Prefix{netip.MustParsePrefix("198.18.0.0/15"), netip.MustParsePrefix("100.64.0.0/10")}; !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if _, err := ParsePublicCIDRs([]string{"198.18.0.0"}); err == nil {
		t.Error("an address without a prefix length was accepted")
	}
}

func TestPathString(t *testing.T) {
	for p, want := range map[Path]string{PathNone: "none", PathRelayed: "relayed", PathDirect: "direct"} {
		if p.String() != want {
			t.Errorf("%d: %q, want %q", p, p.String(), want)
		}
	}
}

// TestRelayLimitsDefaults proves defaulting fills every field and keeps
// every field that was set (quic-go's config_test pattern).
func TestRelayLimitsDefaults(t *testing.T) {
	var l RelayLimits
	l.populate()
	v := reflect.ValueOf(l)
	for i := 0; i < v.NumField(); i++ {
		if v.Field(i).IsZero() {
			t.Errorf("default %s is zero", v.Type().Field(i).Name)
		}
	}
	if err := l.validate(); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
	set := RelayLimits{Duration: 7 * time.Minute, Data: 7, MaxCircuits: 7, MaxReservations: 7,
		MaxReservationsPerIP: 7, ReservationTTL: 7 * time.Minute, BufferSize: 7}
	kept := set
	kept.populate()
	if kept != set {
		t.Errorf("populate changed set fields: %+v", kept)
	}
	if err := (RelayLimits{Data: -1, ReservationTTL: time.Hour}).validate(); err == nil {
		t.Error("negative limit accepted")
	}
	if err := (RelayLimits{ReservationTTL: time.Minute}).validate(); err == nil {
		t.Error("reservation TTL shorter than the refresh interval accepted")
	}
}

func TestNATConfigErrors(t *testing.T) {
	if _, err := RelayNATOptions(RelayNATConfig{}); err == nil {
		t.Error("relay options without Admit accepted")
	}
	if _, err := NewAgentNAT(AgentNATConfig{}); err == nil {
		t.Error("agent NAT without relays accepted")
	}
	if _, err := NewAgentNAT(AgentNATConfig{Relays: []peer.AddrInfo{{ID: "x"}}}); err == nil {
		t.Error("agent NAT with an address-less relay accepted")
	}
}

func TestAgentNATRefusesSecondHolePuncher(t *testing.T) {
	relay := newTestHost(t)
	n, err := NewAgentNAT(AgentNATConfig{Relays: []peer.AddrInfo{{ID: relay.ID(), Addrs: relay.Addrs()}}})
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewHost(HostConfig{
		ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Options:     append([]libp2p.Option{libp2p.EnableHolePunching()}, n.Options()...),
	})
	if err == nil {
		h.Close()
		t.Fatal("a host with both hole punchers was built")
	}
	if !strings.Contains(err.Error(), "EnableHolePunching") {
		t.Errorf("error does not name the conflict: %v", err)
	}
}

// natLab is an in-process relay on loopback with an admission list.
type natLab struct {
	relay    host.Host
	admitted sync.Map // peer.ID -> struct{}
}

func newNATLab(t *testing.T) *natLab {
	t.Helper()
	l := &natLab{}
	opts, err := RelayNATOptions(RelayNATConfig{
		Admit: func(p peer.ID) bool { _, ok := l.admitted.Load(p); return ok },
	})
	if err != nil {
		t.Fatal(err)
	}
	l.relay, err = NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Options: opts})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.relay.Close() })
	return l
}

func (l *natLab) info() peer.AddrInfo { return peer.AddrInfo{ID: l.relay.ID(), Addrs: l.relay.Addrs()} }

// agent starts an agent host. Loopback counts as public only when
// loopbackPublic: that is what lets two hosts on one machine hole punch.
func (l *natLab) agent(t *testing.T, admit, loopbackPublic bool, onUpgrade func(peer.ID, time.Duration)) (host.Host, *AgentNAT) {
	t.Helper()
	cfg := AgentNATConfig{Relays: []peer.AddrInfo{l.info()}, OnUpgrade: onUpgrade}
	if loopbackPublic {
		cfg.PublicCIDRs = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	}
	n, err := NewAgentNAT(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Options: n.Options()})
	if err != nil {
		t.Fatal(err)
	}
	l.setUp(t, h, n, admit)
	return h, n
}

// setUp gives an agent host the echo handler and connects it to the relay.
func (l *natLab) setUp(t *testing.T, h host.Host, n *AgentNAT, admit bool) {
	t.Helper()
	t.Cleanup(func() { h.Close() })
	if admit {
		l.admitted.Store(h.ID(), struct{}{})
	}
	h.SetStreamHandler(testEcho, func(s network.Stream) {
		_, _ = io.Copy(s, s)
		_ = s.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.Connect(ctx, l.info()); err != nil {
		t.Fatal(err)
	}
	// An admitted agent stands for a joined one: it asks for its
	// reservation now.
	n.SetJoined(l.relay.ID(), admit)
}

const testEcho protocol.ID = "/computeflux/test/echo/1.0.0"

// echoOnce opens a stream as gossip does (limited connections allowed) and
// returns the path it took.
func echoOnce(t *testing.T, h host.Host, p peer.ID) Path {
	t.Helper()
	ctx, cancel := context.WithTimeout(network.WithAllowLimitedConn(context.Background(), "test"), 10*time.Second)
	defer cancel()
	s, err := h.NewStream(ctx, p, testEcho)
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	defer s.Close()
	path := PathDirect
	if IsRelayedConn(s.Conn()) {
		path = PathRelayed
	}
	if _, err := s.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	_ = s.CloseWrite()
	got, err := io.ReadAll(s)
	if err != nil || string(got) != "ping" {
		t.Fatalf("echo: %q %v", got, err)
	}
	return path
}

func natWaitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(20 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		case <-tick.C:
		}
	}
}

func dialThroughRelay(ctx context.Context, h host.Host, relay peer.AddrInfo, target peer.ID) error {
	ctx = network.WithAllowLimitedConn(ctx, "test")
	return h.Connect(ctx, peer.AddrInfo{ID: target, Addrs: CircuitAddrs(relay, target)})
}

// TestHolePunchOnLoopback runs the whole agent path in one process: both
// agents reserve a slot at the relay, one dials the other through the
// circuit, the receiver starts DCUtR, and the connection becomes direct.
// Loopback is declared public for the agents, as a lab declares its
// "internet" range: without it no punch would start.
func TestHolePunchOnLoopback(t *testing.T) {
	l := newNATLab(t)
	var upgrades atomic.Int32
	a, na := l.agent(t, true, true, func(peer.ID, time.Duration) { upgrades.Add(1) })
	b, nb := l.agent(t, true, true, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := na.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if err := nb.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if PathTo(a, b.ID()) != PathNone {
		t.Fatalf("path before any dial: %v", PathTo(a, b.ID()))
	}
	if err := dialThroughRelay(ctx, a, l.info(), b.ID()); err != nil {
		t.Fatal(err)
	}
	natWaitFor(t, "a direct connection", func() bool { return PathTo(a, b.ID()) == PathDirect })
	if got := echoOnce(t, a, b.ID()); got != PathDirect {
		t.Errorf("stream after the upgrade took %v", got)
	}
	natWaitFor(t, "the upgrade to be counted", func() bool { return na.Stats().Upgrades >= 1 && upgrades.Load() >= 1 })
	natWaitFor(t, "b's punch to be counted", func() bool { return nb.Stats().HolePunchSuccesses >= 1 })
	if s := na.Stats(); s.Reservations != 1 {
		t.Errorf("a holds %d reservations, want 1", s.Reservations)
	}
}

// TestRelayedWithoutPublicRange: agents whose outside address is not public
// to them never start DCUtR, and streams still work over the relayed,
// limited connection.
func TestRelayedWithoutPublicRange(t *testing.T) {
	l := newNATLab(t)
	a, na := l.agent(t, true, false, nil)
	b, nb := l.agent(t, true, false, nil)
	natWaitFor(t, "reservations", func() bool { return na.Stats().Reservations == 1 && nb.Stats().Reservations == 1 })
	if na.Ready() {
		t.Error("ready for hole punching without any public address")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := dialThroughRelay(ctx, a, l.info(), b.ID()); err != nil {
		t.Fatal(err)
	}
	if got := PathTo(a, b.ID()); got != PathRelayed {
		t.Fatalf("path %v, want relayed", got)
	}
	if got := echoOnce(t, a, b.ID()); got != PathRelayed {
		t.Errorf("stream took %v, want relayed", got)
	}
	if s := nb.Stats(); s.HolePunches != 0 || s.Upgrades != 0 {
		t.Errorf("punch activity without public addresses: %+v", s)
	}
}

// TestRelayAdmitsOnlyAdmittedPeers: a peer the registry does not admit gets
// no reservation, so nobody reaches it through the relay, and it cannot open
// circuits to admitted peers either.
func TestRelayAdmitsOnlyAdmittedPeers(t *testing.T) {
	l := newNATLab(t)
	a, na := l.agent(t, true, false, nil)
	stranger, _ := l.agent(t, false, false, nil)
	natWaitFor(t, "a's reservation", func() bool { return na.Stats().Reservations == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := dialThroughRelay(ctx, a, l.info(), stranger.ID()); err == nil {
		t.Error("reached a peer that was never admitted")
	}
	if err := dialThroughRelay(ctx, stranger, l.info(), a.ID()); err == nil {
		t.Error("a peer that was never admitted opened a circuit")
	}
}

// TestRelayResourceLimits: merged into libp2p's defaults, the limits let a
// peer hold MaxCircuits circuits through the relay service.
func TestRelayResourceLimits(t *testing.T) {
	l := RelayLimits{MaxCircuits: 300}
	partial := RelayResourceLimits(l)
	scaling := rcmgr.DefaultLimits
	libp2p.SetDefaultServiceLimits(&scaling)
	built := partial.Build(scaling.AutoScale())
	if got := built.ToPartialLimitConfig().ServicePeer[relay.ServiceName].Streams; got < 300 {
		t.Errorf("relay service streams per peer %v, want at least 300", got)
	}
	if got := built.ToPartialLimitConfig().Service[relay.ServiceName].StreamsInbound; got < 300 {
		t.Errorf("relay service inbound streams %v, want at least 300", got)
	}
}

// gatedLimiter refuses streams of one protocol while shut is set, as a
// peer does whose handler is not there yet or whose stream broke.
type gatedLimiter struct {
	rcmgr.Limiter
	proto protocol.ID
	shut  *atomic.Bool
}

func (l gatedLimiter) GetProtocolLimits(p protocol.ID) rcmgr.Limit {
	if p == l.proto {
		return gatedLimit{l.Limiter.GetProtocolLimits(p), l.shut}
	}
	return l.Limiter.GetProtocolLimits(p)
}

// gatedLimit is read on every stream, so shutting takes effect at once.
type gatedLimit struct {
	rcmgr.Limit
	shut *atomic.Bool
}

func (l gatedLimit) GetStreamLimit(d network.Direction) int {
	if l.shut.Load() {
		return 0
	}
	return l.Limit.GetStreamLimit(d)
}

func (l gatedLimit) GetStreamTotalLimit() int {
	if l.shut.Load() {
		return 0
	}
	return l.Limit.GetStreamTotalLimit()
}

// TestHolePunchStartedAgainAfterAnEarlyFailure: DCUtR starts once per
// relayed connection. When that one exchange breaks before a punch (here
// the dialer refuses the DCUtR stream), the receiving agent starts the
// punch again after PunchRetry, and the connection becomes direct.
func TestHolePunchStartedAgainAfterAnEarlyFailure(t *testing.T) {
	l := newNATLab(t)
	loopback := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	var shut atomic.Bool
	shut.Store(true)
	na, err := NewAgentNAT(AgentNATConfig{Relays: []peer.AddrInfo{l.info()}, PublicCIDRs: loopback})
	if err != nil {
		t.Fatal(err)
	}
	rm, err := rcmgr.NewResourceManager(gatedLimiter{rcmgr.NewFixedLimiter(resourceLimits(nil)), HolePunchProtocol, &shut})
	if err != nil {
		t.Fatal(err)
	}
	a, err := libp2p.New(append([]libp2p.Option{libp2p.NoTransports, libp2p.Transport(libp2pquic.NewTransport),
		libp2p.ListenAddrStrings("/ip4/127.0.0.1/udp/0/quic-v1"), libp2p.ResourceManager(rm)}, na.Options()...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	l.setUp(t, a, na, true)
	nbCfg := AgentNATConfig{Relays: []peer.AddrInfo{l.info()}, PublicCIDRs: loopback, PunchRetry: time.Second}
	nb, err := NewAgentNAT(nbCfg)
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewHost(HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Options: nb.Options()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	l.setUp(t, b, nb, true)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, n := range []*AgentNAT{na, nb} {
		if err := n.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := dialThroughRelay(ctx, a, l.info(), b.ID()); err != nil {
		t.Fatal(err)
	}
	natWaitFor(t, "b's DCUtR to fail", func() bool { return nb.Stats().HolePunchErrors >= 1 })
	if p := PathTo(b, a.ID()); p != PathRelayed || nb.Stats().HolePunches != 0 {
		t.Fatalf("after the failed exchange: path %v, %+v", p, nb.Stats())
	}
	shut.Store(false)
	natWaitFor(t, "a direct connection", func() bool { return PathTo(b, a.ID()) == PathDirect })
	natWaitFor(t, "the punch to be counted", func() bool { return nb.Stats().HolePunchSuccesses >= 1 })
	if s := nb.Stats(); s.PunchRetries != 1 {
		t.Errorf("b's stats %+v, want one retry", s)
	}
}
