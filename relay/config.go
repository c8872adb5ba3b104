package relay

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Defaults for the zero values of Config.
const (
	DefaultListen            = ":8080"
	DefaultMaxAttempts       = 3
	DefaultTTFBTimeout       = 120 * time.Second // engines under load can queue a long prompt for a while
	DefaultIdleTimeout       = 60 * time.Second  // gap between two streamed chunks
	DefaultMaxBodyBytes      = 32 << 20          // long chat histories, not uploads
	DefaultReadHeaderTimeout = 10 * time.Second  // slow-header clients are cut off here
	DefaultMaxHeaderBytes    = 64 << 10          // OpenAI requests carry a few small headers
	DefaultShutdownTimeout   = 30 * time.Second  // in-flight streams get this long on stop
)

// DefaultP2PListen are the libp2p listen addresses used when
// Config.P2PListen is empty: QUIC on UDP 4001, IPv4 and IPv6.
var DefaultP2PListen = []string{"/ip4/0.0.0.0/udp/4001/quic-v1", "/ip6/::/udp/4001/quic-v1"}

// Config configures a Relay. The zero value of every field means its default;
// New fills the defaults (populate) and checks the result (validate).
type Config struct {
	// Listen is the HTTP listen address for Run. Empty means ":8080".
	Listen string

	// P2PListen are the multiaddrs the libp2p host listens on when New
	// creates it. Empty means DefaultP2PListen.
	P2PListen []string
	// IdentityFile holds the host's Ed25519 key (created on first use).
	// Empty means an ephemeral identity.
	IdentityFile string
	// Host, if set, is the libp2p host agents join; the relay does not close
	// it. Nil means New creates one from P2PListen and IdentityFile and Close
	// closes it.
	Host host.Host
	// NoP2P runs the relay without a libp2p host: agents are added through
	// Registry by the embedding program (tests, other transports). Transport
	// must then be set.
	NoP2P bool
	// Token is the agents' join secret. Required unless NoP2P.
	Token []byte

	// PublicCIDRs are address ranges the relay treats as public on top of
	// the globally routable ones, e.g. 100.64.0.0/10 when the relay and
	// agents meet over carrier-grade NAT space, or a lab's range: the
	// relay's addresses in them go into the circuit reservations it grants,
	// which agents need to hole punch. Empty (the default) means only
	// globally routable addresses count. Used when New creates the host.
	PublicCIDRs []netip.Prefix
	// RelayLimits bounds the circuits the relay carries between agents
	// (gossip and hole-punch set-up; inference never takes a circuit). The
	// zero value means transport.RelayLimits' defaults. Used when New
	// creates the host.
	RelayLimits transport.RelayLimits
	// Gossip configures membership gossip among the relay and its agents;
	// the zero value runs it with the home preset (see GossipConfig).
	Gossip GossipConfig
	// Peers configures session sharing with peer relays (package peering); the
	// zero value shares with the relays the agents name.
	Peers PeersConfig
	// WarmUp, if set, holds back accepting HTTP connections after the start
	// until agents have joined (at least one routable and no new join for
	// 250 ms), for at most this long: with several relays behind one name,
	// a restarted relay then does not answer 503 while its agents rejoin;
	// clients wait in the listen backlog or go to another relay. Zero means
	// serve at once.
	WarmUp time.Duration

	// APIKeys are the client keys accepted as "Authorization: Bearer KEY".
	// The relay refuses to start without keys unless NoAuth is set.
	APIKeys []string
	// NoAuth serves clients without any key. It must be set explicitly.
	NoAuth bool
	// KeyRPM bounds the inference requests one API key may start in any
	// one-minute window; more get 429 with Retry-After. With NoAuth all
	// clients share one budget. Zero means unlimited.
	KeyRPM int
	// KeyConcurrency bounds the inference requests one API key may have in
	// flight; more get 429. With NoAuth all clients share one budget. Zero
	// means unlimited.
	KeyConcurrency int
	// Clients names clients (several keys each), their weights, classes
	// and budgets (see ClientsFile); its keys are accepted as API keys too.
	// Nil means every key is a client of its own, of weight 1, interactive.
	Clients *ClientsFile

	// QueueWait bounds how long a request waits at the relay for an agent
	// with room (queue.go) before an overflow tier takes it or it gets
	// 429. Zero means DefaultQueueWait (30 s); negative turns the queue
	// off: a request no agent has room for overflows or gets 503 at once.
	QueueWait time.Duration
	// PrefillLimit bounds, in prompt tokens, the prefill this relay has
	// queued at one agent: once the uncached prompts of its streamed
	// requests not yet answering reach it, the agent takes no more until
	// one starts, and further requests wait in the queue, in its fair
	// order, for whichever agent frees first (scheduler.Endpoint's
	// PrefillLimit). Zero means DefaultPrefillLimit; negative, or the queue
	// off, means no bound.
	PrefillLimit int
	// RestartHold bounds the wait of requests that arrive before any agent
	// has joined (a restarted relay). Zero means DefaultRestartHold (5 s).
	RestartHold time.Duration
	// MaxQueued and MaxQueuedPerClient bound the requests waiting in all
	// and per client (per model); beyond them a request gets 429 at once.
	// Zero means scheduler.DefaultMaxQueued (8,192) and
	// scheduler.DefaultMaxQueuedPerFlow (2,048).
	MaxQueued, MaxQueuedPerClient int
	// MetricsKey, if set, is required as "Authorization: Bearer KEY" on
	// /metrics; client API keys do not open it. Empty means /metrics is
	// public (keep the relay's port private or set a key: it names agents
	// and shows their load).
	MetricsKey string

	// AddrFile, if set, receives the relay's dialable multiaddrs (with
	// /p2p/<ID>), one per line, once Run is listening.
	AddrFile string

	// Policy selects the routing policy; it overrides Scheduler.Policy when
	// not the zero value (sticky).
	Policy scheduler.Policy
	// Scheduler tunes the scheduler. Its zero value means the scheduler's
	// defaults; a nil Scheduler.Clock is replaced by Clock.
	Scheduler scheduler.Config
	// Prefix is how request prompts are cut into blocks for prefix-aware
	// routing; agents must publish their index with the same setting. The
	// zero value is scheduler's default (64-token blocks of 256 bytes).
	Prefix scheduler.PrefixConfig
	// IndexCutoff is how long an agent that broke the prefix index protocol
	// may not publish again. Zero means DefaultIndexCutoff (1 minute).
	IndexCutoff time.Duration

	// MaxAttempts bounds the agents tried for one request before its first
	// byte reaches the client. Zero means 3.
	MaxAttempts int
	// TTFBTimeout bounds the wait from sending a request to an agent until
	// the first byte of its response body. Zero means 120 s.
	TTFBTimeout time.Duration
	// IdleTimeout bounds the gap between two chunks of a response body, and
	// the time a client may take to accept one. Zero means 60 s.
	IdleTimeout time.Duration
	// MaxBodyBytes bounds a request body; larger ones get 413. Zero means 32 MiB.
	MaxBodyBytes int64

	// ReadHeaderTimeout and MaxHeaderBytes configure Run's http.Server.
	// Zero means 10 s and 64 KiB.
	ReadHeaderTimeout time.Duration
	MaxHeaderBytes    int
	// ShutdownTimeout is how long Run waits for in-flight requests when its
	// context ends. Zero means 30 s.
	ShutdownTimeout time.Duration

	// Transport carries requests to agents at http://<peerID>/... Nil means
	// transport.NewRoundTripper over the host.
	Transport http.RoundTripper

	// EndpointsFile, if set, is the YAML (or JSON) file of provider
	// endpoints and the operator's agent settings (see EndpointsFile); New
	// refuses a malformed one, and ReloadEndpoints reads it again. Empty
	// means agents only.
	EndpointsFile string
	// ProviderTransport carries requests to provider endpoints. Nil means
	// an http.Transport with TLS 1.2 or later and the system's roots.
	ProviderTransport http.RoundTripper
	// MaxAgentWeight caps the weight an agent declares. Zero means
	// DefaultMaxAgentWeight (4).
	MaxAgentWeight float64
	// AdminKey, if set, opens the admin API and the status page (see
	// AdminHandler) to "Authorization: Bearer KEY". Empty means no admin API.
	AdminKey string
	// AdminListen is the admin API's own listen address, served by Run and
	// Serve when AdminKey is set or StatusPublic. Empty means
	// DefaultAdminListen.
	AdminListen string
	// StatusPublic serves the status page and its data without the admin
	// key (they show no secret). The admin API still needs the key.
	StatusPublic bool
	// Ledger, if set, is the usage ledger the admin API's usage route
	// reads; the caller opens and closes it. Nil means no ledger: the
	// route answers 404.
	Ledger *ledger.Ledger
	// Audit configures the audits of agents (audits.go, package
	// auditor); the zero value audits at the defaults.
	Audit AuditConfig
	// Clock measures latencies. Nil means the real clock.
	Clock scheduler.Clock
	// Logger receives one line per request and lifecycle events. The zero
	// value discards them.
	Logger zerolog.Logger
	// RequestLogger, when not nil, receives the per-request lines instead
	// of Logger: the one hot log line, which the binary sends through a
	// buffered writer while lifecycle events go out at once. Nil means
	// Logger.
	RequestLogger *zerolog.Logger

	// noLiveness turns the request path's liveness checks (acks and
	// probes, package liveness) off, so that a test sees gossip's own failure
	// detection. Set by tests only (export_test.go).
	noLiveness bool
	// auditAddr, when set, stands in for an agent's address in the audits'
	// independence groups (audits.go). Tests only.
	auditAddr func(agent string) netip.Addr
	// peerSyncWait replaces how long a relay that has just started waits
	// for a newly learned peer's table (peering.Config.SyncWait) when set.
	// Tests only.
	peerSyncWait time.Duration
}

// realClock is the wall clock.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

// populate returns cfg with defaults filled in.
func populate(cfg Config) Config {
	cfg.Listen = cmp.Or(cfg.Listen, DefaultListen)
	if len(cfg.P2PListen) == 0 {
		cfg.P2PListen = append([]string(nil), DefaultP2PListen...)
	}
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, DefaultMaxAttempts)
	cfg.TTFBTimeout = cmp.Or(cfg.TTFBTimeout, DefaultTTFBTimeout)
	cfg.IdleTimeout = cmp.Or(cfg.IdleTimeout, DefaultIdleTimeout)
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.ReadHeaderTimeout = cmp.Or(cfg.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	cfg.MaxHeaderBytes = cmp.Or(cfg.MaxHeaderBytes, DefaultMaxHeaderBytes)
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, DefaultShutdownTimeout)
	if cfg.Clock == nil { // not cmp.Or: a Clock need not be comparable
		cfg.Clock = realClock{}
	}
	cfg.IndexCutoff = cmp.Or(cfg.IndexCutoff, DefaultIndexCutoff)
	cfg.MaxAgentWeight = cmp.Or(cfg.MaxAgentWeight, DefaultMaxAgentWeight)
	cfg.AdminListen = cmp.Or(cfg.AdminListen, DefaultAdminListen)
	cfg.QueueWait = cmp.Or(cfg.QueueWait, DefaultQueueWait)
	cfg.RestartHold = cmp.Or(cfg.RestartHold, DefaultRestartHold)
	cfg.PrefillLimit = cmp.Or(cfg.PrefillLimit, DefaultPrefillLimit)
	if cfg.Policy != scheduler.PolicySticky {
		cfg.Scheduler.Policy = cfg.Policy
	}
	if cfg.Scheduler.Clock == nil {
		cfg.Scheduler.Clock = cfg.Clock
	}
	return cfg
}

// validate checks a populated Config.
func validate(cfg Config) error {
	var errs []error
	if len(cfg.APIKeys) == 0 && !cfg.NoAuth && (cfg.Clients == nil || len(cfg.Clients.Clients) == 0) {
		errs = append(errs, errors.New("no API keys: give keys, or set NoAuth to serve without authentication"))
	}
	for i, k := range cfg.APIKeys {
		if k == "" || strings.TrimSpace(k) != k || strings.ContainsAny(k, " \t\r\n") {
			errs = append(errs, fmt.Errorf("API key %d is empty or contains whitespace", i+1))
		}
	}
	if err := cfg.Audit.Validate(); err != nil {
		errs = append(errs, err)
	}
	if cfg.NoP2P {
		if cfg.Transport == nil {
			errs = append(errs, errors.New("NoP2P needs a Transport to reach agents"))
		}
	} else if len(cfg.Token) == 0 {
		errs = append(errs, errors.New("no join token for agents"))
	}
	if cfg.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("MaxAttempts %d < 1", cfg.MaxAttempts))
	}
	if cfg.TTFBTimeout < 0 || cfg.IdleTimeout < 0 || cfg.ReadHeaderTimeout < 0 || cfg.ShutdownTimeout < 0 {
		errs = append(errs, errors.New("negative timeout"))
	}
	if cfg.RestartHold < 0 || cfg.MaxQueued < 0 || cfg.MaxQueuedPerClient < 0 {
		errs = append(errs, errors.New("RestartHold, MaxQueued and MaxQueuedPerClient must not be negative"))
	}
	if cfg.IndexCutoff < 0 {
		errs = append(errs, errors.New("negative IndexCutoff"))
	}
	if cfg.MaxBodyBytes < 0 || cfg.MaxHeaderBytes < 0 {
		errs = append(errs, errors.New("negative size limit"))
	}
	if cfg.KeyRPM < 0 || cfg.KeyRPM > MaxKeyRPM || cfg.KeyConcurrency < 0 {
		errs = append(errs, fmt.Errorf("per-key limits: KeyRPM must be 0..%d and KeyConcurrency not negative", MaxKeyRPM))
	}
	if !(cfg.MaxAgentWeight > 0) || math.IsInf(cfg.MaxAgentWeight, 0) {
		errs = append(errs, fmt.Errorf("MaxAgentWeight must be positive, got %v", cfg.MaxAgentWeight))
	}
	if cfg.AdminKey != "" && checkKey(cfg.AdminKey) != nil {
		errs = append(errs, errors.New("AdminKey is empty or contains white space"))
	}
	if cfg.MetricsKey != "" && strings.TrimSpace(cfg.MetricsKey) != cfg.MetricsKey {
		errs = append(errs, errors.New("MetricsKey has leading or trailing white space"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("relay config: %w", err)
	}
	return nil
}

// LoadAPIKeys reads client API keys from a file: one key per line; blank
// lines and lines starting with '#' are skipped, as is anything after " #".
func LoadAPIKeys(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("api keys: %w", err)
	}
	defer f.Close()
	keys, err := ParseAPIKeys(f)
	if err != nil {
		return nil, fmt.Errorf("api keys %s: %w", path, err)
	}
	return keys, nil
}

// ParseAPIKeys reads keys in LoadAPIKeys's format.
func ParseAPIKeys(r io.Reader) ([]string, error) {
	var keys []string
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if i := strings.Index(line, " #"); i >= 0 {
			line = line[:i]
		}
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.ContainsAny(line, " \t") {
			return nil, fmt.Errorf("line %d: a key must not contain spaces", n)
		}
		keys = append(keys, line)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return keys, nil
}
