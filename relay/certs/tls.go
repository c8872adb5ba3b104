// Package certs gives a relay's API listener its HTTPS: clients send their
// API keys in every request, so a relay reachable from the internet must
// serve HTTPS, itself or behind a TLS proxy. NewTLSListener serves
// certificate files and picks up renewed ones (tls.go); ACME obtains and
// renews certificates itself (acme.go).
package certs

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"
)

// certCheckInterval is how often a TLS listener looks for a renewed
// certificate on disk (e.g. after certbot ran).
const certCheckInterval = time.Minute

// NewTLSListener wraps ln so that it serves TLS (1.2 and later) with the
// certificate chain and key in certFile and keyFile (PEM). Serve the result
// with relay.Relay.Serve. The files are read now, so a bad pair fails at start;
// afterwards a changed pair is picked up for new connections within about a
// minute, without a restart. HTTP/1.1 is offered (not HTTP/2).
func NewTLSListener(ln net.Listener, certFile, keyFile string) (net.Listener, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("relay: TLS needs both a certificate and a key file")
	}
	cr := &certReloader{certFile: certFile, keyFile: keyFile}
	if err := cr.load(); err != nil {
		return nil, err
	}
	cfg := &tls.Config{
		MinVersion:     tls.VersionTLS12,
		NextProtos:     []string{"http/1.1"},
		GetCertificate: cr.get,
	}
	return tls.NewListener(ln, cfg), nil
}

// certReloader holds a certificate and re-reads its files when they change.
type certReloader struct {
	certFile, keyFile string

	mu      sync.Mutex // guards the following fields
	cert    *tls.Certificate
	mtime   time.Time // newest modification time of the two files when loaded
	checked time.Time // when the files were last looked at
}

func (c *certReloader) load() error {
	mt, err := newestMtime(c.certFile, c.keyFile)
	if err != nil {
		return fmt.Errorf("relay: TLS: %w", err)
	}
	cert, err := tls.LoadX509KeyPair(c.certFile, c.keyFile)
	if err != nil {
		return fmt.Errorf("relay: TLS: %w", err)
	}
	c.mu.Lock()
	c.cert, c.mtime, c.checked = &cert, mt, time.Now()
	c.mu.Unlock()
	return nil
}

// get returns the current certificate; a failed reload keeps the old one.
func (c *certReloader) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	c.mu.Lock()
	cert, stale := c.cert, time.Since(c.checked) > certCheckInterval
	if stale {
		c.checked = time.Now()
	}
	mt := c.mtime
	c.mu.Unlock()
	if stale {
		if now, err := newestMtime(c.certFile, c.keyFile); err == nil && now.After(mt) {
			if c.load() == nil {
				c.mu.Lock()
				cert = c.cert
				c.mu.Unlock()
			}
		}
	}
	return cert, nil
}

func newestMtime(files ...string) (time.Time, error) {
	var t time.Time
	for _, f := range files {
		fi, err := os.Stat(f)
		if err != nil {
			return time.Time{}, err
		}
		if fi.ModTime().After(t) {
			t = fi.ModTime()
		}
	}
	return t, nil
}
