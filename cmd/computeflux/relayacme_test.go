package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/ports"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// The relay's own certificates by ACME, against a real ACME CA: Pebble,
// Let's Encrypt's test server (a tool dependency in go.mod), run as a
// process on loopback. Pebble checks the names by real http-01 requests
// to the relay's --http-listen port, resolving them through a small DNS
// server of the test's; its certificates live 30 s, so that the relay
// (--acme-renew-before 27s) renews them within the test, without a
// restart, and a new connection sees the new serial.
func TestRelayACMECertificatesFromPebble(t *testing.T) {
	slow.Gate(t, "builds and runs Pebble, a test ACME server")
	const (
		domain    = "relay.computeflux.test"
		domain2   = "api.computeflux.test"
		validity  = 30 // seconds, Pebble's certificates
		renewLead = "27s"
	)
	dir := t.TempDir()

	// Pebble's own HTTPS (its ACME API and management interface) with a
	// CA of the test's: the relay trusts it through --acme-ca-file.
	caFile := writeTestCA(t, dir)
	dnsAddr := serveTestDNS(t, map[string]bool{domain: true, domain2: true})
	httpsAddr, httpAddr := ports.Free(t, "tcp"), ports.Free(t, "tcp")
	acmeAddr, mgmtAddr := ports.Free(t, "tcp"), ports.Free(t, "tcp")
	_, httpPort, _ := net.SplitHostPort(httpAddr)
	_, httpsPort, _ := net.SplitHostPort(httpsAddr)
	// tls-alpn-01, which autocert tries first, goes to a closed port:
	// the certificates must come through http-01 on --http-listen.
	_, closedPort, _ := net.SplitHostPort(ports.Free(t, "tcp"))
	pebbleLog := startPebble(t, dir, dnsAddr, map[string]any{
		"listenAddress":           acmeAddr,
		"managementListenAddress": mgmtAddr,
		"certificate":             filepath.Join(dir, "pebble-cert.pem"),
		"privateKey":              filepath.Join(dir, "pebble-key.pem"),
		"httpPort":                mustAtoi(t, httpPort),
		"tlsPort":                 mustAtoi(t, closedPort),
		"profiles":                map[string]any{"default": map[string]any{"description": "short-lived, for renewals", "validityPeriod": validity}},
	})
	// Every wait from here on: Pebble up, two certificates, a renewal.
	deadline := time.Now().Add(60 * time.Second)
	roots := pebbleRoots(t, caFile, mgmtAddr, deadline)

	var logs lockedBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runRelay(ctx, []string{"--token", "t", "--no-auth", "--ledger-file", "none",
			"--listen", httpsAddr, "--http-listen", httpAddr, "--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1",
			"--identity", filepath.Join(dir, "relay.key"),
			"--domain", domain + ",API.computeflux.test.", "--domain", domain,
			"--acme-directory", "https://" + acmeAddr + "/dir", "--acme-ca-file", caFile,
			"--acme-email", "ops@computeflux.test", "--acme-renew-before", renewLead,
			"--log-format", "json"}, io.Discard, &logs)
	}()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("relay: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("the relay did not stop within 30 s")
		}
	}
	defer func() {
		stop()
		if t.Failed() {
			t.Logf("relay log:\n%s\npebble log:\n%s", logs.String(), pebbleLog.String())
		}
	}()

	// A verified handshake: Pebble's root, the domain's name.
	get := func(name string) (*x509.Certificate, error) {
		c := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
			DisableKeepAlives: true, // every call a fresh TLS connection
			TLSClientConfig:   &tls.Config{RootCAs: roots, ServerName: name},
		}}
		resp, err := c.Get("https://" + httpsAddr + "/healthz")
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || !bytes.Contains(body, []byte(`"ok"`)) {
			return nil, fmt.Errorf("GET /healthz: %s %s", resp.Status, body)
		}
		return resp.TLS.PeerCertificates[0], nil
	}
	waitCert := func(what, name string, ok func(*x509.Certificate) bool) *x509.Certificate {
		t.Helper()
		var last error
		for time.Now().Before(deadline) {
			cert, err := get(name)
			if err == nil && ok(cert) {
				return cert
			}
			if err != nil {
				last = err
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Fatalf("%s: none by the deadline; last error: %v", what, last)
		return nil
	}
	anyCert := func(*x509.Certificate) bool { return true }
	first := waitCert("a certificate for "+domain+" that verifies against Pebble's root", domain, anyCert)
	if first.Subject.CommonName != domain && !containsString(first.DNSNames, domain) {
		t.Fatalf("the certificate names %v, not %s", first.DNSNames, domain)
	}
	if life := first.NotAfter.Sub(first.NotBefore); life > time.Minute {
		t.Fatalf("the certificate lives %v: not Pebble's short-lived one", life)
	}
	second := waitCert("a certificate for "+domain2, domain2, anyCert)
	if !containsString(second.DNSNames, domain2) {
		t.Fatalf("the certificate for %s names %v", domain2, second.DNSNames)
	}
	if !strings.Contains(pebbleLog.String(), "Attempting to validate w/ HTTP: http://"+domain+":"+httpPort+"/.well-known/acme-challenge/") {
		t.Fatal("Pebble made no http-01 request to --http-listen")
	}
	// A name not given to --domain gets no certificate.
	if _, err := get("other.computeflux.test"); err == nil {
		t.Fatal("a TLS client naming another host got a certificate")
	}

	// Renewal, without a restart: a new connection, a new serial.
	renewed := waitCert("a renewed certificate (a new serial on a new connection)", domain, func(c *x509.Certificate) bool {
		return c.SerialNumber.Cmp(first.SerialNumber) != 0
	})
	if !renewed.NotAfter.After(first.NotAfter) {
		t.Fatalf("the renewed certificate expires %v, the first %v", renewed.NotAfter, first.NotAfter)
	}
	// autocert's own default renews with a third of the 30 s left (20 s
	// in); --acme-renew-before 27s, 3 to 6 s in.
	if gap := renewed.NotBefore.Sub(first.NotBefore); gap > 15*time.Second {
		t.Fatalf("renewed %v after the first certificate: --acme-renew-before %s was not in force", gap, renewLead)
	}
	if !strings.Contains(logs.String(), "new certificate from the ACME CA") {
		t.Fatal("the relay logged no new certificate")
	}
	if _, err := os.Stat(filepath.Join(dir, "acme", domain)); err != nil {
		t.Fatalf("the certificate cache beside the identity file: %v", err)
	}

	// Plain HTTP redirects to the same host and path over HTTPS.
	req, err := http.NewRequest(http.MethodGet, "http://"+httpAddr+"/v1/models?limit=2", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = domain
	noFollow := &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noFollow.Do(req)
	if err != nil {
		t.Fatalf("http://: %v", err)
	}
	resp.Body.Close()
	want := "https://" + domain + ":" + httpsPort + "/v1/models?limit=2"
	if resp.StatusCode != http.StatusPermanentRedirect || resp.Header.Get("Location") != want {
		t.Fatalf("http:// answered %s, Location %q; want 308 to %q", resp.Status, resp.Header.Get("Location"), want)
	}
	stop()
}

// The --domain flags: defaults of --listen and --http-listen, and the
// mistakes refused before anything starts.
func TestRelayDomainFlags(t *testing.T) {
	none := func(string) (string, bool) { return "", false }
	dir := t.TempDir()
	id := filepath.Join(dir, "relay.key")
	base := []string{"--token", "t", "--no-auth", "--ledger-file", "none", "--identity", id}
	parse := func(env func(string) (string, bool), args ...string) (string, relayFiles, error) {
		cfg, tf, err := relayConfig(append(append([]string{}, base...), args...), env, io.Discard)
		return cfg.Listen, tf, err
	}

	listen, tf, err := parse(none)
	if err != nil || listen != ":8080" || tf.acme != nil {
		t.Fatalf("without --domain: listen %q, acme %v, %v", listen, tf.acme, err)
	}
	listen, tf, err = parse(none, "--domain", "Relay.Example.com.,b.example.com", "--domain", "relay.example.com")
	if err != nil {
		t.Fatal(err)
	}
	if listen != ":443" || tf.httpListen != ":80" {
		t.Fatalf("with --domain: listen %q, http-listen %q; want :443, :80", listen, tf.httpListen)
	}
	if got := strings.Join(tf.acme.Domains, ","); got != "relay.example.com,b.example.com" {
		t.Fatalf("domains %q", got)
	}
	if tf.acme.CacheDir != filepath.Join(dir, "acme") {
		t.Fatalf("cache %q, want acme/ beside the identity file", tf.acme.CacheDir)
	}
	if tf.acme.DirectoryURL != "https://acme-v02.api.letsencrypt.org/directory" {
		t.Fatalf("directory %q", tf.acme.DirectoryURL)
	}
	listen, _, err = parse(none, "--domain", "relay.example.com", "--listen", ":8443")
	if err != nil || listen != ":8443" {
		t.Fatalf("an explicit --listen: %q, %v", listen, err)
	}
	env := func(k string) (string, bool) {
		if k == "COMPUTEFLUX_LISTEN" {
			return "127.0.0.1:9443", true
		}
		return "", false
	}
	listen, _, err = parse(env, "--domain", "relay.example.com")
	if err != nil || listen != "127.0.0.1:9443" {
		t.Fatalf("COMPUTEFLUX_LISTEN: %q, %v", listen, err)
	}
	// Without an identity file: $STATE_DIRECTORY/acme.
	stateEnv := func(k string) (string, bool) {
		if k == "STATE_DIRECTORY" {
			return "/var/lib/computeflux", true
		}
		return "", false
	}
	_, tf, err = relayConfig([]string{"--token", "t", "--no-auth", "--ledger-file", "none", "--domain", "relay.example.com"}, stateEnv, io.Discard)
	if err != nil || tf.acme.CacheDir != "/var/lib/computeflux/acme" {
		t.Fatalf("cache without an identity: %+v, %v", tf.acme, err)
	}

	cert := filepath.Join(dir, "c.pem")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--domain", "relay.example.com", "--tls-cert", cert, "--tls-key", cert}, "not both"},
		{[]string{"--domain", ""}, "empty"},
		{[]string{"--domain", " , "}, "empty"},
		{[]string{"--domain", "localhost"}, "single label"},
		{[]string{"--domain", "192.0.2.7"}, "address"},
		{[]string{"--domain", "*.example.com"}, "wildcard"},
		{[]string{"--domain", "relay_1.example.com"}, "not a letter"},
		{[]string{"--domain", "-relay.example.com"}, "starts or ends"},
		{[]string{"--domain", "relay.example.com", "--acme-directory", "http://ca.example/dir"}, "https://"},
		{[]string{"--domain", "relay.example.com", "--acme-email", "nobody"}, "--acme-email"},
		{[]string{"--domain", "relay.example.com", "--acme-renew-before", "-1h"}, "negative"},
		{[]string{"--domain", "relay.example.com", "--acme-ca-file", cert}, "--acme-ca-file"},
		{[]string{"--acme-email", "ops@example.com"}, "needs --domain"},
		{[]string{"--http-listen", ":80"}, "needs --domain"},
	} {
		_, _, err := parse(none, c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v; want an error saying %q", c.args, err, c.want)
		}
	}
	if err := os.WriteFile(cert, []byte("not PEM\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := parse(none, "--domain", "relay.example.com", "--acme-ca-file", cert); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Errorf("a CA file without certificates: %v", err)
	}
}

// A cache directory the relay cannot write is a start-up error that names it.
func TestRelayDomainUnwritableCache(t *testing.T) {
	dir := t.TempDir()
	// A file where the directory should be: even root cannot create it.
	if err := os.WriteFile(filepath.Join(dir, "acme"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := runRelay(ctx, []string{"--token", "t", "--no-auth", "--ledger-file", "none", "--identity", filepath.Join(dir, "relay.key"),
		"--domain", "relay.example.com", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
		"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--log-format", "json"}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "certificate cache") || !strings.Contains(err.Error(), filepath.Join(dir, "acme")) {
		t.Fatalf("runRelay: %v; want a certificate cache error naming %s", err, filepath.Join(dir, "acme"))
	}
}

func containsString(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// writeTestCA writes a CA (ca.pem, returned) and, signed by it, Pebble's
// HTTPS certificate for 127.0.0.1 and localhost (pebble-cert.pem,
// pebble-key.pem) into dir.
func writeTestCA(t *testing.T, dir string) string {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "computeflux test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "pebble"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, typ string, der []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("ca.pem", "CERTIFICATE", caDER)
	write("pebble-cert.pem", "CERTIFICATE", leafDER)
	write("pebble-key.pem", "PRIVATE KEY", keyDER)
	return filepath.Join(dir, "ca.pem")
}

// serveTestDNS answers DNS queries over TCP on loopback (Pebble's resolver
// asks over TCP) until the test ends: an A query for one of names gets
// 127.0.0.1, any other type for them no records, other names NXDOMAIN.
func serveTestDNS(t *testing.T, names map[string]bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				for {
					_ = c.SetDeadline(time.Now().Add(5 * time.Second))
					var n [2]byte
					if _, err := io.ReadFull(c, n[:]); err != nil {
						return
					}
					q := make([]byte, binary.BigEndian.Uint16(n[:]))
					if _, err := io.ReadFull(c, q); err != nil {
						return
					}
					a := dnsAnswer(q, names)
					if a == nil {
						return
					}
					if _, err := c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(a))), a...)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// dnsAnswer is the response to the DNS query q (one question), nil if q
// is malformed.
func dnsAnswer(q []byte, names map[string]bool) []byte {
	if len(q) < 12 || binary.BigEndian.Uint16(q[4:6]) != 1 {
		return nil
	}
	var labels []string
	i := 12
	for {
		if i >= len(q) {
			return nil
		}
		l := int(q[i])
		i++
		if l == 0 {
			break
		}
		if l > 63 || i+l > len(q) {
			return nil
		}
		labels = append(labels, strings.ToLower(string(q[i:i+l])))
		i += l
	}
	if i+4 > len(q) {
		return nil
	}
	qtype := binary.BigEndian.Uint16(q[i : i+2])
	question := q[12 : i+4]
	known := names[strings.Join(labels, ".")]
	rcode := byte(0)
	if !known {
		rcode = 3 // NXDOMAIN
	}
	answers := uint16(0)
	if known && qtype == 1 {
		answers = 1
	}
	r := append([]byte{}, q[0:2]...)              // ID
	r = append(r, 0x84|q[2]&0x01, rcode)          // QR, AA, RD as asked; RCODE
	r = binary.BigEndian.AppendUint16(r, 1)       // QDCOUNT
	r = binary.BigEndian.AppendUint16(r, answers) // ANCOUNT
	r = append(r, 0, 0, 0, 0)                     // NSCOUNT, ARCOUNT
	r = append(r, question...)                    //
	if answers == 1 {                             // the name (a pointer to the question's), A, IN, TTL 60, 127.0.0.1
		r = append(r, 0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 127, 0, 0, 1)
	}
	return r
}

// startPebble builds Pebble (go tool, from go.mod's tool line) and runs it
// with config until the test ends, resolving names through dnsAddr. Its
// output is returned.
func startPebble(t *testing.T, dir, dnsAddr string, config map[string]any) *lockedBuffer {
	t.Helper()
	out, err := exec.Command("go", "tool", "-n", "pebble").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("building pebble (go tool -n pebble): %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("building pebble (go tool -n pebble): %v", err)
	}
	bin := strings.TrimSpace(string(out))
	b, err := json.Marshal(map[string]any{"pebble": config})
	if err != nil {
		t.Fatal(err)
	}
	cfgFile := filepath.Join(dir, "pebble.json")
	if err := os.WriteFile(cfgFile, b, 0o600); err != nil {
		t.Fatal(err)
	}
	var logs lockedBuffer
	cmd := exec.Command(bin, "-config", cfgFile, "-dnsserver", dnsAddr)
	cmd.Env = append(os.Environ(),
		"PEBBLE_VA_NOSLEEP=1",      // validate at once
		"PEBBLE_WFE_NONCEREJECT=0", // no random bad-nonce rejections
		"PEBBLE_AUTHZREUSE=0",      // every order, renewals too, validated anew
	)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting pebble: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return &logs
}

// pebbleRoots fetches the root Pebble signs with from its management
// interface, trusting its HTTPS through caFile.
func pebbleRoots(t *testing.T, caFile, mgmtAddr string, deadline time.Time) *x509.CertPool {
	t.Helper()
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	defer tr.CloseIdleConnections()
	c := &http.Client{Timeout: 5 * time.Second, Transport: tr}
	var last error
	for time.Now().Before(deadline) {
		resp, err := c.Get("https://" + mgmtAddr + "/roots/0")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			roots := x509.NewCertPool()
			if resp.StatusCode == http.StatusOK && roots.AppendCertsFromPEM(body) {
				return roots
			}
			err = fmt.Errorf("%s: %q", resp.Status, body)
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("Pebble's root from https://%s/roots/0: %v", mgmtAddr, last)
	return nil
}
