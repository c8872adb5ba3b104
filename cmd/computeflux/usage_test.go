package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/ledger"
)

// computeflux usage against a relay's admin API, in each format.
func TestUsageCommand(t *testing.T) {
	dir := t.TempDir()
	l, err := ledger.Open(ledger.Config{Path: filepath.Join(dir, "ledger.db")})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	l.SetPrices(map[string]ledger.Prices{"cloud": {Input: 2, CachedInput: 0.5, Output: 8}})
	now := time.Now()
	l.Record(ledger.Entry{Time: now, Client: "alice", Model: "llama", Agent: "gpu-1", PromptTokens: 1000, CachedTokens: 750, CompletionTokens: 100, Serving: 2 * time.Second})
	l.Record(ledger.Entry{Time: now, Client: "bob", Model: "gpt", Provider: "cloud", PromptTokens: 1_000_000, CachedTokens: 500_000, CompletionTokens: 0})
	const admin, clientKey = "adm-usage-0123456789", "sk-usage-client-0123456789"
	r, err := relay.New(relay.Config{NoP2P: true, Transport: http.DefaultTransport, APIKeys: []string{clientKey}, AdminKey: admin, Ledger: l})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	srv := httptest.NewServer(r.AdminHandler())
	defer srv.Close()
	kf := filepath.Join(dir, "admin.key")
	if err := os.WriteFile(kf, []byte(admin+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (string, error) {
		var out, errb bytes.Buffer
		err := runUsage(context.Background(), append([]string{"--admin-url", srv.URL, "--admin-key-file", kf}, args...), &out, &errb)
		if strings.Contains(out.String()+errb.String(), admin) || strings.Contains(out.String()+errb.String(), clientKey) {
			t.Fatalf("a key in the output: %s %s", out.String(), errb.String())
		}
		return out.String(), err
	}

	out, err := run()
	if err != nil {
		t.Fatal(err)
	}
	// bob: 500,000 x 2 + 500,000 x 0.5 per million = 1.25; saved 500,000 x 1.5 = 0.75.
	for _, want := range []string{"usage by client", "CLIENT", "bob", "1.2500", "0.7500", "alice", "75.0", "TOTAL (all requests)"} {
		if !strings.Contains(out, want) {
			t.Fatalf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Index(out, "bob") > strings.Index(out, "alice") {
		t.Fatalf("rows not by tokens:\n%s", out)
	}

	out, err = run("--by", "agent", "--format", "csv", "--since", "1h")
	if err != nil {
		t.Fatal(err)
	}
	recs, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 2 || recs[0][0] != "agent" || recs[1][0] != "gpu-1" || recs[1][1] != "1" || recs[1][7] != "2" {
		t.Fatalf("csv %q", recs)
	}

	out, err = run("--by", "model", "--format", "json")
	if err != nil {
		t.Fatal(err)
	}
	var rep ledger.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.By != "model" || len(rep.Rows) != 2 || rep.Total.Requests != 2 || rep.Total.Saved.Float64() != 0.75 {
		t.Fatalf("json %+v", rep)
	}

	for _, bad := range [][]string{{"--by", "key"}, {"--format", "xml"}, {"--since", "soon"}, {"extra"}} {
		if _, err := run(bad...); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	// The admin key is required.
	var errb bytes.Buffer
	if err := runUsage(context.Background(), []string{"--admin-url", srv.URL}, &bytes.Buffer{}, &errb); err == nil {
		t.Fatal("ran without an admin key")
	}
}
