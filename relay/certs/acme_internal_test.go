package certs

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The HTTP side's redirect: same path and query, the host named if it is
// one of the domains (else the first), the HTTPS port unless 443.
func TestACMERedirect(t *testing.T) {
	a, err := NewACME(ACMEConfig{ReadHeaderTimeout: time.Second, Domains: []string{"Relay.Example.com", "b.example.com"}, CacheDir: filepath.Join(t.TempDir(), "acme")})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for _, c := range []struct {
		host   string
		port   int
		method string
		want   string
	}{
		{"relay.example.com", 443, http.MethodGet, "https://relay.example.com/v1/models?a=1"},
		{"b.example.com:80", 0, http.MethodPost, "https://b.example.com/v1/models?a=1"},
		{"B.EXAMPLE.COM.", 8443, http.MethodGet, "https://b.example.com:8443/v1/models?a=1"},
		{"evil.example.net", 443, http.MethodGet, "https://relay.example.com/v1/models?a=1"},
		{"203.0.113.9", 443, http.MethodHead, "https://relay.example.com/v1/models?a=1"},
	} {
		req := httptest.NewRequest(c.method, "http://x/v1/models?a=1", nil)
		req.Host = c.host
		w := httptest.NewRecorder()
		a.redirect(w, req, c.port)
		if w.Code != http.StatusPermanentRedirect || w.Header().Get("Location") != c.want {
			t.Errorf("%s %s (https port %d): %d %q, want 308 %q", c.method, c.host, c.port, w.Code, w.Header().Get("Location"), c.want)
		}
	}
}

func TestNewACMEChecks(t *testing.T) {
	dir := t.TempDir()
	if _, err := NewACME(ACMEConfig{ReadHeaderTimeout: time.Second, CacheDir: dir}); err == nil {
		t.Error("no domain accepted")
	}
	if _, err := NewACME(ACMEConfig{ReadHeaderTimeout: time.Second, Domains: []string{"relay.example.com"}, CacheDir: dir, DirectoryURL: "http://ca.example/dir"}); err == nil {
		t.Error("a plain-HTTP directory accepted")
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := NewACME(ACMEConfig{ReadHeaderTimeout: time.Second, Domains: []string{"relay.example.com"}, CacheDir: filepath.Join(file, "acme")})
	if err == nil || !strings.Contains(err.Error(), "certificate cache") {
		t.Errorf("an uncreatable cache: %v", err)
	}
	a, err := NewACME(ACMEConfig{ReadHeaderTimeout: time.Second, Domains: []string{"relay.example.com"}, CacheDir: filepath.Join(dir, "acme-ok")})
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	if st, err := os.Stat(filepath.Join(dir, "acme-ok")); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("the cache: %v, %v; want a 0700 directory", st, err)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "acme-ok")); len(ents) != 0 {
		t.Errorf("the write check left %v", ents)
	}
}
