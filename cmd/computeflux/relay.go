package main

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"
	"golang.org/x/crypto/acme/autocert"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/certs"
	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/scheduler/audit"
)

// runRelay serves the OpenAI API and the agents' join service until ctx ends.
func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, files, err := relayConfig(args, os.LookupEnv, stderr)
	if err != nil {
		return err
	}
	tuneGC(os.LookupEnv)
	var acme *certs.ACME
	if files.acme != nil {
		files.acme.Logger = cfg.Logger.With().Str("component", "acme").Logger()
		files.acme.ReadHeaderTimeout = cmp.Or(cfg.ReadHeaderTimeout, relay.DefaultReadHeaderTimeout)
		// Before anything starts: a cache it cannot write is a start-up error.
		if acme, err = certs.NewACME(*files.acme); err != nil {
			return err
		}
		defer acme.Close() // after the HTTP sides: no renewal outlives the relay
	}
	closeLedger, err := files.openLedger(&cfg)
	if err != nil {
		return err
	}
	defer closeLedger() // after the relay: its last requests are recorded
	r, err := relay.New(cfg)
	if err != nil {
		return err
	}
	for _, a := range r.Addrs() {
		fmt.Fprintf(stdout, "relay p2p address: %s\n", a)
	}
	stopReload := reloadOnHangup(ctx, r)
	defer stopReload()
	if files.cert == "" && acme == nil {
		if !isLoopbackListen(cfg.Listen) {
			cfg.Logger.Warn().Str("listen", cfg.Listen).Msg("serving plain HTTP: clients' API keys cross the network in clear text; use --domain NAME (a certificate by ACME), --tls-cert/--tls-key, or a TLS proxy in front")
		}
		return r.Run(ctx)
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		_ = r.Close()
		return fmt.Errorf("relay: listen: %w", err)
	}
	if acme != nil {
		return serveACME(ctx, r, acme, ln, files.httpListen, cfg.Logger)
	}
	tln, err := certs.NewTLSListener(ln, files.cert, files.key)
	if err != nil {
		_ = ln.Close()
		_ = r.Close()
		return err
	}
	return r.Serve(ctx, tln)
}

// serveACME serves the relay on ln with certificates by ACME, and the
// ACME http-01 challenges and redirects to HTTPS on httpListen (none: no
// HTTP side), until ctx ends.
func serveACME(ctx context.Context, r *relay.Relay, acme *certs.ACME, ln net.Listener, httpListen string, log zerolog.Logger) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	httpDone := make(chan error, 1)
	if httpListen == noHTTPListen {
		httpDone <- nil
	} else {
		hln, err := net.Listen("tcp", httpListen)
		if err != nil {
			_ = ln.Close()
			_ = r.Close()
			return fmt.Errorf("relay: --http-listen (ACME http-01 challenges; none: only tls-alpn-01 on the HTTPS port): %w", err)
		}
		httpsPort := ln.Addr().(*net.TCPAddr).Port
		go func() {
			err := acme.ServeHTTP(ctx, hln, httpsPort)
			if err != nil {
				log.Error().Err(err).Msg("the HTTP side stopped: no http-01 challenges or redirects until the relay restarts")
			}
			httpDone <- err
		}()
	}
	acme.Start()
	err := r.Serve(ctx, acme.Listener(ln))
	cancel()
	<-httpDone
	return err
}

// relayFiles names the files runRelay opens: the certificate and key
// (both or neither) and the usage ledger's.
type relayFiles struct {
	cert, key string
	// acme, if set, has the relay obtain its certificates by ACME
	// (--domain); httpListen is then its HTTP side's address.
	acme       *certs.ACMEConfig
	httpListen string
	ledger     string // the usage ledger's file; empty: no ledger (--ledger-file none)
	failClose  bool   // budgets refuse while the ledger cannot write
}

// noLedger is the --ledger-file value that keeps no ledger.
const noLedger = "none"

// noHTTPListen is the --http-listen value that serves no plain HTTP.
const noHTTPListen = "none"

// acmeFlags are the relay's flags for certificates by ACME.
type acmeFlags struct {
	domains                  listFlag
	httpListen               string
	directory, email, caFile string
	renewBefore              time.Duration
}

// acmeHTTPListen and acmeHTTPSListen are --http-listen's and --listen's
// defaults with --domain: the ports the CA checks (80 for http-01, 443 for
// tls-alpn-01) and clients expect for https://.
const (
	acmeHTTPListen  = ":80"
	acmeHTTPSListen = ":443"
)

func (a *acmeFlags) register(fs *flag.FlagSet) {
	fs.Var(&a.domains, "domain", "serve HTTPS with a certificate for this DNS `name`, obtained and renewed by ACME (Let's Encrypt unless --acme-directory), "+
		"accepting the CA's terms of service; the CA must reach the relay by the name on port 80 (--http-listen) or 443 (--listen, then :443 by default); "+
		"certificates are kept in acme/ in the relay's state directory (beside --identity, else $STATE_DIRECTORY or <user config dir>/computeflux); repeatable or comma-separated")
	fs.StringVar(&a.httpListen, "http-listen", "", "with --domain: plain HTTP listen `address` for the ACME http-01 challenges, redirecting everything else to https (default :80; none: no plain HTTP, only tls-alpn-01 on --listen's port)")
	fs.StringVar(&a.directory, "acme-directory", autocert.DefaultACMEDirectory, "with --domain: the ACME CA's directory `URL` (Let's Encrypt's staging: https://acme-staging-v02.api.letsencrypt.org/directory)")
	fs.StringVar(&a.email, "acme-email", "", "with --domain: contact `address` given to the ACME CA for expiry and policy notices (default: none)")
	fs.StringVar(&a.caFile, "acme-ca-file", "", "with --domain: PEM `file` of extra roots to trust for the ACME CA's own HTTPS (a private or test CA)")
	fs.DurationVar(&a.renewBefore, "acme-renew-before", 0, "with --domain: renew a certificate this `long` before it expires, at most 720h (default: when a third of its lifetime is left, at most 720h)")
}

// config returns the ACME settings the flags give, nil without --domain.
// given names the flags set on the command line or from the environment.
func (a *acmeFlags) config(identity string, given map[string]bool, tf relayFiles, lookupEnv func(string) (string, bool)) (*certs.ACMEConfig, error) {
	if !given["domain"] {
		for _, f := range []string{"http-listen", "acme-directory", "acme-email", "acme-ca-file", "acme-renew-before"} {
			if given[f] {
				return nil, fmt.Errorf("--%s needs --domain", f)
			}
		}
		return nil, nil
	}
	if len(a.domains) == 0 {
		return nil, errors.New("--domain: empty name")
	}
	if tf.cert != "" || tf.key != "" {
		return nil, errors.New("--domain obtains its own certificate: give it or --tls-cert/--tls-key, not both")
	}
	cfg := &certs.ACMEConfig{DirectoryURL: a.directory, Email: a.email, RenewBefore: a.renewBefore}
	seen := map[string]bool{}
	for _, d := range a.domains {
		n, err := certs.CheckDomain(d)
		if err != nil {
			return nil, fmt.Errorf("--domain: %w", err)
		}
		if !seen[n] {
			seen[n] = true
			cfg.Domains = append(cfg.Domains, n)
		}
	}
	if u, err := url.Parse(a.directory); err != nil || u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("--acme-directory %q: want the https:// URL of an ACME directory", a.directory)
	}
	if a.email != "" && (!strings.Contains(a.email, "@") || strings.ContainsAny(a.email, " \t\n<>,")) {
		return nil, fmt.Errorf("--acme-email %q: want an address such as ops@example.com", a.email)
	}
	if a.renewBefore < 0 {
		return nil, errors.New("--acme-renew-before must not be negative")
	}
	if a.caFile != "" {
		pem, err := os.ReadFile(a.caFile)
		if err != nil {
			return nil, fmt.Errorf("--acme-ca-file: %w", err)
		}
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--acme-ca-file %s holds no PEM certificate", a.caFile)
		}
		cfg.RootCAs = pool
	}
	dir, err := relayStateDir(identity, lookupEnv)
	if err != nil {
		return nil, fmt.Errorf("no state directory for the ACME certificate cache (%w): give --identity FILE, the cache goes beside it", err)
	}
	cfg.CacheDir = filepath.Join(dir, "acme")
	return cfg, nil
}

// relayStateDir is where a relay keeps the files no flag names: beside
// its identity file when it has one (the installed unit's
// /var/lib/computeflux/relay.key), else systemd's StateDirectory
// ($STATE_DIRECTORY, set by the unit's StateDirectory=), else
// <user config dir>/computeflux, where an agent keeps its identity.
func relayStateDir(identity string, lookupEnv func(string) (string, bool)) (string, error) {
	if identity != "" {
		return filepath.Dir(identity), nil
	}
	if d, ok := lookupEnv("STATE_DIRECTORY"); ok && d != "" {
		d, _, _ = strings.Cut(d, ":") // several directories: the first is the unit's own
		return d, nil
	}
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "computeflux"), nil
}

// defaultLedgerFile is the ledger's file when --ledger-file is not given:
// in the relay's state directory, named after its identity file
// (relay.key: relay-usage.db), so that relays of several identities in one
// directory keep one ledger each; relay-usage.db without an identity. Two
// relays given the same file cannot share it: the second fails to start
// (bbolt locks the file).
func defaultLedgerFile(identity string, lookupEnv func(string) (string, bool)) (string, error) {
	dir, err := relayStateDir(identity, lookupEnv)
	if err != nil {
		return "", fmt.Errorf("no state directory for the usage ledger (%w): give --ledger-file FILE, or --ledger-file none to keep no ledger", err)
	}
	name := "relay"
	if identity != "" {
		base := filepath.Base(identity)
		if stem := strings.TrimSuffix(base, filepath.Ext(base)); stem != "" {
			name = stem
		}
	}
	return filepath.Join(dir, name+"-usage.db"), nil
}

// openLedger opens the usage ledger f names into cfg; the returned
// function closes it (a no-op without a ledger). A file that cannot be
// created, locked or written is a start-up error: a ledger that starts
// counting in memory only would lose the usage it was started to keep.
// (Once started, a ledger whose file fails keeps counting in memory and
// retries; see ledger.Open.)
func (f relayFiles) openLedger(cfg *relay.Config) (func(), error) {
	if f.ledger == "" {
		return func() {}, nil
	}
	hint := "give --ledger-file FILE for another place, or --ledger-file none to keep no ledger"
	if dir := filepath.Dir(f.ledger); dir != "" {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("relay: usage ledger %s: %w (%s)", f.ledger, err, hint)
		}
	}
	store, err := ledger.OpenBolt(f.ledger, ledger.DefaultMaxNames, ledger.DefaultMaxFileBytes)
	if err != nil {
		return nil, fmt.Errorf("relay: usage ledger: %w (%s)", err, hint)
	}
	l, err := ledger.Open(ledger.Config{Path: f.ledger, Store: store, FailClosed: f.failClose, Logger: cfg.Logger})
	if err != nil {
		_ = store.Close()
		return nil, fmt.Errorf("relay: usage ledger: %w", err)
	}
	cfg.Logger.Info().Str("file", f.ledger).Msg("usage ledger")
	cfg.Ledger = l
	return func() {
		if err := l.Close(); err != nil {
			cfg.Logger.Error().Err(err).Msg("closing the usage ledger")
		}
	}, nil
}

// isLoopbackListen reports whether addr listens on loopback only.
func isLoopbackListen(addr string) bool {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// relayConfig turns the command line, then COMPUTEFLUX_* environment
// variables for flags not given, into a relay.Config.
func relayConfig(args []string, lookupEnv func(string) (string, bool), stderr io.Writer) (relay.Config, relayFiles, error) {
	var cfg relay.Config
	var tf relayFiles
	var p2pListen, token, tokenFile, keysFile, clientsFile, policy string
	var nat natFlags
	var gossip gossipFlags
	var logs logFlags
	var ops operatorFlags
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Listen, "listen", relay.DefaultListen, "HTTP listen `address` for the OpenAI API (with --domain: HTTPS, default "+acmeHTTPSListen+")")
	fs.StringVar(&p2pListen, "p2p-listen", strings.Join(relay.DefaultP2PListen, ","), "comma-separated libp2p listen `multiaddrs` for agents")
	fs.StringVar(&cfg.IdentityFile, "identity", "", "Ed25519 identity `file` (created on first run; empty: ephemeral)")
	fs.StringVar(&token, "token", "", "agents' join `secret` (prefer --token-file)")
	fs.StringVar(&tokenFile, "token-file", "", "`file` holding the agents' join secret")
	fs.StringVar(&keysFile, "api-keys-file", "", "`file` of client API keys, one per line, # comments")
	fs.BoolVar(&cfg.NoAuth, "no-auth", false, "serve clients without API keys")
	fs.StringVar(&clientsFile, "clients-file", "", "YAML `file` naming clients (several keys each) with their weight, class and budget; its keys are accepted too")
	fs.DurationVar(&cfg.QueueWait, "queue-wait", relay.DefaultQueueWait, "longest wait at the relay for an agent with room, before an overflow tier or 429 (negative: no queue, 503 at once)")
	fs.IntVar(&cfg.PrefillLimit, "prefill-limit", relay.DefaultPrefillLimit, "prompt `tokens` of streamed requests' prefill one agent may have queued before further requests wait at the relay for the agent that frees first (negative: no limit)")
	fs.DurationVar(&cfg.RestartHold, "restart-hold", relay.DefaultRestartHold, "longest wait of a request that arrives before any agent has joined")
	fs.IntVar(&cfg.MaxQueued, "max-queued", scheduler.DefaultMaxQueued, "most requests waiting for room in all")
	fs.IntVar(&cfg.MaxQueuedPerClient, "max-queued-per-client", scheduler.DefaultMaxQueuedPerFlow, "most requests one client may have waiting for room, per model")
	fs.StringVar(&cfg.AddrFile, "addr-file", "", "write the relay's dialable multiaddrs to this `file` once listening")
	fs.StringVar(&policy, "policy", "sticky", "routing `policy`: sticky (session affinity, then prompt prefix), or for comparison round-robin, random, least-loaded, consistent-hash, prefix-hash, dualmap, sglang")
	fs.IntVar(&cfg.MaxAttempts, "max-attempts", relay.DefaultMaxAttempts, "agents tried per request before its first byte")
	fs.DurationVar(&cfg.TTFBTimeout, "ttfb-timeout", relay.DefaultTTFBTimeout, "longest wait for an agent's first response byte")
	fs.DurationVar(&cfg.IdleTimeout, "idle-timeout", relay.DefaultIdleTimeout, "longest gap between streamed chunks")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body", relay.DefaultMaxBodyBytes, "largest request body in `bytes`")
	fs.IntVar(&cfg.KeyRPM, "key-rpm", 0, "inference requests one API key may start per minute (0: unlimited)")
	fs.IntVar(&cfg.KeyConcurrency, "key-concurrency", 0, "inference requests one API key may have in flight (0: unlimited)")
	fs.StringVar(&cfg.MetricsKey, "metrics-key", "", "bearer `key` required on /metrics (empty: /metrics is public)")
	fs.StringVar(&tf.cert, "tls-cert", "", "serve HTTPS with this PEM certificate chain `file` (with --tls-key)")
	fs.StringVar(&tf.key, "tls-key", "", "PEM private key `file` for --tls-cert")
	var acmeF acmeFlags
	acmeF.register(fs)
	fs.StringVar(&tf.ledger, "ledger-file", "", "usage ledger `file` (bbolt; created if absent): who used and served what, and clients' budgets (default: <identity file's stem>-usage.db beside --identity, else relay-usage.db in $STATE_DIRECTORY or <user config dir>/computeflux; none: no ledger)")
	fs.BoolVar(&tf.failClose, "ledger-fail-closed", false, "refuse clients with a budget while the ledger cannot write its file (default: serve them on the counts in memory)")
	ops.register(fs)
	nat.register(fs)
	gossip.register(fs)
	var peerRelays listFlag
	fs.Var(&peerRelays, "peer-relay", "another relay's `multiaddr` (ending in /p2p/<peer ID>, same join secret) to share sessions and gossip with from the start; "+
		"relays also learn each other from the agents that joined them, but only relays named here share clients' spending for budgets; repeatable or comma-separated")
	fs.DurationVar(&cfg.WarmUp, "warm-up", 0, "after a start, accept clients only once agents have rejoined, waiting at most this `long` (with several relays behind one name: 3s; 0: at once)")
	fs.BoolVar(&cfg.Peers.Disabled, "no-peer-relays", false, "share no sessions with other relays (ignore the relays agents name)")
	fs.BoolVar(&cfg.Audit.Disabled, "no-audits", false, "do not audit what agents run (audits compare agents' answers to the same prompt; see docs/audits.md)")
	fs.Float64Var(&cfg.Audit.Share, "audit-share", 0, "audit tokens as a `share` of the tokens served to clients (0: 0.02; negative: only new agents, the floor and quarantine re-audits)")
	fs.DurationVar(&cfg.Audit.FloorEvery, "audit-floor", 0, "audit every agent and model at least this `often`, budget or not (0: 10m)")
	fs.Func("audit-independence", "which agents count as one voice in audits: `network` (the default: an IPv4 /24 or IPv6 /48), address, or agent (every agent its own; for agents the operator knows)", func(v string) error {
		in, err := audit.ParseIndependence(v)
		cfg.Audit.Independence = in
		return err
	})
	fs.Var(&gossip.relays, "gossip-relay", "another relay's `multiaddr` (ending in /p2p/<peer ID>) to share membership gossip with; repeatable or comma-separated")
	logs.register(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, tf, err
	}
	if fs.NArg() > 0 {
		return cfg, tf, fmt.Errorf("relay: unexpected arguments %q", fs.Args())
	}
	if err := flagsFromEnv(fs, lookupEnv); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	if tf.acme, err = acmeF.config(cfg.IdentityFile, given, tf, lookupEnv); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	if tf.acme != nil {
		if !given["listen"] {
			cfg.Listen = acmeHTTPSListen
		}
		tf.httpListen = cmp.Or(acmeF.httpListen, acmeHTTPListen)
	}

	for _, a := range strings.Split(p2pListen, ",") {
		if a = strings.TrimSpace(a); a != "" {
			cfg.P2PListen = append(cfg.P2PListen, a)
		}
	}
	secret, err := joinSecret(token, tokenFile)
	if err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	cfg.Token = secret
	if keysFile != "" {
		keys, err := relay.LoadAPIKeys(keysFile)
		if err != nil {
			return cfg, tf, fmt.Errorf("relay: %w", err)
		}
		if len(keys) == 0 {
			return cfg, tf, fmt.Errorf("relay: --api-keys-file %s holds no keys", keysFile)
		}
		cfg.APIKeys = keys
	}
	if clientsFile != "" {
		cf, err := relay.LoadClientsFile(clientsFile)
		if err != nil {
			return cfg, tf, fmt.Errorf("relay: %w", err)
		}
		cfg.Clients = cf
	}
	switch tf.ledger {
	case noLedger:
		tf.ledger = ""
	case "":
		if tf.ledger, err = defaultLedgerFile(cfg.IdentityFile, lookupEnv); err != nil {
			return cfg, tf, fmt.Errorf("relay: %w", err)
		}
	}
	if cfg.Clients != nil && tf.ledger == "" {
		if !cfg.Clients.Default.Budget.Unlimited() {
			return cfg, tf, errors.New("relay: --clients-file gives keys without a client a budget: budgets need the usage ledger (--ledger-file none turns it off)")
		}
		for _, c := range cfg.Clients.Clients {
			if !c.Budget.Unlimited() {
				return cfg, tf, fmt.Errorf("relay: --clients-file gives client %q a budget: budgets need the usage ledger (--ledger-file none turns it off)", c.Name)
			}
		}
	}
	if len(cfg.APIKeys) == 0 && !cfg.NoAuth && (cfg.Clients == nil || len(cfg.Clients.Clients) == 0) {
		return cfg, tf, errors.New("relay: no client API keys: give --api-keys-file or --clients-file, or --no-auth to serve anyone")
	}
	p, err := scheduler.ParsePolicy(policy)
	if err != nil {
		return cfg, tf, fmt.Errorf("relay: --policy: %w", err)
	}
	if cfg.PublicCIDRs, err = nat.publicCIDRs(); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	if cfg.Gossip, err = gossip.relayConfig(); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	for _, s := range peerRelays {
		ai, err := peer.AddrInfoFromString(s)
		if err != nil {
			return cfg, tf, fmt.Errorf("relay: --peer-relay %q (a multiaddr ending in /p2p/<peer ID>): %w", s, err)
		}
		cfg.Peers.Relays = append(cfg.Peers.Relays, *ai)
	}
	cfg.Policy = p
	if err := ops.apply(&cfg); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	var reqLogger zerolog.Logger
	if cfg.Logger, reqLogger, err = logs.loggers(stderr, true); err != nil {
		return cfg, tf, fmt.Errorf("relay: %w", err)
	}
	cfg.RequestLogger = &reqLogger
	if (tf.cert == "") != (tf.key == "") {
		return cfg, tf, errors.New("relay: give both --tls-cert and --tls-key, or neither")
	}
	return cfg, tf, nil
}
