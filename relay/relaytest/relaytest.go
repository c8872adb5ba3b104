// Package relaytest runs a whole ComputeFlux cluster in one process for
// tests, benchmarks and demos: simulated engines, one agent per engine and
// one or more relays, all real: the agents are package agent's, joined to
// every relay over QUIC on 127.0.0.1 with gossip, the engines and the
// relays serve real HTTP on loopback ports. Faults are injected the way
// they happen: an agent is killed by dropping every packet of its host (no
// goodbye reaches anyone), the relay restarts on the same identity and
// ports, an engine slows down, an engine and its agent join mid-run. Tests
// that put a fleet together themselves take its parts (parts.go):
// ServeRelay, AgentConfig, RunAgent and RunKillableAgent (whose Kill is
// the same silent death), FakeEngine, Front (a front of an engine) and RunSimEngine.
package relaytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/p2p/transport/quicreuse"
	"github.com/multiformats/go-multiaddr"
	"github.com/quic-go/quic-go"
	"github.com/rs/zerolog"

	agentpkg "github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest/poll"
	"github.com/computeflux/computeflux/scheduler"
)

// Defaults for the zero values of Config.
const (
	DefaultEngines     = 3
	DefaultJoinTimeout = 20 * time.Second // QUIC handshake and join on a loaded machine
)

// Config configures a Cluster. The zero value of every field means the
// default in its comment.
type Config struct {
	// Relays is the number of relays. Default 1. With more, every agent
	// joins each of them, and they share sessions and spending (they find
	// each other through the agents); RestartRelay restarts the first.
	Relays int
	// Engines is the number of engines (each with its agent) at start.
	// Default 3; 0 is not possible, use AddEngine for more later.
	Engines int
	// Engine is the template of every engine's configuration; Listen is
	// always a free loopback port. Zero fields mean simengine's defaults.
	Engine simengine.Config
	// Policy is the relay's routing policy. Default sticky.
	Policy scheduler.Policy
	// Scheduler tunes the relay's scheduler (Policy above wins).
	Scheduler scheduler.Config
	// MaxAttempts is the relay's tries per request. Zero means the relay's
	// default.
	MaxAttempts int
	// Capacity is the concurrency each agent announces (0: unlimited).
	Capacity int
	// APIKey is the client key the relay accepts. Empty means a random
	// "sk-cf-..." key (see Cluster.APIKey).
	APIKey string
	// Token is the agents' join secret. Empty means a random one.
	Token []byte
	// AdminKey, when set, serves the relay's admin API and status page on
	// a free loopback port (Cluster.Relay().AdminAddr()). Empty means none.
	AdminKey string
	// Dir holds the relay's and agents' identity files. Empty means a
	// temporary directory removed by Close.
	Dir string
	// JoinTimeout bounds the wait for an agent to join. Default 20 s.
	JoinTimeout time.Duration
	// Logger receives the relay's, agents' and engines' logs. The zero
	// value discards them.
	Logger zerolog.Logger
}

// Eventually polls cond until it holds, and fails t after poll.Timeout:
// the one way the tests wait for what other goroutines or processes do.
var Eventually = poll.Eventually

// Within is Eventually with a limit of the caller's; it returns how long
// cond took to hold.
var Within = poll.Within

func (c *Config) populate() {
	if c.Engines == 0 {
		c.Engines = DefaultEngines
	}
	c.Relays = max(c.Relays, 1)
	if c.JoinTimeout == 0 {
		c.JoinTimeout = DefaultJoinTimeout
	}
	if c.APIKey == "" {
		c.APIKey = "sk-cf-" + randomHex(16)
	}
	if len(c.Token) == 0 {
		c.Token = []byte(randomHex(32))
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Cluster is a running in-process cluster. Its methods are safe for
// concurrent use.
type Cluster struct {
	cfg    Config
	dir    string
	ownDir bool
	log    zerolog.Logger

	mu      sync.Mutex // guards the following fields
	relays  []*relayNode
	engines []*Engine
	closed  bool
}

// relayNode is one relay of a Cluster, its addresses kept across restarts.
type relayNode struct {
	relay    *relay.Relay
	id       peer.ID
	httpAddr string // the HTTP listen address
	p2pAddr  string // the QUIC listen multiaddr
	stop     context.CancelFunc
	done     chan error
}

// Engine is one simulated engine and its agent.
type Engine struct {
	// Name is the agent's name (the relay's endpoint ID): "agent-<i>".
	Name string
	// Server is the engine.
	Server *simengine.Server

	c       *Cluster
	stopEng context.CancelFunc
	engDone chan error
	idFile  string

	mu     sync.Mutex    // guards agent and killed
	agent  *Agent        // killable
	killed chan struct{} // a killed agent's done, until a restart waited for it
}

// Start starts engines, agents and a relay, and returns once every agent
// has joined.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	cfg.populate()
	if cfg.Engines < 1 {
		return nil, fmt.Errorf("relaytest: %d engines: need at least one", cfg.Engines)
	}
	c := &Cluster{cfg: cfg, dir: cfg.Dir, log: cfg.Logger.With().Str("component", "relaytest").Logger()}
	if c.dir == "" {
		d, err := os.MkdirTemp("", "computeflux-relaytest-")
		if err != nil {
			return nil, fmt.Errorf("relaytest: %w", err)
		}
		c.dir, c.ownDir = d, true
	}
	for i := range cfg.Relays {
		c.relays = append(c.relays, &relayNode{httpAddr: "127.0.0.1:0", p2pAddr: "/ip4/127.0.0.1/udp/0/quic-v1"})
		if err := c.startRelay(i); err != nil {
			c.Close()
			return nil, err
		}
	}
	for range cfg.Engines {
		if _, err := c.AddEngine(ctx); err != nil {
			c.Close()
			return nil, err
		}
	}
	if err := c.waitPeered(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// waitPeered waits until every relay shares sessions with every other.
func (c *Cluster) waitPeered(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.JoinTimeout)
	defer cancel()
	rs := c.Relays()
	err := poll.Until(ctx, func() bool {
		for _, r := range rs {
			if len(r.PeerRelays()) < len(rs)-1 {
				return false
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("relaytest: %d relays did not all peer: %w", len(rs), err)
	}
	return nil
}

// URL returns the (first) relay's base URL, e.g. "http://127.0.0.1:41234".
func (c *Cluster) URL() string { return c.URLs()[0] }

// URLs returns every relay's base URL, the first relay's first.
func (c *Cluster) URLs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	urls := make([]string, len(c.relays))
	for i, n := range c.relays {
		urls[i] = "http://" + n.httpAddr
	}
	return urls
}

// APIKey returns the client key the relay accepts.
func (c *Cluster) APIKey() string { return c.cfg.APIKey }

// Relay returns the current (first) relay: a new one after RestartRelay.
func (c *Cluster) Relay() *relay.Relay { return c.Relays()[0] }

// Relays returns every relay, the first first.
func (c *Cluster) Relays() []*relay.Relay {
	c.mu.Lock()
	defer c.mu.Unlock()
	rs := make([]*relay.Relay, len(c.relays))
	for i, n := range c.relays {
		rs[i] = n.relay
	}
	return rs
}

// Engines returns the engines in the order they were added.
func (c *Cluster) Engines() []*Engine {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*Engine(nil), c.engines...)
}

// Engine returns engine i.
func (c *Cluster) Engine(i int) *Engine {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.engines[i]
}

// startRelay starts relay i on its identity and addresses; with port 0 it
// records the ports it got, so a restart reuses them.
func (c *Cluster) startRelay(i int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.relays[i]
	idFile := "relay.key"
	if i > 0 {
		idFile = fmt.Sprintf("relay-%d.key", i)
	}
	r, err := relay.New(relay.Config{
		P2PListen:    []string{n.p2pAddr},
		IdentityFile: filepath.Join(c.dir, idFile),
		Token:        c.cfg.Token,
		APIKeys:      []string{c.cfg.APIKey},
		Policy:       c.cfg.Policy,
		Scheduler:    c.cfg.Scheduler,
		MaxAttempts:  c.cfg.MaxAttempts,
		AdminKey:     c.cfg.AdminKey,
		AdminListen:  "127.0.0.1:0",
		// Benchmarks and tests stop the relay with requests in flight only
		// on purpose; waiting for them gains nothing.
		ShutdownTimeout: time.Second,
		Logger:          c.cfg.Logger,
	})
	if err != nil {
		return fmt.Errorf("relaytest: relay: %w", err)
	}
	var ln net.Listener
	for deadline := time.Now().Add(5 * time.Second); ; {
		ln, err = net.Listen("tcp", n.httpAddr)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond) // the old listener's port is being released
	}
	if err != nil {
		_ = r.Close()
		return fmt.Errorf("relaytest: relay listen: %w", err)
	}
	n.httpAddr = ln.Addr().String()
	h := r.Host()
	for _, a := range h.Addrs() {
		if _, err := a.ValueForProtocol(multiaddr.P_QUIC_V1); err == nil {
			n.p2pAddr = a.String()
			break
		}
	}
	n.relay, n.id = r, h.ID()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx, ln) }()
	n.stop, n.done = cancel, done
	return nil
}

// stopRelay stops relay i (Serve closes it and its host).
func (c *Cluster) stopRelay(i int) {
	c.mu.Lock()
	n := c.relays[i]
	cancel, done := n.stop, n.done
	n.stop, n.done = nil, nil
	c.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// RestartRelay stops the (first) relay and starts a new one with the same
// identity and the same HTTP and QUIC ports, then waits until every live
// agent has joined it again. Sessions' affinity starts afresh, as after a
// real restart.
func (c *Cluster) RestartRelay(ctx context.Context) error {
	c.stopRelay(0)
	if err := c.startRelay(0); err != nil {
		return err
	}
	for _, e := range c.Engines() {
		e.mu.Lock()
		a := e.agent
		e.mu.Unlock()
		if a == nil {
			continue
		}
		if err := c.waitJoined(ctx, e.Name, a.ID()); err != nil {
			return err
		}
	}
	return nil
}

// AddEngine starts one more engine and its agent, waits for it to join and
// returns its index.
func (c *Cluster) AddEngine(ctx context.Context) (int, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, net.ErrClosed
	}
	i := len(c.engines)
	c.mu.Unlock()

	ec := c.cfg.Engine
	ec.Listen = "127.0.0.1:0"
	ec.Logger = c.cfg.Logger
	srv, err := simengine.New(ec)
	if err != nil {
		return 0, fmt.Errorf("relaytest: engine: %w", err)
	}
	if _, err := srv.Listen(); err != nil {
		return 0, fmt.Errorf("relaytest: engine: %w", err)
	}
	ectx, cancel := context.WithCancel(context.Background())
	e := &Engine{
		Name: fmt.Sprintf("agent-%d", i), Server: srv, c: c, stopEng: cancel, engDone: make(chan error, 1),
		idFile: filepath.Join(c.dir, fmt.Sprintf("agent-%d.key", i)),
	}
	go func() { e.engDone <- srv.Run(ectx) }()
	c.mu.Lock()
	c.engines = append(c.engines, e)
	c.mu.Unlock()
	if err := e.startAgent(ctx); err != nil {
		return i, err
	}
	return i, nil
}

// KillAgent silences engine i's agent without a goodbye, as when its
// machine loses power or its network: every packet of its host is dropped
// from now on, both ways, then the agent is stopped behind that black hole
// (its leave and its connection close never reach anyone). The engine keeps
// running with its cache. It is a no-op when the agent is not running.
func (c *Cluster) KillAgent(i int) error {
	e := c.Engine(i)
	e.mu.Lock()
	a := e.agent
	e.agent = nil
	if a != nil {
		e.killed = a.done
	}
	e.mu.Unlock()
	if a == nil {
		return nil
	}
	a.Kill()
	return nil
}

// Agent returns engine i's running agent, or nil when it is not running.
func (c *Cluster) Agent(i int) *agentpkg.Agent {
	e := c.Engine(i)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.agent == nil {
		return nil
	}
	return e.agent.Agent
}

// RestartAgent starts engine i's agent again, on the same identity, and
// waits until it has joined.
func (c *Cluster) RestartAgent(ctx context.Context, i int) error {
	return c.Engine(i).startAgent(ctx)
}

// SlowEngine makes engine i factor times slower (1 is normal speed).
func (c *Cluster) SlowEngine(i int, factor float64) error {
	return c.Engine(i).Server.SetSlowdown(factor)
}

// Close stops the agents, the relay and the engines, and removes the
// temporary directory. It is safe to call more than once.
func (c *Cluster) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	engines := c.engines
	c.mu.Unlock()
	var errs []error
	for i := range engines {
		e := engines[i]
		e.mu.Lock()
		a, killed := e.agent, e.killed
		e.agent, e.killed = nil, nil
		e.mu.Unlock()
		if a != nil {
			a.Stop() // the agent drains, leaves the relay and closes its host
		}
		if killed != nil {
			<-killed
		}
	}
	for i := range c.relays {
		c.stopRelay(i)
	}
	for _, e := range engines {
		e.stopEng()
		if err := <-e.engDone; err != nil {
			errs = append(errs, err)
		}
	}
	if c.ownDir {
		errs = append(errs, os.RemoveAll(c.dir))
	}
	return errors.Join(errs...)
}

// relayAddrs returns the relays' QUIC multiaddrs with their peer IDs.
func (c *Cluster) relayAddrs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	addrs := make([]string, len(c.relays))
	for i, n := range c.relays {
		addrs[i] = n.p2pAddr + "/p2p/" + n.id.String()
	}
	return addrs
}

// waitJoined polls every relay's registry until name is held by p there.
func (c *Cluster) waitJoined(ctx context.Context, name string, p peer.ID) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.JoinTimeout)
	defer cancel()
	err := poll.Until(ctx, func() bool {
		for _, r := range c.Relays() {
			if got, ok := r.Registry().Peer(name); !ok || got != p {
				return false
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("relaytest: %s did not join: %w", name, err)
	}
	return nil
}

// startAgent starts e's agent (if not running) and waits until it joined.
func (e *Engine) startAgent(ctx context.Context) error {
	e.mu.Lock()
	if e.agent != nil {
		e.mu.Unlock()
		return nil
	}
	if prev := e.killed; prev != nil {
		// A killed agent's Run is still ending behind its black hole;
		// the new one takes the same identity.
		e.mu.Unlock()
		<-prev
		e.mu.Lock()
		e.killed = nil
	}
	a, err := launch(agentpkg.Config{
		Relays:         e.c.relayAddrs(),
		Token:          string(e.c.cfg.Token),
		Upstream:       e.Server.URL(),
		Name:           e.Name,
		MaxConcurrency: e.c.cfg.Capacity,
		IdentityFile:   e.idFile,
		ListenAddrs:    []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Logger:         e.c.cfg.Logger,
		MinBackoff:     50 * time.Millisecond,
		MaxBackoff:     time.Second,
		DrainTimeout:   2 * time.Second,
	}, true, func(err error) {
		if err != nil {
			e.c.log.Warn().Str("agent", e.Name).Err(err).Msg("agent stopped")
		}
	})
	if err != nil {
		e.mu.Unlock()
		return fmt.Errorf("relaytest: agent: %w", err)
	}
	e.agent = a
	e.mu.Unlock()
	return e.c.waitJoined(ctx, e.Name, a.ID())
}

// packetFilter hands the agent's host its UDP sockets and can drop every
// packet they carry, both ways, as a dead machine or a cut cable does.
type packetFilter struct {
	dropped atomic.Bool
	cm      *quicreuse.ConnManager // set by connManager while the host is built
}

// connManager builds the QUIC socket manager of the agent's host as libp2p's
// default does (resource manager admission, source address checks), with
// its sockets from listen.
func (f *packetFilter) connManager(key quic.StatelessResetKey, tok quic.TokenGeneratorKey, rcmgr network.ResourceManager) (*quicreuse.ConnManager, error) {
	cm, err := quicreuse.NewConnManager(key, tok,
		quicreuse.OverrideListenUDP(f.listen),
		quicreuse.ConnContext(func(ctx context.Context, ci *quic.ClientInfo) (context.Context, error) {
			addr, err := quicreuse.ToQuicMultiaddr(ci.RemoteAddr, quic.Version1)
			if err != nil {
				addr = nil
			}
			scope, err := rcmgr.OpenConnection(network.DirInbound, false, addr)
			if err != nil {
				return ctx, err
			}
			ctx = network.WithConnManagementScope(ctx, scope)
			context.AfterFunc(ctx, scope.Done)
			return ctx, nil
		}),
		quicreuse.VerifySourceAddress(rcmgr.VerifySourceAddress),
	)
	f.cm = cm
	return cm, err
}

// close closes the socket manager once the host is closed.
func (f *packetFilter) close() {
	if f.cm != nil {
		_ = f.cm.Close()
	}
}

func (f *packetFilter) listen(network string, laddr *net.UDPAddr) (net.PacketConn, error) {
	c, err := net.ListenUDP(network, laddr)
	if err != nil {
		return nil, err
	}
	return &filteredConn{PacketConn: c, f: f}, nil
}

// filteredConn is a UDP socket whose packets vanish once its filter drops.
// It hides *net.UDPConn's batch and ECN interfaces (its SyscallConn), so
// quic-go reads and writes packet by packet through it.
type filteredConn struct {
	net.PacketConn
	f *packetFilter
}

// ReadFrom returns the next packet that is not dropped.
func (c *filteredConn) ReadFrom(b []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(b)
		if err != nil || !c.f.dropped.Load() {
			return n, addr, err
		}
	}
}

// SetReadBuffer sizes the socket's receive buffer.
func (c *filteredConn) SetReadBuffer(n int) error {
	return c.PacketConn.(*net.UDPConn).SetReadBuffer(n)
}

// SetWriteBuffer sizes the socket's send buffer.
func (c *filteredConn) SetWriteBuffer(n int) error {
	return c.PacketConn.(*net.UDPConn).SetWriteBuffer(n)
}

// WriteTo sends b unless the filter drops it (then it pretends to).
func (c *filteredConn) WriteTo(b []byte, addr net.Addr) (int, error) {
	if c.f.dropped.Load() {
		return len(b), nil
	}
	return c.PacketConn.WriteTo(b, addr)
}
