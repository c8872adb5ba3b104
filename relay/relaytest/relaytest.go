// Package relaytest runs a whole ComputeFlux cluster in one process for
// tests, benchmarks and demos: simulated engines, one agent per engine and
// a relay, all real: the agents are libp2p hosts that join the relay over
// QUIC on 127.0.0.1 and serve inference streams, the engines and the relay
// serve real HTTP on loopback ports. Faults are injected the way they
// happen: an agent is killed by closing its host without leaving, the
// relay restarts on the same identity and ports, an engine slows down, an
// engine and its agent join mid-run.
package relaytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Defaults for the zero values of Config.
const (
	DefaultEngines     = 3
	DefaultJoinTimeout = 20 * time.Second // QUIC handshake and join on a loaded machine
)

// Config configures a Cluster. The zero value of every field means the
// default in its comment.
type Config struct {
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
	// Dir holds the relay's and agents' identity files. Empty means a
	// temporary directory removed by Close.
	Dir string
	// JoinTimeout bounds the wait for an agent to join. Default 20 s.
	JoinTimeout time.Duration
	// Logger receives the relay's, agents' and engines' logs. The zero
	// value discards them.
	Logger zerolog.Logger
}

func (c *Config) populate() {
	if c.Engines == 0 {
		c.Engines = DefaultEngines
	}
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

	mu       sync.Mutex // guards the following fields
	relay    *relay.Relay
	relayID  peer.ID
	relayMA  []multiaddr.Multiaddr
	httpAddr string // the relay's HTTP listen address (kept across restarts)
	p2pAddr  string // its QUIC listen multiaddr (kept across restarts)
	stopRel  context.CancelFunc
	relDone  chan error
	engines  []*Engine
	closed   bool
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

	mu    sync.Mutex // guards agent
	agent *agent
}

// agent is the node side for one engine: a libp2p host that serves
// inference streams from the relay only, proxied to the engine, and keeps
// itself joined to the relay (rejoining after a relay restart).
type agent struct {
	h      host.Host
	srv    io.Closer
	cancel context.CancelFunc
	done   chan struct{}
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
	c.httpAddr = "127.0.0.1:0"
	c.p2pAddr = "/ip4/127.0.0.1/udp/0/quic-v1"
	if err := c.startRelay(); err != nil {
		c.Close()
		return nil, err
	}
	for range cfg.Engines {
		if _, err := c.AddEngine(ctx); err != nil {
			c.Close()
			return nil, err
		}
	}
	return c, nil
}

// URL returns the relay's base URL, e.g. "http://127.0.0.1:41234".
func (c *Cluster) URL() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return "http://" + c.httpAddr
}

// APIKey returns the client key the relay accepts.
func (c *Cluster) APIKey() string { return c.cfg.APIKey }

// Relay returns the current relay (a new one after RestartRelay).
func (c *Cluster) Relay() *relay.Relay {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.relay
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

// startRelay starts a relay on c's identity and addresses; with port 0 it
// records the ports it got, so a restart reuses them.
func (c *Cluster) startRelay() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := relay.New(relay.Config{
		P2PListen:    []string{c.p2pAddr},
		IdentityFile: filepath.Join(c.dir, "relay.key"),
		Token:        c.cfg.Token,
		APIKeys:      []string{c.cfg.APIKey},
		Policy:       c.cfg.Policy,
		Scheduler:    c.cfg.Scheduler,
		MaxAttempts:  c.cfg.MaxAttempts,
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
		ln, err = net.Listen("tcp", c.httpAddr)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond) // the old listener's port is being released
	}
	if err != nil {
		_ = r.Close()
		return fmt.Errorf("relaytest: relay listen: %w", err)
	}
	c.httpAddr = ln.Addr().String()
	h := r.Host()
	for _, a := range h.Addrs() {
		if _, err := a.ValueForProtocol(multiaddr.P_QUIC_V1); err == nil {
			c.p2pAddr = a.String()
			break
		}
	}
	c.relay, c.relayID, c.relayMA = r, h.ID(), h.Addrs()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx, ln) }()
	c.stopRel, c.relDone = cancel, done
	return nil
}

// stopRelayLocked stops the relay (Serve closes it and its host).
func (c *Cluster) stopRelay() {
	c.mu.Lock()
	cancel, done := c.stopRel, c.relDone
	c.stopRel, c.relDone = nil, nil
	c.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// RestartRelay stops the relay and starts a new one with the same identity
// and the same HTTP and QUIC ports, then waits until every live agent has
// joined it again. Sessions' affinity starts afresh, as after a real
// restart.
func (c *Cluster) RestartRelay(ctx context.Context) error {
	c.stopRelay()
	if err := c.startRelay(); err != nil {
		return err
	}
	for _, e := range c.Engines() {
		e.mu.Lock()
		a := e.agent
		e.mu.Unlock()
		if a == nil {
			continue
		}
		if err := c.waitJoined(ctx, e.Name, a.h.ID()); err != nil {
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

// KillAgent closes engine i's agent host without leaving the relay first,
// as when the agent's machine loses power; the engine keeps running with
// its cache. It is a no-op when the agent is not running.
func (c *Cluster) KillAgent(i int) error {
	e := c.Engine(i)
	e.mu.Lock()
	a := e.agent
	e.agent = nil
	e.mu.Unlock()
	if a == nil {
		return nil
	}
	// Close first, so the supervisor cannot leave politely.
	err := errors.Join(a.srv.Close(), a.h.Close())
	a.cancel()
	<-a.done
	return err
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
		a := e.agent
		e.agent = nil
		e.mu.Unlock()
		if a != nil {
			a.cancel()
			<-a.done // the supervisor leaves the relay and closes the host
		}
	}
	c.stopRelay()
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

// relayInfo returns the relay's peer ID and addresses.
func (c *Cluster) relayInfo() peer.AddrInfo {
	c.mu.Lock()
	defer c.mu.Unlock()
	return peer.AddrInfo{ID: c.relayID, Addrs: c.relayMA}
}

// waitJoined polls the relay's registry until name is held by p.
func (c *Cluster) waitJoined(ctx context.Context, name string, p peer.ID) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.JoinTimeout)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if got, ok := c.Relay().Registry().Peer(name); ok && got == p {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("relaytest: %s did not join: %w", name, ctx.Err())
		case <-tick.C:
		}
	}
}

// startAgent starts e's agent (if not running) and waits until it joined.
func (e *Engine) startAgent(ctx context.Context) error {
	e.mu.Lock()
	if e.agent != nil {
		e.mu.Unlock()
		return nil
	}
	h, err := transport.NewHost(transport.HostConfig{
		ListenAddrs:  []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		IdentityFile: e.idFile,
	})
	if err != nil {
		e.mu.Unlock()
		return fmt.Errorf("relaytest: agent host: %w", err)
	}
	u, err := url.Parse(e.Server.URL())
	if err != nil {
		e.mu.Unlock()
		_ = h.Close()
		return fmt.Errorf("relaytest: engine url: %w", err)
	}
	proxy := httputil.NewSingleHostReverseProxy(u)
	proxy.FlushInterval = -1 // stream every chunk as it comes
	proxy.ErrorLog = nil
	proxy.Transport = &http.Transport{MaxIdleConnsPerHost: 256, IdleConnTimeout: 30 * time.Second}
	relayID := e.c.relayInfo().ID
	srv, err := transport.ServeHTTP(h, proxy, func(p peer.ID) bool { return p == relayID })
	if err != nil {
		e.mu.Unlock()
		_ = h.Close()
		return fmt.Errorf("relaytest: agent serve: %w", err)
	}
	actx, cancel := context.WithCancel(context.Background())
	a := &agent{h: h, srv: srv, cancel: cancel, done: make(chan struct{})}
	e.agent = a
	e.mu.Unlock()
	go e.supervise(actx, a, proxy.Transport.(*http.Transport))
	return e.c.waitJoined(ctx, e.Name, h.ID())
}

// supervise keeps a joined to the relay until ctx ends: it joins, waits for
// the registration to end (relay restart or lost connection), and joins
// again after a short pause. On ctx's end it leaves and closes the host
// unless KillAgent already closed it.
func (e *Engine) supervise(ctx context.Context, a *agent, tr *http.Transport) {
	defer close(a.done)
	defer tr.CloseIdleConnections()
	info := transport.JoinInfo{Name: e.Name, Models: e.Server.Config().Models, Capacity: e.c.cfg.Capacity}
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		ri := e.c.relayInfo()
		jctx, cancel := context.WithTimeout(ctx, e.c.cfg.JoinTimeout)
		err := a.h.Connect(jctx, ri)
		var m *transport.Membership
		if err == nil {
			m, err = transport.Join(jctx, a.h, ri.ID, e.c.cfg.Token, info)
		}
		cancel()
		if err == nil {
			backoff = 50 * time.Millisecond
			select {
			case <-m.Done():
				continue
			case <-ctx.Done():
				_ = m.Close()
			}
			break
		}
		e.c.log.Debug().Str("agent", e.Name).Err(err).Msg("join failed; retrying")
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
			backoff = min(2*backoff, time.Second)
		}
	}
	// Closing twice is harmless: KillAgent may already have closed both.
	_ = a.srv.Close()
	_ = a.h.Close()
}
