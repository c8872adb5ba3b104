package relay

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/certs"
)

// stepClock is a clock that tests move by hand.
type stepClock struct {
	mu  sync.Mutex
	now time.Time
}

func newStepClock() *stepClock { return &stepClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *stepClock) add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// chatStatus sends a chat completion with key and returns the status and
// Retry-After; error responses are checked for OpenAI's shape.
func chatStatus(t *testing.T, tb *testbed, key string) (int, string, errorObject) {
	t.Helper()
	resp := tb.do("POST", "/v1/chat/completions", chatBody, "Authorization", "Bearer "+key)
	ra := resp.Header.Get("Retry-After")
	if resp.StatusCode != 200 {
		return resp.StatusCode, ra, apiError(t, resp)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, ra, errorObject{}
}

func TestKeyRPM(t *testing.T) {
	clk := newStepClock()
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.KeyRPM, c.Clock = 3, clk })
	for i := 0; i < 3; i++ {
		if st, _, e := chatStatus(t, tb, testKey); st != 200 {
			t.Fatalf("request %d: %d %+v", i, st, e)
		}
		clk.add(10 * time.Second)
	}
	// Three requests at 0, 10 and 20 s; now is 30 s: the first leaves the
	// window at 60 s, so retry in 30 s.
	st, ra, e := chatStatus(t, tb, testKey)
	if st != 429 || ra != "30" || e.Code != "rate_limit_exceeded" || e.Type != "rate_limit_error" {
		t.Fatalf("4th request: %d Retry-After %q %+v", st, ra, e)
	}
	// Another key has its own budget.
	if st, _, e := chatStatus(t, tb, "sk-other"); st != 200 {
		t.Fatalf("other key: %d %+v", st, e)
	}
	clk.add(29 * time.Second)
	if st, ra, _ := chatStatus(t, tb, testKey); st != 429 || ra != "1" {
		t.Fatalf("at 59 s: %d Retry-After %q", st, ra)
	}
	clk.add(time.Second)
	if st, _, e := chatStatus(t, tb, testKey); st != 200 {
		t.Fatalf("after the window moved: %d %+v", st, e)
	}
	// Refused requests do not use the budget: the next slot frees at 70 s
	// (the request of 10 s), not later.
	if st, ra, _ := chatStatus(t, tb, testKey); st != 429 || ra != "10" {
		t.Fatalf("at 60 s: %d Retry-After %q", st, ra)
	}
	// A refused request never reached an agent: 3 + 1 + 1 requests did.
	if n := tb.engines["a"].hits.Load(); n != 5 {
		t.Errorf("engine saw %d requests, want 5", n)
	}
}

func TestKeyConcurrency(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.KeyConcurrency = 1 })
	started, release := make(chan struct{}, 4), make(chan struct{})
	tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		started <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
		defaultEngine(w, r, body, "a")
	})
	done := make(chan int, 1)
	go func() {
		resp := tb.do("POST", "/v1/chat/completions", chatBody)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	<-started
	st, ra, e := chatStatus(t, tb, testKey)
	if st != 429 || ra != "1" || e.Code != "concurrency_limit_exceeded" {
		t.Errorf("second concurrent request: %d Retry-After %q %+v", st, ra, e)
	}
	other := make(chan int, 1)
	go func() { st, _, _ := chatStatus(t, tb, "sk-other"); other <- st }()
	<-started // the other key's request reached the engine while the first is held
	close(release)
	if st := <-done; st != 200 {
		t.Errorf("first request: %d", st)
	}
	if st := <-other; st != 200 {
		t.Errorf("other key: %d", st)
	}
	// The slot is free again once the request ended.
	if st, _, e := chatStatus(t, tb, testKey); st != 200 {
		t.Errorf("after release: %d %+v", st, e)
	}
}

func TestKeyLimitsNoAuthShareOneBudget(t *testing.T) {
	clk := newStepClock()
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.APIKeys, c.NoAuth, c.KeyRPM, c.Clock = nil, true, 1, clk })
	if st, _, _ := chatStatus(t, tb, "anything"); st != 200 {
		t.Fatalf("first: %d", st)
	}
	if st, ra, _ := chatStatus(t, tb, "something-else"); st != 429 || ra != "60" {
		t.Fatalf("second client: %d Retry-After %q", st, ra)
	}
}

func TestKeyLimitsBounded(t *testing.T) {
	clk := newStepClock()
	l := newKeyLimits(100, 0, clk)
	id := keyID(&http.Request{Header: http.Header{"Authorization": {"Bearer k"}}}, false)
	admitted := 0
	for i := 0; i < 100_000; i++ {
		if l.acquire(id) == nil {
			admitted++
			l.release(id)
		}
		clk.add(6 * time.Millisecond) // 10,000 per minute offered
	}
	// 600 s at 100 per minute: 1,000 admitted (each window holds 100).
	if admitted != 1000 {
		t.Errorf("admitted %d, want 1000", admitted)
	}
	if n := cap(l.keys[id].ring); n > 2*100 {
		t.Errorf("window ring grew to %d entries for a limit of 100", n)
	}
	if newKeyLimits(0, 0, clk) != nil {
		t.Error("no limits should mean no limiter")
	}
	if err := validate(populate(Config{NoAuth: true, NoP2P: true, Transport: http.DefaultTransport, KeyRPM: MaxKeyRPM + 1})); err == nil {
		t.Error("KeyRPM above the bound accepted")
	}
}

func TestMetricsKey(t *testing.T) {
	tb := newTestbed(t, []string{"a"}, func(c *Config) { c.MetricsKey = "metrics-secret" })
	for _, c := range []struct {
		auth   string
		status int
	}{
		{"", 401},
		{"Bearer " + testKey, 401}, // a client key does not open /metrics
		{"Bearer metrics-secret-x", 401},
		{"Bearer metrics-secret", 200},
	} {
		resp := tb.do("GET", "/metrics", "", "Authorization", c.auth)
		if resp.StatusCode != c.status {
			t.Errorf("auth %q: %d, want %d", c.auth, resp.StatusCode, c.status)
		}
		if c.status != 200 {
			apiError(t, resp)
		} else {
			resp.Body.Close()
		}
	}
	// /healthz stays open for load balancers; it shows only a count.
	resp := tb.do("GET", "/healthz", "", "Authorization", "")
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("healthz: %d", resp.StatusCode)
	}
}

// writeSelfSigned writes a self-signed certificate for 127.0.0.1 and its key
// into dir and returns the files and a pool that trusts the certificate.
func writeSelfSigned(t *testing.T, dir string) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "computeflux test relay"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}

// serveRelay serves tb's relay with Serve (the real http.Server settings)
// on ln until the test ends.
func serveRelay(t *testing.T, tb *testbed, ln net.Listener) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tb.relay.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
}

func TestTLS(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, pool := writeSelfSigned(t, dir)
	tb := newTestbed(t, []string{"a"}, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tln, err := certs.NewTLSListener(ln, certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	serveRelay(t, tb, tln)
	addr := ln.Addr().String()

	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 20 * time.Second}
	req, _ := http.NewRequest("POST", "https://"+addr+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set("Authorization", "Bearer "+testKey)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.TLS == nil || resp.TLS.Version < tls.VersionTLS12 {
		t.Fatalf("https: %d tls=%v %s", resp.StatusCode, resp.TLS != nil, b)
	}

	// Plain HTTP on the TLS port is refused, not served.
	plain := &http.Client{Timeout: 20 * time.Second}
	req, _ = http.NewRequest("POST", "http://"+addr+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set("Authorization", "Bearer "+testKey)
	if resp, err := plain.Do(req); err == nil {
		resp.Body.Close()
		if resp.StatusCode != 400 {
			t.Errorf("plain HTTP to the TLS port: %d", resp.StatusCode)
		}
	}
	if n := tb.engines["a"].hits.Load(); n != 1 {
		t.Errorf("engine saw %d requests, want 1 (the HTTPS one)", n)
	}

	// A client that does not trust the certificate fails the handshake.
	untrusted := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{}}
	if resp, err := untrusted.Get("https://" + addr + "/healthz"); err == nil {
		resp.Body.Close()
		t.Error("untrusted certificate accepted")
	}

	// Bad files fail at start.
	if _, err := certs.NewTLSListener(ln, certFile, filepath.Join(dir, "missing.pem")); err == nil {
		t.Error("missing key file accepted")
	}
	if _, err := certs.NewTLSListener(ln, keyFile, certFile); err == nil {
		t.Error("swapped files accepted")
	}
	if _, err := certs.NewTLSListener(ln, "", ""); err == nil {
		t.Error("no files accepted")
	}
}
