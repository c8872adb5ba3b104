package relay

import (
	"crypto/sha256"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/ledger"
)

// A client's budget from the clients file is the ledger's Budget.
var _ = ledger.Budget(Budget{})

func usageRelay(t *testing.T, l *ledger.Ledger) *Relay {
	t.Helper()
	r, err := New(Config{NoP2P: true, Transport: http.DefaultTransport, APIKeys: []string{testKey}, AdminKey: adminKey, Ledger: l})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func openLedger(t *testing.T, path string) *ledger.Ledger {
	t.Helper()
	l, err := ledger.Open(ledger.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// The usage route through real HTTP: the admin key only, every grouping,
// clear errors, and no key in the answer.
func TestUsageRoute(t *testing.T) {
	l := openLedger(t, filepath.Join(t.TempDir(), "ledger.db"))
	ef, err := ParseEndpointsFile([]byte("endpoints:\n  - name: cloud\n    url: https://api.example.com/v1\n    prices: {input: 2.5, cached_input: 1.25, output: 10}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	l.SetPrices(ef.Prices())
	// Clients as the request path names them: one from the clients file,
	// one key without a name.
	ct := newClientTable([]string{testKey}, nil)
	anon := ct.lookup(sha256.Sum256([]byte(testKey)))
	now := time.Now()
	for range 3 {
		l.Record(ledger.Entry{Time: now, Client: "alice", Model: "llama", Agent: "gpu-1", PromptTokens: 1000, CachedTokens: 800, CompletionTokens: 100})
	}
	l.Record(ledger.Entry{Time: now, Client: anon.Name, Model: "gpt", Provider: "cloud", PromptTokens: 2000, CachedTokens: 1000, CompletionTokens: 200})
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	l.Record(ledger.Entry{Time: now, Client: "alice", Model: "llama", Agent: "gpu-1", PromptTokens: 10, Error: true, Estimated: true})
	srv := adminServer(t, usageRelay(t, l))

	for _, key := range []string{"", "wrong-admin-key-zz", testKey} {
		if st, b := adminDo(t, srv, "GET", "/admin/v1/usage", key, ""); st != http.StatusUnauthorized || !strings.Contains(string(b), `"invalid_api_key"`) {
			t.Fatalf("key %q: %d %s", key, st, b)
		}
	}
	get := func(query string) ledger.Report {
		t.Helper()
		st, b := adminDo(t, srv, "GET", "/admin/v1/usage"+query, adminKey, "")
		if st != http.StatusOK {
			t.Fatalf("%s: %d %s", query, st, b)
		}
		if strings.Contains(string(b), testKey) {
			t.Fatalf("%s: the answer shows a key: %s", query, b)
		}
		var rep ledger.Report
		if err := json.Unmarshal(b, &rep); err != nil {
			t.Fatal(err)
		}
		return rep
	}
	rep := get("")
	if rep.By != "client" || len(rep.Rows) != 2 || rep.Total.Requests != 5 || !rep.Ledger.OK || now.Sub(rep.Since) < 7*24*time.Hour-time.Hour {
		t.Fatalf("default report: %+v", rep)
	}
	wantCost, wantSaved := ledger.Prices{Input: 2.5, CachedInput: 1.25, Output: 10}.Cost(2000, 1000, 200)
	for _, row := range rep.Rows {
		switch row.Key {
		case "alice":
			if row.Requests != 4 || row.PromptTokens != 3010 || row.CachedTokens != 2400 || row.Errors != 1 || row.Estimated != 1 {
				t.Fatalf("alice: %+v", row)
			}
		case anon.Name:
			if row.Cost != wantCost || row.Saved != wantSaved || row.Saved == 0 {
				t.Fatalf("%s: %+v, want cost %d saved %d", anon.Name, row, wantCost, wantSaved)
			}
		default:
			t.Fatalf("unexpected row %+v", row)
		}
	}
	if r := get("?since=2h&by=agent"); len(r.Rows) != 1 || r.Rows[0].Key != "gpu-1" || r.Rows[0].Requests != 4 {
		t.Fatalf("by agent: %+v", r.Rows)
	}
	if r := get("?by=model"); len(r.Rows) != 2 || r.Rows[0].Key != "llama" {
		t.Fatalf("by model: %+v", r.Rows)
	}
	if r := get("?by=provider&since=" + now.Add(-time.Hour).UTC().Format(time.RFC3339)); len(r.Rows) != 1 || r.Rows[0].Key != "cloud" || r.Rows[0].Cost != wantCost {
		t.Fatalf("by provider: %+v", r.Rows)
	}
	for _, c := range []struct{ query, code string }{
		{"?since=yesterday", "invalid_since"},
		{"?since=-3d", "invalid_since"},
		{"?by=key", "invalid_by"},
		{"?limit=5", "invalid_parameter"},
	} {
		st, b := adminDo(t, srv, "GET", "/admin/v1/usage"+c.query, adminKey, "")
		if st != http.StatusBadRequest || !strings.Contains(string(b), `"code":"`+c.code+`"`) {
			t.Fatalf("%s: %d %s, want 400 %s", c.query, st, b, c.code)
		}
	}
	if st, _ := adminDo(t, srv, "POST", "/admin/v1/usage", adminKey, ""); st != http.StatusMethodNotAllowed {
		t.Fatalf("POST: %d", st)
	}
}

// Without a ledger the route says so; with a ledger whose file is
// corrupt it answers 503 and the reason.
func TestUsageRouteWithoutLedger(t *testing.T) {
	srv := adminServer(t, usageRelay(t, nil))
	if st, b := adminDo(t, srv, "GET", "/admin/v1/usage", adminKey, ""); st != http.StatusNotFound || !strings.Contains(string(b), `"ledger_off"`) {
		t.Fatalf("no ledger: %d %s", st, b)
	}
	path := filepath.Join(t.TempDir(), "ledger.db")
	if err := os.WriteFile(path, []byte(strings.Repeat("junk", 4096)), 0o600); err != nil {
		t.Fatal(err)
	}
	srv = adminServer(t, usageRelay(t, openLedger(t, path)))
	if st, b := adminDo(t, srv, "GET", "/admin/v1/usage", adminKey, ""); st != http.StatusServiceUnavailable || !strings.Contains(string(b), `"ledger_unavailable"`) {
		t.Fatalf("corrupt ledger: %d %s", st, b)
	}
}

func TestErrOverBudget(t *testing.T) {
	now := time.Date(2026, 3, 10, 23, 0, 0, 0, time.UTC)
	v := ledger.Check(ledger.Budget(Budget{TokensPerDay: 100}), ledger.Spent{Day: now.Unix() / 86400, DayTokens: 100}, now)
	w := httptest.NewRecorder()
	writeError(w, errOverBudget(v, now))
	var body errorBody
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	if w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "3600" || body.Error.Type != "insufficient_quota" ||
		body.Error.Code != "insufficient_quota" || !strings.Contains(body.Error.Message, "2026-03-11T00:00:00Z") {
		t.Fatalf("%d %v %+v", w.Code, w.Header(), body)
	}
}

func TestEndpointsFilePrices(t *testing.T) {
	ef, err := ParseEndpointsFile([]byte(`
endpoints:
  - name: a
    url: https://a.example.com/v1
    prices: {input: 2.5, cached_input: 1.25, output: 10}
  - name: b
    url: https://b.example.com/v1
    prices:
      input: 1
      output: 4
  - name: c
    url: https://c.example.com/v1
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	p := ef.Prices()
	if len(p) != 2 || p["a"] != (ledger.Prices{Input: 2.5, CachedInput: 1.25, Output: 10}) || p["b"] != (ledger.Prices{Input: 1, CachedInput: 1, Output: 4}) {
		t.Fatalf("prices %+v", p)
	}
	if ef.Endpoints[2].Prices != nil {
		t.Fatal("an endpoint without prices got some")
	}
	bad := []struct{ name, file, want string }{
		{"negative input", "endpoints:\n  - name: a\n    url: https://x/v1\n    prices:\n      input: -1\n      output: 2\n", "line 5: endpoints[0] (\"a\"): prices: input: must be"},
		{"negative cached", "endpoints:\n  - name: a\n    url: https://x/v1\n    prices:\n      input: 1\n      output: 2\n      cached_input: -0.5\n", "line 7: endpoints[0] (\"a\"): prices: cached_input"},
		{"no output", "endpoints:\n  - name: a\n    url: https://x/v1\n    prices: {input: 1}\n", "line 4: endpoints[0] (\"a\"): prices: give input and output"},
		{"typo", "endpoints:\n  - name: a\n    url: https://x/v1\n    prices: {input: 1, ouput: 2}\n", "line 4: field ouput not found in prices"},
		{"not a number", "endpoints:\n  - name: a\n    url: https://x/v1\n    prices: {input: cheap, output: 2}\n", "line 4"},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := ParseEndpointsFile([]byte(tt.file), nil); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

// The endpoints file's prices reach the ledger when the relay loads it.
func TestEndpointsFilePricesReachTheLedger(t *testing.T) {
	dir := t.TempDir()
	ef := filepath.Join(dir, "endpoints.yaml")
	if err := os.WriteFile(ef, []byte("endpoints:\n  - name: cloud\n    url: https://api.example.com/v1\n    models: [gpt]\n    prices: {input: 3, output: 12}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	l := openLedger(t, filepath.Join(dir, "ledger.db"))
	r, err := New(Config{NoP2P: true, Transport: http.DefaultTransport, NoAuth: true, EndpointsFile: ef, Ledger: l})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	l.Record(ledger.Entry{Time: time.Now(), Client: "alice", Model: "gpt", Provider: "cloud", PromptTokens: 1_000_000, CompletionTokens: 1_000_000})
	rep, err := l.Usage(time.Now().Add(-time.Hour), ledger.ByProvider)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != 1 || rep.Rows[0].Cost.Float64() != 15 {
		t.Fatalf("rows %+v: want cloud at 3 + 12", rep.Rows)
	}
}
