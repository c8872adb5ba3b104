package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/peerstore"
	"github.com/rs/zerolog"
)

// Config configures an Agent. The zero value of every optional field means
// the default written next to it; New fills them and checks the result.
type Config struct {
	// Relay is the relay's multiaddr including /p2p/<relay peer ID>.
	// Relay or Relays is required.
	Relay string
	// Relays are more relays to join, each multiaddr with /p2p/<peer ID>:
	// the agent joins and serves every one (Relay first, if set). Empty
	// means Relay alone.
	Relays []string
	// Token is the join secret; TokenFile names a file holding it (leading
	// and trailing white space ignored). Exactly one is required.
	Token     string
	TokenFile string
	// Upstream is the local engine's base URL, e.g. http://127.0.0.1:8000
	// (required).
	Upstream string
	// UpstreamAPIKey, if set, is sent to the engine as a bearer token.
	UpstreamAPIKey string
	// Name identifies the agent to the relay. Empty means the host name.
	Name string
	// Weight is the relative share of traffic. 0 means 1.
	Weight float64
	// MaxConcurrency caps concurrent requests, waiting ones included
	// (excess requests get 429), and bounds the dispatch limit. 0 means
	// unlimited.
	MaxConcurrency int
	// DispatchLimit is how many requests the engine is given at once, the
	// rest waiting in fair order (gate.go); the relays learn it as the
	// agent's capacity and queue what it cannot take. 0 means measured
	// from the engine's metrics (its batch); a negative value turns the
	// gate off, the relays then sending without limit (or up to
	// MaxConcurrency) and the engine queueing in arrival order.
	DispatchLimit int
	// IdentityFile keeps the agent's Ed25519 key. Empty means a new
	// identity on every start.
	IdentityFile string
	// ListenAddrs are the QUIC addresses to listen on. Empty means
	// transport.DefaultListenAddrs.
	ListenAddrs []string
	// HostOptions are extra libp2p options (NAT traversal).
	HostOptions []libp2p.Option
	// PublicCIDRs are address ranges treated as public for hole punching on
	// top of the globally routable ones (transport.AgentNATConfig), e.g.
	// 100.64.0.0/10 when agents reach each other over carrier-grade NAT
	// space. Empty (the default) means none.
	PublicCIDRs []netip.Prefix
	// Gossip configures membership gossip; the zero value runs it with the
	// home preset (see GossipConfig).
	Gossip GossipConfig
	// Index configures the prefix index published to the relays; the zero
	// value publishes it, sized from the engine (see IndexConfig).
	Index IndexConfig
	// Logger receives the agent's logs. The zero value discards.
	Logger zerolog.Logger

	// RefreshInterval is how often the engine's models and metrics are
	// read. 0 means 10 s.
	RefreshInterval time.Duration
	// UpstreamTimeout bounds one discovery or metrics request to the engine.
	// 0 means 5 s.
	UpstreamTimeout time.Duration
	// EngineFailures is how many discoveries in a row must fail before the
	// agent reports itself unavailable. 0 means 2.
	EngineFailures int
	// DrainTimeout bounds how long a stopping agent waits for in-flight
	// requests. 0 means 30 s.
	DrainTimeout time.Duration
	// MinBackoff and MaxBackoff bound the reconnect delay, which doubles
	// after each failure and carries jitter. 0 means 500 ms and 30 s.
	MinBackoff time.Duration
	MaxBackoff time.Duration
	// UpstreamTransport carries requests to the engine. Nil means
	// transport.NewHTTP1RoundTripper for a plain http:// engine without a
	// proxy from the environment, else a clone of http.DefaultTransport with
	// more idle connections.
	UpstreamTransport http.RoundTripper
}

func (c *Config) fill() {
	if c.Name == "" {
		c.Name, _ = os.Hostname()
	}
	if c.Weight == 0 {
		c.Weight = 1
	}
	if c.RefreshInterval == 0 {
		c.RefreshInterval = 10 * time.Second
	}
	if c.UpstreamTimeout == 0 {
		c.UpstreamTimeout = 5 * time.Second
	}
	if c.EngineFailures == 0 {
		c.EngineFailures = 2
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = 30 * time.Second
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = 500 * time.Millisecond
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 30 * time.Second
	}
	if c.UpstreamTransport == nil {
		c.UpstreamTransport = defaultUpstreamTransport(c.Upstream)
	}
}

// defaultUpstreamTransport carries requests to the engine at upstream: for a
// plain http:// engine that no proxy from the environment applies to (the
// usual engine on the same box or LAN), transport.NewHTTP1RoundTripper,
// which reads and writes on the request's own goroutine: http.Transport's
// reader and writer goroutines per connection were two wake-ups per request
// and about a quarter of the agent's CPU under load. Anything else (https,
// a proxy) gets a clone of http.DefaultTransport with more idle connections.
func defaultUpstreamTransport(upstream string) http.RoundTripper {
	if u, err := url.Parse(upstream); err == nil && u.Scheme == "http" && u.Host != "" {
		if p, err := http.ProxyFromEnvironment(&http.Request{URL: u}); err == nil && p == nil {
			return transport.NewHTTP1RoundTripper(nil)
		}
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 256
	return t
}

func (c *Config) validate() error {
	switch {
	case len(c.relayAddrs()) == 0:
		return errors.New("agent: relay address is required")
	case c.Upstream == "":
		return errors.New("agent: upstream URL is required")
	case c.Token != "" && c.TokenFile != "":
		return errors.New("agent: give the token or a token file, not both")
	case c.Token == "" && c.TokenFile == "":
		return errors.New("agent: a join token (or token file) is required")
	case c.Name == "" || len(c.Name) > 128:
		return errors.New("agent: name must be 1..128 bytes")
	case c.Weight < 0 || c.Weight > 1e6:
		return fmt.Errorf("agent: weight %v outside 0..1e6", c.Weight)
	case c.MaxConcurrency < 0:
		return fmt.Errorf("agent: max concurrency %d is negative", c.MaxConcurrency)
	case c.RefreshInterval < 0 || c.UpstreamTimeout < 0 || c.DrainTimeout < 0 || c.EngineFailures < 0:
		return errors.New("agent: intervals and counts must not be negative")
	case c.MinBackoff < 0 || c.MaxBackoff < c.MinBackoff:
		return errors.New("agent: backoff bounds must satisfy 0 <= min <= max")
	}
	return nil
}

// Agent joins one relay and serves its inference requests from the local
// engine. Build it with New and run it with Run.
type Agent struct {
	cfg      Config
	log      zerolog.Logger
	links    []*relayLink // one per relay (relays.go)
	token    []byte
	upstream *url.URL
	key      crypto.PrivKey
	id       peer.ID
	client   *http.Client
	// urls are the engine's URLs for servedPaths and optionalAPIs (shared,
	// never changed).
	urls map[string]*url.URL
	// authValue is the Authorization header value sent to the engine (nil
	// without Config.UpstreamAPIKey).
	authValue []string

	inflight atomic.Int64
	panics   atomic.Uint64                      // handler panics the stream server recovered
	nat      atomic.Pointer[transport.AgentNAT] // set by Run
	gossip   *transport.Gossip                  // set by Run before any goroutine reads it; nil when off
	rejoin   chan struct{}                      // asks the gossip loop to join through the relay
	kick     chan struct{}                      // asks the refresh loop to check the engine now
	dialSem  chan struct{}                      // bounds predial's dials in flight
	host     host.Host                          // guarded by mu; set while Run runs
	draining atomic.Bool
	index    *prefixIndex // nil when Config.Index.Disabled
	gate     *gate

	mu       sync.Mutex // guards the following fields
	models   []string
	engineOK bool
	failures int
	metrics  EngineMetrics
	// metricsAt is when metrics last got load figures from the engine
	// (zero: never); metricsErr is the last failed read; loadStale is set
	// while the figures are reported unknown for their age (load.go).
	metricsAt  time.Time
	metricsErr error
	loadStale  bool
	engine     EngineInfo // what identify found (engine.go)
	// identified is set once the engine was identified since it last
	// became available. unsettled counts the identifications in a row
	// that an engine not ready was cut short (a probe got no answer, or a
	// 503 as from a llama.cpp loading its model); retryIn is how many
	// refreshes remain before the next.
	identified         bool
	unsettled, retryIn int
	changed            chan struct{} // signalled (capacity 1) when info changes
}

// New checks cfg, loads the token and the identity, and returns an Agent
// ready to Run.
func New(cfg Config) (*Agent, error) {
	cfg.fill()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	links, err := parseRelays(cfg.relayAddrs())
	if err != nil {
		return nil, err
	}
	token := []byte(cfg.Token)
	if cfg.TokenFile != "" {
		b, err := os.ReadFile(cfg.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("agent: token file: %w", err)
		}
		token = []byte(strings.TrimSpace(string(b)))
		if len(token) == 0 {
			return nil, fmt.Errorf("agent: token file %s is empty", cfg.TokenFile)
		}
	}
	u, err := url.Parse(cfg.Upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("agent: upstream %q is not an http(s) URL", cfg.Upstream)
	}
	key, err := transport.LoadOrCreateIdentity(cfg.IdentityFile)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	id, err := peer.IDFromPrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a := &Agent{
		cfg:      cfg,
		log:      cfg.Logger.With().Str("component", "agent").Str("name", cfg.Name).Logger(),
		links:    links,
		token:    token,
		upstream: u,
		key:      key,
		id:       id,
		client:   &http.Client{Transport: cfg.UpstreamTransport},
		changed:  make(chan struct{}, 1),
		rejoin:   make(chan struct{}, 1),
		kick:     make(chan struct{}, 1),
		dialSem:  make(chan struct{}, predialLimit),
	}
	a.gate = newGate(scheduler.LimitConfig{Fixed: max(cfg.DispatchLimit, 0), Max: cfg.MaxConcurrency}, cfg.DispatchLimit < 0)
	if !cfg.Index.Disabled {
		a.index = newPrefixIndex(cfg.Index, a.log.With().Str("part", "prefix-index").Logger())
	}
	a.urls = make(map[string]*url.URL, len(servedPaths)+len(optionalAPIs))
	for p := range servedPaths {
		a.urls[p] = joinUpstream(u, p)
	}
	for _, p := range optionalAPIs {
		a.urls[p] = joinUpstream(u, p)
	}
	if cfg.UpstreamAPIKey != "" {
		a.authValue = []string{"Bearer " + cfg.UpstreamAPIKey}
	}
	return a, nil
}

// ID returns the agent's peer ID.
func (a *Agent) ID() peer.ID { return a.id }

// Panics returns how many request handler panics the agent's server
// recovered (each logged with its stack, and published in gossip).
func (a *Agent) Panics() uint64 { return a.panics.Load() }

// countPanic counts a recovered handler panic and publishes the count.
func (a *Agent) countPanic() {
	a.panics.Add(1)
	a.gossipNow()
}

// InFlight returns the number of requests being served.
func (a *Agent) InFlight() int { return int(a.inflight.Load()) }

// Metrics returns the engine's load as last read from its /metrics (zero
// when none was), however old: gossip carries it only while it is fresh
// (see load.go).
func (a *Agent) Metrics() EngineMetrics {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.metrics
}

// Engine returns what the agent recognised of its engine; the zero value
// until the engine first answered.
func (a *Agent) Engine() EngineInfo {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.engine
	e.APIs, e.UnknownAPIs = slices.Clone(e.APIs), slices.Clone(e.UnknownAPIs)
	return e
}

// KVCapacityTokens returns how many tokens the engine's KV cache holds, as
// the engine itself reports it (see EngineInfo.KVCapacityTokens and
// EngineMetrics.KVCapacityTokens, the live figure winning); 0 when the
// engine does not say.
func (a *Agent) KVCapacityTokens() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.metrics.KVCapacityTokens > 0 {
		return a.metrics.KVCapacityTokens
	}
	return a.engine.KVCapacityTokens
}

// Info returns what the agent currently reports to its relay.
func (a *Agent) Info() transport.JoinInfo {
	a.mu.Lock()
	defer a.mu.Unlock()
	return transport.JoinInfo{
		Name:     a.cfg.Name,
		Models:   slices.Clone(a.models),
		Weight:   a.cfg.Weight,
		Capacity: a.capacity(),
		// An engine that does not answer makes the agent unavailable: the
		// relay routes elsewhere instead of sending requests that fail.
		Draining:    a.draining.Load() || !a.engineOK,
		APIs:        slices.Clone(a.engine.APIs),
		UnknownAPIs: slices.Clone(a.engine.UnknownAPIs),
		Engine:      string(a.engine.Kind),
		Relays:      a.cfg.relayAddrs(),
	}
}

// capacity is what the agent announces as its capacity: its dispatch
// limit, or MaxConcurrency without one.
func (a *Agent) capacity() int {
	if n := a.gate.Limit(); n > 0 {
		return n
	}
	return a.cfg.MaxConcurrency
}

// DispatchLimit returns the agent's dispatch limit (0: none) and the
// requests waiting for it.
func (a *Agent) DispatchLimit() (limit, waiting int) {
	return a.gate.Limit(), a.gate.waiting()
}

// observeLoad feeds an engine metrics reading (ok false: it failed) to the
// dispatch limit, and announces a changed limit.
func (a *Agent) observeLoad(met EngineMetrics, ok bool) {
	limit, changed := a.gate.observe(met, ok, time.Now())
	if !changed {
		return
	}
	a.log.Info().Int("dispatch_limit", limit).Int("running", met.Running).Int("waiting", met.Waiting).Msg("dispatch limit changed")
	a.notify()
	if g := a.Gossip(); g != nil {
		g.UpdateMeta()
	}
}

func (a *Agent) notify() {
	select {
	case a.changed <- struct{}{}:
	default:
	}
	a.notifyLinks()
}

// Run starts the agent's libp2p host, keeps it joined to the relay
// (reconnecting forever with capped, jittered exponential backoff) and serves
// the relay's requests until ctx ends. It then drains: reports itself
// draining, waits for in-flight requests up to DrainTimeout, leaves the relay
// and closes the host. It returns nil after a stop by ctx, and an error
// wrapping the cause when its stream server stopped serving on its own.
func (a *Agent) Run(ctx context.Context) error {
	// NAT traversal: a reservation at our relay, so that other agents reach
	// us through its circuit, and hole punching towards them.
	nat, err := transport.NewAgentNAT(transport.AgentNATConfig{
		Relays:      a.relayInfos(),
		PublicCIDRs: a.cfg.PublicCIDRs,
		Logger:      a.log,
	})
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	a.nat.Store(nat)
	h, err := transport.NewHost(transport.HostConfig{
		ListenAddrs: a.cfg.ListenAddrs,
		Key:         a.key,
		Logger:      a.log,
		// Strangers get no connection (so no identify), and peers learn
		// only addresses they could use.
		Options: append(append(nat.Options(),
			libp2p.ConnectionGater(gater{a}),
			libp2p.AddrsFactory(a.publicAddrs),
		), a.cfg.HostOptions...),
	})
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	defer h.Close()
	a.mu.Lock()
	a.host = h
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.host = nil
		a.mu.Unlock()
	}()
	for _, l := range a.links {
		h.Peerstore().AddAddrs(l.info.ID, l.info.Addrs, peerstore.PermanentAddrTTL)
	}

	srv, err := transport.ServeHTTP(h, a, a.isRelay,
		transport.WithServerLog(transport.ServerLog(a.log.With().Str("source", "stream-http").Logger(), a.countPanic)))
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	defer srv.Close()
	// A stream server that stops on its own serves nothing more: the agent
	// says so and stops, so that its supervisor starts it again.
	ctx, stopRun := context.WithCancelCause(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		a.watchServer(ctx, srv, stopRun)
	}()
	defer func() {
		stopRun(nil)
		<-watched
	}()

	bg, stopBg := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	a.refresh(bg) // so that the first join carries the models
	wg.Add(1)
	go func() {
		defer wg.Done()
		a.refreshLoop(bg)
	}()
	if a.index != nil {
		wg.Go(func() { a.index.flushLoop(bg) })
	}
	defer func() {
		stopBg()
		// Gossip stops before the wait: a gossip join in progress then
		// returns at once instead of running into its timeout.
		a.stopGossip()
		wg.Wait()
	}()
	if err := a.startGossip(bg, h, &wg); err != nil {
		return fmt.Errorf("agent: %w", err)
	}

	a.drain(a.runRelays(ctx, h))
	if err := context.Cause(ctx); errors.Is(err, errServerStopped) {
		return err
	}
	return nil
}

// errServerStopped is the cause of an agent's stop when its stream server
// stopped serving on its own.
var errServerStopped = errors.New("agent: stream server stopped serving")

// servingServer is what watchServer watches: transport.HTTPServer.
type servingServer interface {
	Done() <-chan struct{}
	Err() error
}

// watchServer waits until ctx ends or srv stops serving on its own; then it
// logs why and stops the agent's run (stop) with errServerStopped.
func (a *Agent) watchServer(ctx context.Context, srv servingServer, stop context.CancelCauseFunc) {
	select {
	case <-ctx.Done():
		return
	case <-srv.Done():
	}
	err := srv.Err()
	if err == nil {
		return // closed by Run
	}
	a.log.Error().Err(err).Msg("stream server stopped serving: no request reaches the engine any more; stopping")
	stop(fmt.Errorf("%w: %w", errServerStopped, err))
}

// stayJoined keeps a registration with relay l until ctx ends and returns
// the one open then (nil if none).
func (a *Agent) stayJoined(ctx context.Context, h host.Host, l *relayLink) *transport.Membership {
	backoff := a.cfg.MinBackoff
	for {
		m, err := a.join(ctx, h, l)
		if err == nil {
			a.log.Info().Str("relay", l.info.ID.String()).Msg("joined relay")
			l.setMembership(m)
			// The relay reserves circuits for joined peers only.
			if nat := a.nat.Load(); nat != nil {
				nat.SetJoined(l.info.ID, true)
			}
			// A relay that restarted forgot the members: join its gossip
			// after every registration.
			a.gossipRejoin()
			since := time.Now()
			stopIndex := a.startPublishing(ctx, h, l.info.ID)
			m = a.serveMembership(ctx, m, l)
			stopIndex()
			if m != nil {
				return m // ctx ended while joined
			}
			l.setMembership(nil)
			if nat := a.nat.Load(); nat != nil {
				nat.SetJoined(l.info.ID, false)
			}
			// A registration that lasted resets the backoff; one that
			// breaks at once keeps growing it.
			if time.Since(since) > a.cfg.MaxBackoff {
				backoff = a.cfg.MinBackoff
			}
		} else if ctx.Err() == nil {
			a.log.Warn().Err(err).Str("relay", l.info.ID.String()).Dur("retry_in", backoff).Msg("join failed")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(jitter(backoff)):
		}
		backoff = min(2*backoff, a.cfg.MaxBackoff)
	}
}

// jitter spreads d over [d/2, d] so that agents cut off together do not
// come back together.
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

func (a *Agent) join(ctx context.Context, h host.Host, l *relayLink) (*transport.Membership, error) {
	jctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	// Our own backoff paces reconnects; libp2p's dial backoff would
	// otherwise refuse to redial a relay that was just down. An existing
	// direct connection is reused.
	if err := h.Connect(network.WithForceDirectDial(jctx, "computeflux agent reconnect"), l.info); err != nil {
		return nil, fmt.Errorf("connect to relay: %w", err)
	}
	return transport.Join(jctx, h, l.info.ID, a.token, a.Info())
}

// serveMembership forwards info changes to the relay until the registration
// ends (returns nil) or ctx ends (returns m, still open).
func (a *Agent) serveMembership(ctx context.Context, m *transport.Membership, l *relayLink) *transport.Membership {
	sent := a.Info()
	for {
		select {
		case <-ctx.Done():
			return m
		case <-m.Done():
			a.log.Warn().Err(m.Err()).Str("relay", l.info.ID.String()).Msg("lost the relay; reconnecting")
			m.Close()
			return nil
		case <-l.changed:
			info := a.Info()
			if infoEqual(info, sent) {
				continue
			}
			if err := m.Update(info); err != nil {
				a.log.Warn().Err(err).Msg("update to relay failed; reconnecting")
				m.Close()
				return nil
			}
			sent = info
			a.log.Info().Strs("models", info.Models).Bool("draining", info.Draining).Msg("reported change to relay")
		}
	}
}

func infoEqual(x, y transport.JoinInfo) bool {
	return x.Name == y.Name && slices.Equal(x.Models, y.Models) && x.Weight == y.Weight &&
		x.Capacity == y.Capacity && x.Draining == y.Draining && slices.Equal(x.APIs, y.APIs) && slices.Equal(x.UnknownAPIs, y.UnknownAPIs) &&
		slices.Equal(x.Relays, y.Relays)
}

// drain reports the agent draining (join update and gossip metadata), waits
// for in-flight requests (up to DrainTimeout), leaves the gossip and then the
// relays (ms are the registrations open).
func (a *Agent) drain(ms []*transport.Membership) {
	a.draining.Store(true)
	a.gossipNow()
	if len(ms) == 0 {
		a.gossipLeave()
		return
	}
	defer func() {
		// Leave the gossip first: the others see us go at once, then the
		// relays see the registrations end.
		a.gossipLeave()
		for _, m := range ms {
			m.Close()
		}
	}()
	for _, m := range ms {
		if err := m.Update(a.Info()); err != nil {
			a.log.Warn().Err(err).Str("relay", m.Relay().String()).Msg("could not report draining")
		}
	}
	a.log.Info().Int64("in_flight", a.inflight.Load()).Dur("timeout", a.cfg.DrainTimeout).Msg("draining")
	deadline := time.Now().Add(a.cfg.DrainTimeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for a.inflight.Load() > 0 && time.Now().Before(deadline) {
		<-tick.C
	}
	if n := a.inflight.Load(); n > 0 {
		a.log.Warn().Int64("in_flight", n).Msg("drain deadline passed; cutting requests")
	}
}

// refreshLoop reads the engine's models and metrics every RefreshInterval.
func (a *Agent) refreshLoop(ctx context.Context) {
	t := time.NewTimer(a.cfg.RefreshInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-a.kick:
			t.Stop()
		}
		a.refresh(ctx)
		// While the engine fails, check again soon: an engine that stopped
		// answering takes the agent out of routing (draining) after
		// EngineFailures checks, not EngineFailures refresh intervals.
		next := a.cfg.RefreshInterval
		a.mu.Lock()
		if a.failures > 0 {
			next = min(next, engineRecheck)
		}
		a.mu.Unlock()
		t.Reset(next)
	}
}

// engineRecheck is the gap between two engine checks while the engine
// fails.
const engineRecheck = time.Second

// identifyRetryMax is the most refreshes between two identifications of an
// engine that was not ready (1, 2, 4, then every 6: a minute at the default
// RefreshInterval), so an engine that loads for minutes is known soon
// after, and one that always answers 503 costs a few GETs a minute.
const identifyRetryMax = 6

// kickRefresh asks the refresh loop to check the engine now (a request
// found it unreachable). It never blocks.
func (a *Agent) kickRefresh() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// refresh reads the engine's model list and metrics once.
func (a *Agent) refresh(ctx context.Context) {
	models, ownedBy, err := a.discoverModels(ctx)
	a.mu.Lock()
	first := !a.identified
	identify := err == nil && first
	if err == nil && !first && a.unsettled > 0 {
		a.retryIn--
		identify = a.retryIn <= 0
	}
	prev := a.engine
	a.mu.Unlock()
	var eng EngineInfo
	var idLoad EngineMetrics
	var settled, found bool // found: identification found something new
	if identify {
		ictx, cancel := context.WithTimeout(ctx, a.cfg.UpstreamTimeout)
		eng, idLoad, settled = a.prober().identify(ictx, ownedBy)
		cancel()
		if !first && !settled {
			eng = eng.orKnown(prev) // asked again: keep what an earlier ask found
		}
		found = first || !eng.equal(prev)
	}
	if found {
		switch {
		case eng.Kind == EngineUnknown && !settled:
			a.log.Warn().Str("upstream", a.upstream.Redacted()).
				Msg("engine not identified yet (no answer, or 502, 503 or 504, as while it loads its model): serving its OpenAI endpoints meanwhile; asking again")
		case eng.Kind == EngineUnknown:
			a.log.Warn().Str("upstream", a.upstream.Redacted()).Strs("apis", eng.APIs).Strs("apis_unknown", eng.UnknownAPIs).
				Msg("engine not recognised (not vLLM, SGLang, TGI, llama.cpp or Ollama): serving its OpenAI endpoints and the optional APIs it answered for, no load figures")
		default:
			a.log.Info().Str("engine", string(eng.Kind)).Str("version", eng.Version).
				Int("kv_capacity_tokens", eng.KVCapacityTokens).Strs("apis", eng.APIs).Strs("apis_unknown", eng.UnknownAPIs).Str("evidence", eng.Evidence).
				Msg("engine recognised: " + eng.describe())
		}
	}
	var met EngineMetrics
	var metErr error
	switch {
	case err != nil:
	case identify && idLoad.Engine != "" && eng.Kind != EngineOllama:
		met = idLoad // identification just read /metrics; scrapeLoad would read it again
	default:
		met, metErr = a.scrapeLoad(ctx, eng, identify)
	}
	a.mu.Lock()
	if identify {
		a.engine, a.identified = eng, true
		if settled {
			a.unsettled, a.retryIn = 0, 0
		} else {
			a.unsettled++
			a.retryIn = min(1<<min(a.unsettled-1, 3), identifyRetryMax)
		}
	}
	wasOK, before := a.engineOK, a.models
	if err != nil {
		a.failures++
		if a.failures >= a.cfg.EngineFailures {
			a.engineOK = false
		}
		if !a.engineOK {
			// Identify again when it is back: it may be another engine.
			a.identified, a.unsettled, a.retryIn = false, 0, 0
		}
	} else {
		a.failures = 0
		a.engineOK = true
		a.models = models
	}
	var load loadChange
	switch {
	case err != nil:
		load = a.noteLoadLocked(time.Now(), nil, errEngineDown)
	case metErr != nil:
		load = a.noteLoadLocked(time.Now(), nil, metErr)
	default:
		load = a.noteLoadLocked(time.Now(), &met, nil)
	}
	nowOK, after, batch := a.engineOK, a.models, a.engine.Batch
	a.mu.Unlock()
	if limit, changed := a.gate.setBatch(batch, a.cfg.MaxConcurrency, a.cfg.DispatchLimit != 0); changed {
		a.log.Info().Int("dispatch_limit", limit).Int("engine_batch", batch).Msg("dispatch limit set to the engine's batch")
		a.notify()
		if g := a.Gossip(); g != nil {
			g.UpdateMeta()
		}
	}
	a.logLoadChange(load)
	if a.Gossip() == nil {
		a.observeLoad(met, metErr == nil && err == nil) // no metrics loop without gossip
	}

	if err != nil && ctx.Err() == nil {
		a.log.Warn().Err(err).Msg("engine model discovery failed")
	}
	if err == nil {
		a.refreshKVCapacity()
	}
	if wasOK != nowOK || !slices.Equal(before, after) || found {
		if nowOK {
			a.log.Info().Strs("models", after).Msg("engine available")
		} else {
			a.log.Warn().Msg("engine unavailable; reporting draining")
		}
		a.notify()
	}
}

// discoverModels returns the sorted model IDs of the engine's GET
// /v1/models and the owned_by of the first (a hint of the engine's kind).
func (a *Agent) discoverModels(ctx context.Context) ([]string, string, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.UpstreamTimeout)
	defer cancel()
	list, err := a.prober().models(ctx)
	if err != nil {
		return nil, "", err
	}
	var ids []string
	var ownedBy string
	if len(list.Data) > 0 {
		ownedBy = list.Data[0].OwnedBy
	}
	for _, d := range list.Data {
		if d.ID != "" && len(d.ID) <= 256 && !slices.Contains(ids, d.ID) {
			ids = append(ids, d.ID)
		}
	}
	slices.Sort(ids)
	if len(ids) > 1024 {
		ids = ids[:1024]
	}
	return ids, ownedBy, nil
}

// scrapeMetrics reads the engine's Prometheus /metrics. Engines without one
// answer 404; that is not an error worth logging.
func (a *Agent) scrapeMetrics(ctx context.Context) (EngineMetrics, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.UpstreamTimeout)
	defer cancel()
	body, err := a.prober().open(ctx, "/metrics")
	if err != nil {
		return EngineMetrics{}, err
	}
	defer body.Close()
	return ParseEngineMetrics(io.LimitReader(body, maxMetricsBody))
}
