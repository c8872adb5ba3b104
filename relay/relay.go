package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/auditor"
	"github.com/computeflux/computeflux/relay/liveness"
	"github.com/computeflux/computeflux/relay/peering"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Relay serves the OpenAI HTTP API and routes each request to a joined agent.
// Build it with New, serve it with Run (or mount Handler), stop it with
// Close. Its methods are safe for concurrent use.
type Relay struct {
	cfg     Config
	log     zerolog.Logger
	reqLog  zerolog.Logger // the per-request lines (Config.RequestLogger)
	sched   *scheduler.Scheduler
	reg     *Registry
	clients *clientTable
	limits  *keyLimits // nil without per-key limits
	queue   *fairQueue // requests waiting for room (queue.go); nil when off
	rt      http.RoundTripper
	metrics *metrics
	handler http.Handler
	// responses maps Responses API ids to the agent holding them
	// (responses.go), with the scheduler's session TTL and bound.
	responses *responseStore

	ops       *operator    // the operator's settings (operator.go)
	providers *providerSet // provider endpoints (providers.go)
	stats     *statsWindow // recent requests, for the status page (admin.go)
	adminAddr atomic.Value // string: the admin listener's address

	host    host.Host     // nil with NoP2P
	ownHost bool          // New created host, so Close closes it
	join    io.Closer     // the join service on host
	index   *indexService // prefix index streams on host; nil with NoP2P

	gossip *relayGossip      // nil when gossip is off or without a host
	live   *liveness.Checker // request-path liveness; nil without our own libp2p round tripper
	peers  *peering.Manager  // nil when sharing with peer relays is off or without a host (peers.go)
	// circuits counts the circuit relay service's work (own host only).
	circuits transport.RelayCounters
	// draining is set once the relay starts stopping; gossip publishes it.
	draining atomic.Bool
	// bgCtx ends when Close starts; bgWG waits for the goroutines it bounds.
	bgCtx    context.Context
	bgCancel context.CancelFunc
	bgWG     sync.WaitGroup

	closeOnce sync.Once
	closeErr  error

	watchdogs watchdogPool // attempts' timers, reused (watchdog.go)

	// audits checks what agents run (audits.go); nil when disabled.
	audits    *auditor.Auditor
	auditRefs auditRefs  // the operator's references
	pseudo    pseudonyms // what agents get for identity fields (forward.go)
}

// New builds a relay from cfg and starts it: the scheduler, the registry
// of agents and, unless cfg.NoP2P, the libp2p host (when cfg.Host is nil)
// with the join service listening on it. Close stops it.
func New(cfg Config) (*Relay, error) {
	r, err := build(cfg)
	if err != nil {
		return nil, err
	}
	if err := r.start(); err != nil {
		_ = r.Close()
		return nil, err
	}
	return r, nil
}

// build makes every part of a relay and wires them together; nothing runs
// yet and no protocol is served, except that a host of the relay's own
// listens. On an error what it made is closed.
func build(cfg Config) (*Relay, error) {
	cfg = populate(cfg)
	if err := validate(cfg); err != nil {
		return nil, err
	}
	sched, err := scheduler.New(cfg.Scheduler)
	if err != nil {
		return nil, fmt.Errorf("relay: scheduler: %w", err)
	}
	r := &Relay{
		cfg:     cfg,
		log:     cfg.Logger.With().Str("component", "relay").Logger(),
		sched:   sched,
		clients: newClientTable(cfg.APIKeys, cfg.Clients),
		limits:  newKeyLimits(cfg.KeyRPM, cfg.KeyConcurrency, cfg.Clock),
		rt:      cfg.Transport,
	}
	r.reqLog = r.log
	if cfg.RequestLogger != nil {
		r.reqLog = cfg.RequestLogger.With().Str("component", "relay").Logger()
	}
	r.reg = newRegistry(sched, r.log)
	r.responses = newResponseStore(sched.Config().SessionTTL, sched.Config().MaxSessions)
	r.ops = newOperator(cfg.MaxAgentWeight)
	r.reg.ops = r.ops
	r.providers = newProviderSet(r)
	r.stats = newStatsWindow()
	r.metrics = newMetrics(r)
	r.handler = http.HandlerFunc(r.serveHTTP)
	r.bgCtx, r.bgCancel = context.WithCancel(context.Background())
	if cfg.QueueWait > 0 {
		if r.queue, err = newFairQueue(r); err != nil {
			return nil, fmt.Errorf("relay: %w", err)
		}
		r.reg.prefillLimit = PrefillBlocks(cfg.PrefillLimit, cfg.Prefix)
	}
	var secret []byte
	if cfg.IdentityFile != "" {
		secret, _ = os.ReadFile(cfg.IdentityFile)
	}
	r.pseudo = newPseudonyms(pseudonymSecret(secret))
	if !cfg.Audit.Disabled {
		r.audits = newAuditor(r) // after pseudo: it takes r.pseudo.of
	}
	if cfg.NoP2P {
		return r, nil
	}
	r.host = cfg.Host
	if r.host == nil {
		// The relay's host also runs the circuit relay service for
		// admitted peers (agents reach each other through it until hole
		// punching gives them a direct path).
		natOpts, err := transport.RelayNATOptions(transport.RelayNATConfig{
			Admit:       r.reg.Admitted,
			PublicCIDRs: cfg.PublicCIDRs,
			Limits:      cfg.RelayLimits,
			Counters:    &r.circuits,
		})
		if err != nil {
			return nil, fmt.Errorf("relay: %w", err)
		}
		limits := cfg.RelayLimits
		h, err := transport.NewHost(transport.HostConfig{
			ListenAddrs:  cfg.P2PListen,
			IdentityFile: cfg.IdentityFile,
			Logger:       cfg.Logger,
			Options:      natOpts,
			RelayLimits:  &limits,
		})
		if err != nil {
			return nil, fmt.Errorf("relay: libp2p host: %w", err)
		}
		r.host, r.ownHost = h, true
	}
	if !cfg.Peers.Disabled {
		r.peers = newPeers(r)
		r.reg.onRelays = r.peers.Hint // agents' relay lists feed it
	}
	r.reg.onJoined = r.claimAgent // agentusage.go
	r.index = newIndexService(r)
	r.reg.index = r.index
	r.reg.forget = func(p peer.ID, name string) {
		if name != "" {
			r.forgetAgent(name)
		}
		if p != "" {
			r.forgetPeer(p)
		}
	}
	if r.rt == nil {
		r.rt = transport.NewRoundTripper(r.host)
		if !cfg.noLiveness {
			r.live = liveness.New(liveness.Config{Host: r.host, Registry: r.reg, Log: r.log, Ctx: r.bgCtx, WG: &r.bgWG})
		}
	}
	return r, nil
}

// start starts what build made, in order: the services on the host (join,
// agents' usage, prefix index), the background work (housekeeping,
// admission, gossip, peer relays, liveness probes, audits), the operator's
// endpoints file and the fair queue. Close stops them in reverse.
func (r *Relay) start() error {
	cfg := r.cfg
	if r.host != nil {
		join, err := transport.ServeJoin(r.host, cfg.Token, r.reg)
		if err != nil {
			return fmt.Errorf("relay: join service: %w", err)
		}
		r.join = join
		if err := transport.ServeAgentUsage(join.(*transport.JoinServer), r.agentUsage); err != nil { // agentusage.go
			return fmt.Errorf("relay: agent usage service: %w", err)
		}
		r.index.listen()
		r.bgWG.Go(r.housekeep)
		if r.ownHost {
			// Only on our own host: an embedder's host may carry peers
			// that have nothing to do with joining.
			peerRelays := make(map[peer.ID]bool)
			for _, ai := range cfg.Gossip.Relays {
				peerRelays[ai.ID] = true
			}
			r.startP2PAdmission(peerRelays)
		}
		if !cfg.Gossip.Disabled {
			if err := r.startGossip(); err != nil {
				return err
			}
			r.metrics.reg.MustRegister(gossipCollector{r})
		}
		if r.peers != nil {
			r.peers.Start()
			r.metrics.reg.MustRegister(r.peers.Collector())
		}
		if r.live != nil {
			r.bgWG.Go(r.live.Run)
		}
		r.log.Info().Stringer("peer", r.host.ID()).Strs("addrs", r.addrStrings()).Msg("relay p2p listening")
		if r.audits != nil {
			// Only agents are audited, and only a relay with a host has them.
			r.audits.Start()
		}
	}
	if cfg.NoAuth {
		r.log.Warn().Msg("serving clients without API keys (NoAuth)")
	}
	if cfg.EndpointsFile != "" {
		// Refused at start when malformed; a failed discovery is not.
		if err := r.ReloadEndpoints(context.Background()); err != nil {
			return fmt.Errorf("relay: %w", err)
		}
	}
	if r.queue != nil {
		r.bgWG.Go(func() { r.queue.run(r.bgCtx) })
	}
	return nil
}

// Handler returns the relay's HTTP handler: the OpenAI API, /healthz and
// /metrics.
func (r *Relay) Handler() http.Handler { return r.handler }

// CircuitStats returns what the relay's circuit relay service granted,
// refused and carried since it started (zero with NoP2P or an embedder's
// host).
func (r *Relay) CircuitStats() transport.RelayCircuitStats { return r.circuits.Stats() }

// Registry returns the table of joined agents (for failure detection and
// tests).
func (r *Relay) Registry() *Registry { return r.reg }

// Scheduler returns the relay's scheduler.
func (r *Relay) Scheduler() *scheduler.Scheduler { return r.sched }

// Host returns the libp2p host, or nil with NoP2P.
func (r *Relay) Host() host.Host { return r.host }

// Addrs returns the relay's dialable multiaddrs, each ending in /p2p/<ID>;
// nil with NoP2P.
func (r *Relay) Addrs() []multiaddr.Multiaddr {
	if r.host == nil {
		return nil
	}
	return transport.FullAddrs(r.host)
}

func (r *Relay) addrStrings() []string {
	var s []string
	for _, a := range r.Addrs() {
		s = append(s, a.String())
	}
	return s
}

// Run listens on cfg.Listen and serves until ctx ends; see Serve.
func (r *Relay) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", r.cfg.Listen)
	if err != nil {
		_ = r.Close()
		return fmt.Errorf("relay: listen: %w", err)
	}
	return r.Serve(ctx, ln)
}

// Serve serves HTTP on ln until ctx ends, then stops accepting, gives
// in-flight requests up to cfg.ShutdownTimeout, and closes the relay. It
// writes cfg.AddrFile once listening. It returns nil after a clean stop.
func (r *Relay) Serve(ctx context.Context, ln net.Listener) error {
	defer r.Close()
	if r.cfg.AddrFile != "" {
		if err := writeAddrFile(r.cfg.AddrFile, r.addrStrings()); err != nil {
			_ = ln.Close()
			return err
		}
	}
	srv := &http.Server{
		Handler:           r.handler,
		ReadHeaderTimeout: r.cfg.ReadHeaderTimeout,
		MaxHeaderBytes:    r.cfg.MaxHeaderBytes,
		IdleTimeout:       2 * r.cfg.IdleTimeout,
		ErrorLog:          r.serverLog("http"),
	}
	stopAdmin, aerr := r.serveAdmin()
	if aerr != nil {
		_ = ln.Close()
		return aerr
	}
	defer stopAdmin()
	r.log.Info().Str("addr", ln.Addr().String()).Msg("relay http listening")
	r.warmUp(ctx)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("relay: serve: %w", err)
	case <-ctx.Done():
	}
	// Announce the stop first (gossip: draining, then leave), so that
	// agents and peer relays learn it before the HTTP side goes.
	r.startDrain()
	sctx, cancel := context.WithTimeout(context.Background(), r.cfg.ShutdownTimeout)
	defer cancel()
	err := srv.Shutdown(sctx)
	if err != nil {
		_ = srv.Close()
	}
	<-errc
	r.log.Info().Msg("relay stopped")
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("relay: shutdown: %w", err)
	}
	return nil
}

// Close stops the join service and closes the host if New created it. It is
// safe to call more than once; HTTP serving is stopped by Run's context.
func (r *Relay) Close() error {
	r.closeOnce.Do(func() {
		var errs []error
		if r.audits != nil {
			r.audits.Close()
		}
		if r.bgCancel != nil {
			r.bgCancel()
			r.bgWG.Wait()
		}
		if r.peers != nil {
			r.peers.Stop()
		}
		r.providers.close()
		if r.gossip != nil {
			errs = append(errs, r.gossip.shutdown())
		}
		if r.peers != nil {
			// After gossip: a gossip join in progress returns at its shutdown.
			r.peers.Wait()
		}
		if r.join != nil {
			r.host.RemoveStreamHandler(transport.AgentUsageProtocol)
			errs = append(errs, r.join.Close())
		}
		if r.index != nil {
			r.index.close()
		}
		if r.ownHost {
			errs = append(errs, r.host.Close())
		}
		if c, ok := r.rt.(interface{ CloseIdleConnections() }); ok {
			c.CloseIdleConnections()
		}
		r.closeErr = errors.Join(errs...)
	})
	return r.closeErr
}

// housekeepEvery is how often the relay forgets what departed agents and
// peers left behind.
const housekeepEvery = 30 * time.Second

// housekeep runs sweep every housekeepEvery until the relay closes.
func (r *Relay) housekeep() {
	t := time.NewTicker(housekeepEvery)
	defer t.Stop()
	for {
		select {
		case <-r.bgCtx.Done():
			return
		case now := <-t.C:
			r.sweep(now)
		}
	}
}

// sweep forgets what departed agents and peers left behind: ended
// registrations and bans (Registry.sweep), ended prefix index cut-offs, and
// the per-agent series and counts of names no agent or provider holds
// (those that a request or an index frame still in flight recorded after
// its agent left).
func (r *Relay) sweep(now time.Time) {
	r.reg.sweep(now)
	names := r.metrics.agentNames()
	if r.index != nil {
		r.index.sweep(now)
		for _, a := range r.index.names() {
			names[a] = true
		}
	}
	for name := range names {
		if name != "" && !r.reg.has(name) && r.providers.get(name) == nil {
			r.forgetAgent(name)
		}
	}
}

// forgetAgent drops what the relay keeps by agent name once no agent holds
// the name: its metric series and its prefix index traffic count.
func (r *Relay) forgetAgent(name string) {
	r.metrics.forgetAgent(name)
	if r.index != nil {
		r.index.forget(name)
	}
}

// forgetPeer drops what the relay's own host keeps about peer p once p
// holds no registration and no connection: an agent is not dialed (it
// dials out), so its keys, protocols and addresses are of no more use, and
// libp2p would keep them for a minute (its addresses for 15) after the
// disconnection. Peer relays and an embedder's host are left alone. It
// does no I/O (network notifiers call it).
func (r *Relay) forgetPeer(p peer.ID) {
	if !r.ownHost || r.reg.IsJoined(p) || r.isGossipRelay(p) || r.peerKnown(p) {
		return
	}
	if c := r.host.Network().Connectedness(p); c == network.Connected || c == network.Limited {
		return
	}
	ps := r.host.Peerstore()
	ps.RemovePeer(p)
	ps.ClearAddrs(p)
}

// isGossipRelay reports whether p is one of the configured gossip relays.
func (r *Relay) isGossipRelay(p peer.ID) bool {
	for _, ai := range r.cfg.Gossip.Relays {
		if ai.ID == p {
			return true
		}
	}
	return false
}

// writeAddrFile writes addrs one per line, atomically (rename), so a
// script polling for the file never reads half of it.
func writeAddrFile(path string, addrs []string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strings.Join(addrs, "\n")+"\n"), 0o644); err != nil {
		return fmt.Errorf("relay: addr file: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("relay: addr file: %w", err)
	}
	return nil
}
