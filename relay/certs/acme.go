package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/crypto/acme"
	"golang.org/x/crypto/acme/autocert"

	"github.com/computeflux/computeflux/transport"
)

// ACMEConfig configures a relay that obtains and renews its own
// certificates by ACME (RFC 8555), e.g. from Let's Encrypt.
type ACMEConfig struct {
	// Domains are the names the certificate is for (at least one). Only
	// these are ever asked for: a TLS client naming another host gets no
	// certificate, and one naming none gets Domains[0]'s.
	Domains []string
	// CacheDir keeps the ACME account key and the certificates, so that a
	// restart does not ask the CA again. Created (0700) if absent; it must
	// be writable.
	CacheDir string
	// DirectoryURL is the CA's ACME directory. Empty means Let's Encrypt's
	// production directory (autocert.DefaultACMEDirectory).
	DirectoryURL string
	// Email, if set, is given to the CA as the account's contact (expiry
	// and policy notices).
	Email string
	// RootCAs, if set, are the roots trusted for the CA's own HTTPS (a
	// private or test CA, such as Pebble); nil means the system's.
	RootCAs *x509.CertPool
	// RenewBefore is how long before a certificate expires it is renewed,
	// at most 30 days. Zero means a third of its lifetime, at most 30 days.
	RenewBefore time.Duration
	// ReadHeaderTimeout bounds how long the plain-HTTP side (ServeHTTP)
	// waits for a request's headers: the relay gives the one of its API
	// listener. It must be positive.
	ReadHeaderTimeout time.Duration
	// Logger gets the certificates obtained and the errors.
	Logger zerolog.Logger
}

// ACME obtains certificates for a relay's HTTPS listener (Listener) and
// renews them before they expire, while the process runs: new connections
// get the renewed certificate without a restart. The CA checks that the
// relay holds the names by connecting to them: on port 443 (tls-alpn-01,
// answered by Listener) and, once ServeHTTP has started, on port 80
// (http-01). The CA's terms of service are accepted on the operator's
// behalf.
type ACME struct {
	cfg     ACMEConfig
	m       *autocert.Manager
	tr      *http.Transport
	stopped atomic.Bool // set by Close: the ACME client's requests fail at once
	wg      sync.WaitGroup
}

// NewACME checks cfg and prepares its cache directory. A directory that
// cannot be created or written is an error now rather than at the first
// certificate.
func NewACME(cfg ACMEConfig) (*ACME, error) {
	if len(cfg.Domains) == 0 {
		return nil, errors.New("relay: ACME needs at least one domain")
	}
	for i, d := range cfg.Domains {
		n, err := CheckDomain(d)
		if err != nil {
			return nil, fmt.Errorf("relay: ACME: %w", err)
		}
		cfg.Domains[i] = n
	}
	if cfg.DirectoryURL == "" {
		cfg.DirectoryURL = autocert.DefaultACMEDirectory
	}
	if u, err := url.Parse(cfg.DirectoryURL); err != nil || u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("relay: ACME directory %q: want an https:// URL", cfg.DirectoryURL)
	}
	if cfg.RenewBefore < 0 {
		return nil, errors.New("relay: ACME renew-before must not be negative")
	}
	if cfg.ReadHeaderTimeout <= 0 {
		return nil, errors.New("relay: ACME needs a positive header timeout")
	}
	if err := writableDir(cfg.CacheDir); err != nil {
		return nil, fmt.Errorf("relay: ACME certificate cache: %w", err)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	// A few requests a renewal: no connection kept, none left behind by
	// one under way at Close.
	tr.DisableKeepAlives = true
	tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: cfg.RootCAs}
	a := &ACME{cfg: cfg, tr: tr}
	whitelist := autocert.HostWhitelist(cfg.Domains...)
	a.m = &autocert.Manager{
		Prompt: autocert.AcceptTOS,
		Cache:  loggingCache{Cache: autocert.DirCache(cfg.CacheDir), log: cfg.Logger},
		// The CA's http-01 request names the host with a port when the
		// challenge is not on 80 (a test CA); the name alone is checked.
		HostPolicy: func(ctx context.Context, host string) error {
			if h, _, err := net.SplitHostPort(host); err == nil {
				host = h
			}
			return whitelist(ctx, host)
		},
		RenewBefore: cfg.RenewBefore,
		Email:       cfg.Email,
		Client: &acme.Client{
			DirectoryURL: cfg.DirectoryURL,
			HTTPClient:   &http.Client{Transport: stoppable{a}},
			UserAgent:    "computeflux-relay",
		},
	}
	return a, nil
}

// CheckDomain returns name in the form a certificate is asked for (lower
// case, no trailing dot) or says why it cannot be one: an ACME CA
// validates DNS names of two or more labels, not addresses or wildcards
// (which http-01 and tls-alpn-01 cannot prove).
func CheckDomain(name string) (string, error) {
	n := strings.ToLower(strings.TrimSuffix(strings.TrimSpace(name), "."))
	switch {
	case n == "":
		return "", errors.New("empty domain name")
	case net.ParseIP(n) != nil:
		return "", fmt.Errorf("domain %q is an address: certificates by ACME are for DNS names", name)
	case strings.Contains(n, "*"):
		return "", fmt.Errorf("domain %q: wildcards need the dns-01 challenge, which the relay does not answer", name)
	case len(n) > 253:
		return "", fmt.Errorf("domain %q is longer than 253 characters", name)
	case !strings.Contains(n, "."):
		return "", fmt.Errorf("domain %q has a single label: give the full name, e.g. relay.example.com", name)
	}
	for _, label := range strings.Split(n, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return "", fmt.Errorf("domain %q: label %q is empty, longer than 63 characters, or starts or ends with '-'", name, label)
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return "", fmt.Errorf("domain %q: %q is not a letter, digit or '-' (give an international name in its xn-- form)", name, c)
			}
		}
	}
	return n, nil
}

// writableDir creates dir (0700) if need be and checks that a file can be
// written in it.
func writableDir(dir string) error {
	if dir == "" {
		return errors.New("no directory")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".write-check-*")
	if err != nil {
		return err
	}
	name := f.Name()
	err = errors.Join(f.Close(), os.Remove(name))
	if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	return nil
}

// Listener wraps ln so that it serves TLS (1.2 and later) with the ACME
// certificates, obtaining one at a client's first handshake if none is
// cached yet (Start asks ahead). HTTP/1.1 is offered (not HTTP/2), and
// acme-tls/1 for the CA's tls-alpn-01 check.
func (a *ACME) Listener(ln net.Listener) net.Listener {
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1", acme.ALPNProto},
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			if hello.ServerName == "" { // a client dialling the address
				h := *hello
				h.ServerName = a.cfg.Domains[0]
				hello = &h
			}
			return a.m.GetCertificate(hello)
		},
	}
	return tls.NewListener(ln, cfg)
}

// Start obtains the certificates in the background, so that the first
// client does not wait for the CA, and logs the outcome. Until Close.
func (a *ACME) Start() {
	for _, d := range a.cfg.Domains {
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			// What a current client offers: an ECDSA certificate, the
			// one autocert prefers and keeps apart from an RSA one.
			cert, err := a.m.GetCertificate(&tls.ClientHelloInfo{
				ServerName:        d,
				CipherSuites:      []uint16{tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256},
				SupportedCurves:   []tls.CurveID{tls.CurveP256},
				SignatureSchemes:  []tls.SignatureScheme{tls.ECDSAWithP256AndSHA256},
				SupportedVersions: []uint16{tls.VersionTLS13, tls.VersionTLS12},
			})
			if a.stopped.Load() {
				return
			}
			if err != nil {
				a.cfg.Logger.Error().Err(err).Str("domain", d).Str("acme_directory", a.cfg.DirectoryURL).
					Msg("no certificate yet: the CA must reach this host by that name on port 80 (http-01) or 443 (tls-alpn-01); retried at the next HTTPS connection")
				return
			}
			ev := a.cfg.Logger.Info().Str("domain", d)
			if cert.Leaf != nil {
				ev = ev.Str("serial", cert.Leaf.SerialNumber.Text(16)).Time("not_after", cert.Leaf.NotAfter)
			}
			ev.Msg("certificate ready")
		}()
	}
}

// ServeHTTP serves plain HTTP on ln until ctx ends: the CA's http-01
// challenges, and a permanent redirect (308) to the same host and path
// over HTTPS on httpsPort (0: 443) for everything else.
func (a *ACME) ServeHTTP(ctx context.Context, ln net.Listener, httpsPort int) error {
	redirect := func(w http.ResponseWriter, r *http.Request) { a.redirect(w, r, httpsPort) }
	srv := &http.Server{
		Handler:           a.m.HTTPHandler(http.HandlerFunc(redirect)),
		ReadHeaderTimeout: a.cfg.ReadHeaderTimeout,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       time.Minute,
		MaxHeaderBytes:    8 << 10,
		ErrorLog:          transport.ServerLog(a.cfg.Logger.With().Str("source", "acme-http").Logger(), func() {}),
	}
	a.cfg.Logger.Info().Str("addr", ln.Addr().String()).Msg("relay http listening: ACME http-01 challenges, redirects to https")
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("relay: http: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	<-errc
	return nil
}

// redirect sends a client to the HTTPS side: the host it named if it is
// one of the domains, else the first domain.
func (a *ACME) redirect(w http.ResponseWriter, r *http.Request, httpsPort int) {
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	known := false
	for _, d := range a.cfg.Domains {
		known = known || d == host
	}
	if !known {
		host = a.cfg.Domains[0]
	}
	if httpsPort != 0 && httpsPort != 443 {
		host = net.JoinHostPort(host, strconv.Itoa(httpsPort))
	}
	http.Redirect(w, r, "https://"+host+r.URL.RequestURI(), http.StatusPermanentRedirect)
}

// Close stops the ACME client: a renewal or first certificate still under
// way fails (the certificates in the cache stay valid for the next start),
// and Start's goroutines are waited for.
func (a *ACME) Close() {
	a.stopped.Store(true)
	a.tr.CloseIdleConnections()
	a.wg.Wait()
	a.tr.CloseIdleConnections()
}

// stoppable is the ACME client's transport: a's, refusing once a is
// closed (autocert has no way to stop its renewal timers).
type stoppable struct{ a *ACME }

var errACMEStopped = errors.New("relay: ACME client stopped")

func (s stoppable) RoundTrip(req *http.Request) (*http.Response, error) {
	if s.a.stopped.Load() {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, errACMEStopped
	}
	return s.a.tr.RoundTrip(req)
}

// loggingCache logs every certificate autocert stores: the first one for
// a name and each renewal.
type loggingCache struct {
	autocert.Cache
	log zerolog.Logger
}

func (c loggingCache) Put(ctx context.Context, key string, data []byte) error {
	err := c.Cache.Put(ctx, key, data)
	if strings.HasSuffix(key, "+token") { // a tls-alpn-01 answer, not a certificate to serve
		return err
	}
	if leaf := firstCert(data); leaf != nil {
		ev := c.log.Info()
		if err != nil {
			ev = c.log.Error().Err(err)
		}
		ev.Str("cache_key", key).Strs("names", leaf.DNSNames).Str("serial", leaf.SerialNumber.Text(16)).
			Time("not_before", leaf.NotBefore).Time("not_after", leaf.NotAfter).Str("issuer", leaf.Issuer.CommonName).
			Msg("new certificate from the ACME CA")
	}
	return err
}

// firstCert is the first certificate in a cache entry (PEM key, then the
// chain), or nil (the account key, a challenge token).
func firstCert(data []byte) *x509.Certificate {
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			return nil
		}
		if b.Type == "CERTIFICATE" {
			c, err := x509.ParseCertificate(b.Bytes)
			if err != nil {
				return nil
			}
			return c
		}
	}
}
