// Package scenario runs NAT-traversal scenarios in a netlab topology: a
// relay on the public segment and peers in homes behind NATs, each a real
// libp2p host in its own process inside its namespace, driven by the
// controller over stdin/stdout (one JSON object per line each way).
//
// The processes are the calling test binary itself, re-executed with RoleEnv
// set: a test main calls MaybeRunRole first thing. Later scenarios run the
// computeflux binary in the same namespaces instead (netlab.Lab.Start).
package scenario

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"sort"
	"syscall"
	"time"

	"github.com/libp2p/go-libp2p/core/event"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"github.com/libp2p/go-libp2p/p2p/protocol/ping"
	ma "github.com/multiformats/go-multiaddr"
	msmux "github.com/multiformats/go-multistream"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/transport"
)

// RoleEnv names the role a re-executed binary plays; ConfigEnv carries its
// JSON configuration.
const (
	RoleEnv   = "CF_NETLAB_ROLE"
	ConfigEnv = "CF_NETLAB_CONFIG"
)

// EchoProtocol is served by lab peers: it copies the stream back.
const EchoProtocol protocol.ID = "/computeflux/netlab/echo/1.0.0"

// RoleConfig configures a role process.
type RoleConfig struct {
	Listen       string        `json:"listen"`       // multiaddr to listen on
	PublicCIDRs  []string      `json:"public_cidrs"` // see transport.IsPublicAddr
	Relay        string        `json:"relay"`        // peers: the relay's full multiaddr (with /p2p/ID)
	PunchTimeout time.Duration `json:"punch_timeout"`
}

// Hello is the first line a role prints once it is ready.
type Hello struct {
	ID      string   `json:"id"`
	Addrs   []string `json:"addrs"`
	ReadyMS float64  `json:"ready_ms"` // peers: start to relay reservation and DCUtR registered
	Error   string   `json:"error,omitempty"`
}

// Command is one request from the controller to a peer.
type Command struct {
	Cmd string `json:"cmd"` // "connect", "stats"
	// connect: the peer to reach through the relay, and how long to wait for
	// the relayed connection to become direct.
	Peer       string        `json:"peer,omitempty"`
	WaitDirect time.Duration `json:"wait_direct,omitempty"`
	Pings      int           `json:"pings,omitempty"`
	// GiveUpAfterPunches ends the wait once this many hole-punch attempts
	// have ended on this side without a direct connection (DCUtR makes three).
	GiveUpAfterPunches uint64 `json:"give_up_after_punches,omitempty"`
}

// Reply answers a Command.
type Reply struct {
	Error string `json:"error,omitempty"`
	// connect
	RelayedMS    float64 `json:"relayed_ms,omitempty"` // dial start to relayed connection
	DirectMS     float64 `json:"direct_ms,omitempty"`  // relayed connection to direct one (0: none)
	UpgradeMS    float64 `json:"upgrade_ms,omitempty"` // as reported by AgentNAT's OnUpgrade
	GaveUpMS     float64 `json:"gave_up_ms,omitempty"` // relayed connection to the last failed punch
	RTTRelayedMS float64 `json:"rtt_relayed_ms,omitempty"`
	RTTDirectMS  float64 `json:"rtt_direct_ms,omitempty"`
	Path         string  `json:"path,omitempty"`        // transport.PathTo after the wait
	StreamPath   string  `json:"stream_path,omitempty"` // path an echo stream took
	StreamOK     bool    `json:"stream_ok,omitempty"`
	// stats
	Stats transport.NATStats `json:"stats"`
}

// MaybeRunRole runs the role named in RoleEnv and exits; it returns at once
// when RoleEnv is unset. Call it first in TestMain.
func MaybeRunRole() {
	role := os.Getenv(RoleEnv)
	if role == "" {
		return
	}
	var cfg RoleConfig
	if err := json.Unmarshal([]byte(os.Getenv(ConfigEnv)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "role config:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch role {
	case "relay":
		err = runRelay(ctx, cfg, os.Stdin, os.Stdout)
	case "peer":
		err = runPeer(ctx, cfg, os.Stdin, os.Stdout)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		_ = json.NewEncoder(os.Stdout).Encode(Hello{Error: err.Error()})
		fmt.Fprintln(os.Stderr, role+":", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func logger() zerolog.Logger {
	if os.Getenv("CF_NETLAB_DEBUG") != "" {
		return zerolog.New(os.Stderr).With().Timestamp().Logger()
	}
	return zerolog.Nop()
}

func hello(h host.Host, readyMS float64) Hello {
	out := Hello{ID: h.ID().String(), ReadyMS: readyMS}
	for _, a := range h.Network().ListenAddresses() {
		out.Addrs = append(out.Addrs, a.String())
	}
	return out
}

// waitInput returns when the controller closes stdin or ctx ends.
func waitInput(ctx context.Context, in io.Reader) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, in)
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

func runRelay(ctx context.Context, cfg RoleConfig, in io.Reader, out io.Writer) error {
	cidrs, err := transport.ParsePublicCIDRs(cfg.PublicCIDRs)
	if err != nil {
		return err
	}
	// Phase 1 admits every peer; the relay's registry supplies Admit later.
	opts, err := transport.RelayNATOptions(transport.RelayNATConfig{
		Admit:       func(peer.ID) bool { return true },
		PublicCIDRs: cidrs,
	})
	if err != nil {
		return err
	}
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{cfg.Listen}, Options: opts})
	if err != nil {
		return err
	}
	defer h.Close()
	if err := json.NewEncoder(out).Encode(hello(h, 0)); err != nil {
		return err
	}
	waitInput(ctx, in)
	return nil
}

func runPeer(ctx context.Context, cfg RoleConfig, in io.Reader, out io.Writer) error {
	start := time.Now()
	cidrs, err := transport.ParsePublicCIDRs(cfg.PublicCIDRs)
	if err != nil {
		return err
	}
	relayAddr, err := ma.NewMultiaddr(cfg.Relay)
	if err != nil {
		return err
	}
	relayInfo, err := peer.AddrInfoFromP2pAddr(relayAddr)
	if err != nil {
		return err
	}
	upgrades := make(chan time.Duration, 16)
	nat, err := transport.NewAgentNAT(transport.AgentNATConfig{
		Relays:       []peer.AddrInfo{*relayInfo},
		PublicCIDRs:  cidrs,
		PunchTimeout: cfg.PunchTimeout,
		OnUpgrade: func(_ peer.ID, after time.Duration) {
			select {
			case upgrades <- after:
			default:
			}
		},
		Logger: logger(),
	})
	if err != nil {
		return err
	}
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{cfg.Listen}, Options: nat.Options(), Logger: logger()})
	if err != nil {
		return err
	}
	defer h.Close()
	h.SetStreamHandler(EchoProtocol, func(s network.Stream) {
		_, _ = io.Copy(s, s)
		_ = s.Close()
	})
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := h.Connect(rctx, *relayInfo); err != nil {
		return fmt.Errorf("connect to relay: %w", err)
	}
	// This relay admits every peer without a join: ask for the
	// reservation now.
	nat.SetJoined(relayInfo.ID, true)
	if err := nat.WaitReady(rctx); err != nil {
		return err
	}
	enc := json.NewEncoder(out)
	if err := enc.Encode(hello(h, ms(time.Since(start)))); err != nil {
		return err
	}
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		var c Command
		var r Reply
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			r.Error = err.Error()
		} else {
			switch c.Cmd {
			case "connect":
				r = connect(ctx, h, nat, *relayInfo, c, upgrades)
			case "stats":
			default:
				r.Error = "unknown command " + c.Cmd
			}
		}
		r.Stats = nat.Stats()
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// connect reaches target through the relay, measures the relayed path, waits
// for a direct one, measures it, and checks which path a new stream takes.
func connect(ctx context.Context, h host.Host, nat *transport.AgentNAT, relayInfo peer.AddrInfo, c Command, upgrades <-chan time.Duration) Reply {
	var r Reply
	target, err := peer.Decode(c.Peer)
	if err != nil {
		r.Error = err.Error()
		return r
	}
	if c.Pings <= 0 {
		c.Pings = 5
	}
	sub, err := h.EventBus().Subscribe(new(event.EvtPeerConnectednessChanged))
	if err != nil {
		r.Error = err.Error()
		return r
	}
	defer sub.Close()

	punches0 := nat.Stats().HolePunches
	t0 := time.Now()
	cctx, cancel := context.WithTimeout(network.WithAllowLimitedConn(ctx, "netlab"), 20*time.Second)
	defer cancel()
	if err := h.Connect(cctx, peer.AddrInfo{ID: target, Addrs: transport.CircuitAddrs(relayInfo, target)}); err != nil {
		r.Error = "relayed connect: " + err.Error()
		return r
	}
	tRelayed := time.Now()
	r.RelayedMS = ms(tRelayed.Sub(t0))
	if relayed := findConn(h, target, true); relayed != nil {
		r.RTTRelayedMS = pingConn(cctx, relayed, c.Pings)
	}

	direct := findConn(h, target, false)
	deadline := time.NewTimer(c.WaitDirect)
	defer deadline.Stop()
	poll := time.NewTicker(20 * time.Millisecond)
	defer poll.Stop()
	for direct == nil {
		select {
		case <-poll.C:
			if c.GiveUpAfterPunches > 0 && nat.Stats().HolePunches-punches0 >= c.GiveUpAfterPunches {
				if direct = findConn(h, target, false); direct == nil {
					r.GaveUpMS = ms(time.Since(tRelayed))
					goto waited
				}
			}
		case ev := <-sub.Out():
			if e := ev.(event.EvtPeerConnectednessChanged); e.Peer == target && e.Connectedness == network.Connected {
				direct = findConn(h, target, false)
			}
		case <-deadline.C:
			direct = findConn(h, target, false)
			if direct == nil {
				goto waited
			}
		case <-ctx.Done():
			r.Error = ctx.Err().Error()
			return r
		}
	}
	r.DirectMS = ms(time.Since(tRelayed))
	r.RTTDirectMS = pingConn(cctx, direct, c.Pings)
	select {
	case after := <-upgrades:
		r.UpgradeMS = ms(after)
	default:
	}
waited:
	r.Path = transport.PathTo(h, target).String()
	r.StreamPath, r.StreamOK = echo(cctx, h, target)
	return r
}

// findConn returns a relayed (or a direct) connection to p, or nil.
func findConn(h host.Host, p peer.ID, relayed bool) network.Conn {
	for _, c := range h.Network().ConnsToPeer(p) {
		if transport.IsRelayedConn(c) == relayed {
			return c
		}
	}
	return nil
}

// pingConn runs n libp2p pings over exactly the connection c and returns the
// median round trip in milliseconds (0 on error).
func pingConn(ctx context.Context, c network.Conn, n int) float64 {
	s, err := c.NewStream(network.WithAllowLimitedConn(ctx, "netlab"))
	if err != nil {
		return 0
	}
	defer s.Reset()
	_ = s.SetDeadline(time.Now().Add(10 * time.Second))
	if err := msmux.SelectProtoOrFail(ping.ID, s); err != nil {
		return 0
	}
	_ = s.SetProtocol(ping.ID)
	buf, got := make([]byte, ping.PingSize), make([]byte, ping.PingSize)
	rtts := make([]time.Duration, 0, n)
	for i := 0; i < n; i++ {
		if _, err := rand.Read(buf); err != nil {
			return 0
		}
		t := time.Now()
		if _, err := s.Write(buf); err != nil {
			return 0
		}
		if _, err := io.ReadFull(s, got); err != nil || !slices.Equal(buf, got) {
			return 0
		}
		rtts = append(rtts, time.Since(t))
	}
	sort.Slice(rtts, func(i, j int) bool { return rtts[i] < rtts[j] })
	return ms(rtts[len(rtts)/2])
}

// echo opens a stream the way gossip does (limited connections allowed) and
// reports which path it took and whether bytes came back.
func echo(ctx context.Context, h host.Host, p peer.ID) (string, bool) {
	s, err := h.NewStream(network.WithAllowLimitedConn(ctx, "netlab"), p, EchoProtocol)
	if err != nil {
		return "", false
	}
	defer s.Reset()
	path := transport.PathDirect
	if transport.IsRelayedConn(s.Conn()) {
		path = transport.PathRelayed
	}
	_ = s.SetDeadline(time.Now().Add(10 * time.Second))
	msg := []byte("computeflux netlab echo")
	if _, err := s.Write(msg); err != nil {
		return path.String(), false
	}
	if err := s.CloseWrite(); err != nil {
		return path.String(), false
	}
	got, err := io.ReadAll(s)
	return path.String(), err == nil && string(got) == string(msg)
}
