package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

const adminKey = "adm-0123456789abcdef"

// adminDo calls the admin API with key ("" for none).
func adminDo(t *testing.T, srv *httptest.Server, method, path, key, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func adminServer(t *testing.T, r *Relay) *httptest.Server {
	srv := httptest.NewServer(r.AdminHandler())
	t.Cleanup(srv.Close)
	return srv
}

func TestAdminAPI(t *testing.T) {
	fp := newFakeProvider(t, "cloud", []string{"m1"}, "sk-prov-1", "sk-prov-2")
	tb, _ := providerBed(t, []string{"home"}, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [sk-prov-1, sk-prov-2], models: [m1]}\n", fp.url()),
		func(c *Config) { c.AdminKey = adminKey })
	srv := adminServer(t, tb.relay)

	for _, key := range []string{"", "wrong-admin-key-zz", testKey} {
		st, b := adminDo(t, srv, "GET", "/admin/v1/endpoints", key, "")
		if st != http.StatusUnauthorized || !strings.Contains(string(b), `"invalid_api_key"`) {
			t.Fatalf("key %q: %d %s", key, st, b)
		}
	}
	if st, _ := adminDo(t, srv, "POST", "/admin/v1/endpoints/home/disable", "wrong-admin-key-zz", ""); st != http.StatusUnauthorized {
		t.Fatalf("action without the key: %d", st)
	}
	if tableRow(t, tb.relay, "home").Disabled {
		t.Fatal("refused action took effect")
	}
	logs := tb.logs.String()
	if countLines(logs, "admin request refused") != 4 {
		t.Errorf("refusals not logged once each:\n%s", logs)
	}
	assertNoSecrets(t, logs, "wrong-admin-key-zz", adminKey)

	st, b := adminDo(t, srv, "GET", "/admin/v1/endpoints", adminKey, "")
	if st != http.StatusOK {
		t.Fatalf("list: %d %s", st, b)
	}
	assertNoSecrets(t, string(b), "sk-prov-1", "sk-prov-2", testKey)
	var list struct{ Endpoints []TableRow }
	if err := json.Unmarshal(b, &list); err != nil {
		t.Fatal(err)
	}
	names := []string{}
	for _, r := range list.Endpoints {
		names = append(names, r.Name+"/"+r.Kind)
	}
	if !slices.Equal(names, []string{"home/agent", "cloud/provider"}) {
		t.Fatalf("table %v (want tier order)", names)
	}
	if k := list.Endpoints[1].Keys; len(k) != 2 || k[0].N != 1 || k[0].State != "closed" {
		t.Fatalf("keys %+v", k)
	}

	if st, b := adminDo(t, srv, "POST", "/admin/v1/endpoints/cloud/weight", adminKey, `{"weight": 5}`); st != http.StatusOK || !strings.Contains(string(b), `"weight_source":"admin"`) {
		t.Fatalf("weight: %d %s", st, b)
	}
	for path, want := range map[string]int{
		"/admin/v1/endpoints/nobody/disable": http.StatusNotFound,
		"/admin/v1/endpoints/home/explode":   http.StatusBadRequest,
	} {
		if st, b := adminDo(t, srv, "POST", path, adminKey, ""); st != want {
			t.Errorf("%s: %d %s", path, st, b)
		}
	}
	for _, body := range []string{``, `{"weight": -1}`, `{"w": 1}`, `nope`} {
		if st, _ := adminDo(t, srv, "POST", "/admin/v1/endpoints/cloud/weight", adminKey, body); st != http.StatusBadRequest {
			t.Errorf("weight body %q: %d", body, st)
		}
	}
	if st, _ := adminDo(t, srv, "DELETE", "/admin/v1/endpoints", adminKey, ""); st != http.StatusMethodNotAllowed {
		t.Errorf("DELETE: %d", st)
	}
	if st, _ := adminDo(t, srv, "GET", "/v1/models", adminKey, ""); st != http.StatusNotFound {
		t.Errorf("client API on the admin listener: %d", st)
	}

	// Disabled stays disabled across a reload of the file.
	if st, _ := adminDo(t, srv, "POST", "/admin/v1/endpoints/cloud/disable", adminKey, ""); st != http.StatusOK {
		t.Fatal(st)
	}
	if err := tb.relay.ReloadEndpoints(context.Background()); err != nil {
		t.Fatal(err)
	}
	if row := tableRow(t, tb.relay, "cloud"); !row.Disabled || row.State != "disabled" || row.Weight != 5 {
		t.Fatalf("after reload: %+v", row)
	}
	if st, _ := adminDo(t, srv, "POST", "/admin/v1/endpoints/cloud/enable", adminKey, ""); st != http.StatusOK || tableRow(t, tb.relay, "cloud").Disabled {
		t.Fatal("enable")
	}
}

// An agent's declared weight is capped; the file's setting wins over it,
// and the admin API's over both.
func TestAgentWeightCap(t *testing.T) {
	tb, _ := providerBed(t, nil, "agents:\n  - {name: gpu2, weight: 6, priority: 1}\n", nil)
	for _, n := range []string{"gpu1", "gpu2", "gpu3"} {
		tb.addAgent(n, []string{"m1"})
	}
	join := func(name string, w float64) {
		if err := tb.relay.Registry().Joined(tb.peers[name], transport.JoinInfo{Name: name, Models: []string{"m1"}, Weight: w}); err != nil {
			t.Fatal(err)
		}
	}
	join("gpu1", 1e6)
	join("gpu2", 1e6)
	join("gpu3", 2)
	want := map[string]struct {
		w      float64
		source string
		tier   int
	}{"gpu1": {DefaultMaxAgentWeight, "capped", 0}, "gpu2": {6, "file", 1}, "gpu3": {2, "declared", 0}}
	for name, w := range want {
		row := tableRow(t, tb.relay, name)
		if row.Weight != w.w || row.WeightSource != w.source || row.Tier != w.tier {
			t.Errorf("%s: weight %v (%s) tier %d, want %v (%s) tier %d", name, row.Weight, row.WeightSource, row.Tier, w.w, w.source, w.tier)
		}
	}
	// The scheduler sees the capped weight, not the claim.
	for _, s := range tb.relay.Scheduler().Snapshot() {
		if s.ID == "gpu1" && s.Weight != DefaultMaxAgentWeight {
			t.Fatalf("scheduler weight %v", s.Weight)
		}
	}
	if err := tb.relay.SetAdmin("gpu1", "weight", 9); err != nil {
		t.Fatal(err)
	}
	join("gpu1", 1e6) // a rejoin keeps the operator's word
	if row := tableRow(t, tb.relay, "gpu1"); row.Weight != 9 || row.WeightSource != "admin" {
		t.Fatalf("admin weight: %+v", row)
	}
	// No agent may join under a provider's name.
	tb2, _ := providerBed(t, nil, "endpoints:\n  - {name: cloud, url: https://127.0.0.1:1/v1, models: [m1]}\n", nil)
	if err := tb2.relay.Registry().Joined("peer-x", transport.JoinInfo{Name: "cloud", Models: []string{"m1"}}); err == nil {
		t.Fatal("an agent took a provider's name")
	}
}

// Admin disable takes effect on the next pick: no request started after the
// call returned reaches the endpoint, and its sessions move. Measured under
// concurrent load.
func TestAdminDisableNextPick(t *testing.T) {
	tb, _ := providerBed(t, []string{"a", "b", "c"}, "", func(c *Config) { c.AdminKey = adminKey })
	srv := adminServer(t, tb.relay)
	// Sessions spread over the three agents first.
	onA := ""
	for i := 0; onA == ""; i++ {
		if i > 200 {
			t.Fatal("no session landed on a")
		}
		s := fmt.Sprintf("s%d", i)
		if _, agent, _ := tb.chat(s); agent == "a" {
			onA = s
		}
	}

	type result struct {
		start time.Time
		agent string
		code  int
	}
	var mu sync.Mutex
	var results []result
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Until stop, not a fixed count: a fast relay would finish a
			// fixed count before the call and leave nothing after it.
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				start := time.Now()
				code, agent, _ := tb.chat(fmt.Sprintf("w%d-%d", w, i%7))
				mu.Lock()
				results = append(results, result{start, agent, code})
				mu.Unlock()
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	callStart := time.Now()
	st, b := adminDo(t, srv, "POST", "/admin/v1/endpoints/a/disable", adminKey, "")
	returned := time.Now()
	if st != http.StatusOK {
		t.Fatalf("disable: %d %s", st, b)
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()

	before, after, toA := 0, 0, 0
	for _, r := range results {
		if r.code != http.StatusOK {
			t.Fatalf("a request failed: %+v", r)
		}
		if r.start.After(returned) {
			after++
			if r.agent == "a" {
				toA++
			}
		} else if r.agent == "a" {
			before++
		}
	}
	t.Logf("disable call took %v; requests to a before: %d; requests started after the call returned: %d, of which to a: %d",
		returned.Sub(callStart), before, after, toA)
	if before == 0 || after == 0 {
		t.Fatalf("load did not straddle the call: %d before on a, %d after", before, after)
	}
	if toA != 0 {
		t.Fatalf("%d requests reached the disabled agent after the call returned", toA)
	}
	resp := tb.do("POST", "/v1/chat/completions", chatM1, "X-Session-ID", onA)
	resp.Body.Close()
	if got := resp.Header.Get(HeaderAgent); got == "a" || resp.Header.Get(HeaderAffinity) != "miss" {
		t.Fatalf("session of a: served by %s (%s), want moved", got, resp.Header.Get(HeaderAffinity))
	}
}

// Drain: no new requests, the one in flight finishes.
func TestAdminDrain(t *testing.T) {
	tb, _ := providerBed(t, []string{"a", "b"}, "", nil)
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	tb.engines["a"].set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		started <- struct{}{}
		<-release
		defaultEngine(w, r, body, "a")
	})
	tb.engines["b"].set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		http.Error(w, "busy", http.StatusServiceUnavailable)
	})
	done := make(chan int, 1)
	go func() {
		code, _, _ := tb.chat("slow")
		done <- code
	}()
	<-started
	if err := tb.relay.SetAdmin("a", "drain", 0); err != nil {
		t.Fatal(err)
	}
	tb.engines["b"].set(nil)
	for range 5 {
		if _, agent, _ := tb.chat("x"); agent != "b" {
			t.Fatalf("drained agent got a new request")
		}
	}
	close(release)
	if code := <-done; code != http.StatusOK {
		t.Fatalf("in-flight request on the drained agent: %d", code)
	}
	if row := tableRow(t, tb.relay, "a"); row.State != "draining" {
		t.Fatalf("state %s", row.State)
	}
	if err := tb.relay.SetAdmin("a", "undrain", 0); err != nil {
		t.Fatal(err)
	}
	if row := tableRow(t, tb.relay, "a"); row.State != "ok" {
		t.Fatalf("after undrain: %s", row.State)
	}
}

// Home tier saturated or down: overflow to the provider costs no failed
// request; when home recovers, new sessions return to it.
func TestTierOverflowThroughRelay(t *testing.T) {
	slow.Gate(t, "fills a tier and waits on breakers")
	fp := newFakeProvider(t, "cloud", []string{"m1"}, "k1")
	tb, _ := providerBed(t, nil, fmt.Sprintf("endpoints:\n  - {name: cloud, url: %s, keys: [k1], models: [m1], weight: 50}\n", fp.url()),
		func(c *Config) { c.Scheduler.Cooldown = 200 * time.Millisecond })
	home := tb.addAgent("home", []string{"m1"})
	if err := tb.relay.Registry().Joined(tb.peers["home"], transport.JoinInfo{Name: "home", Models: []string{"m1"}, Capacity: 2}); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if _, agent, _ := tb.chat(fmt.Sprintf("n%d", i)); agent != "home" {
			t.Fatalf("with room at home, served by %s", agent)
		}
	}

	// Saturated: two slow requests fill home; the third overflows.
	release := make(chan struct{})
	var arrived sync.WaitGroup
	arrived.Add(2)
	home.set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		arrived.Done()
		<-release
		defaultEngine(w, r, body, "home")
	})
	codes := make(chan int, 2)
	for i := range 2 {
		go func() { c, _, _ := tb.chat(fmt.Sprintf("slow%d", i)); codes <- c }()
	}
	arrived.Wait()
	code, agent, _ := tb.chat("overflow")
	if code != http.StatusOK || agent != "cloud" {
		t.Fatalf("home full: %d from %s, want 200 from cloud", code, agent)
	}
	close(release)
	for range 2 {
		if c := <-codes; c != http.StatusOK {
			t.Fatalf("slow request: %d", c)
		}
	}
	home.set(nil)

	// Down: every request still succeeds, on the provider.
	tb.ft.setDown(tb.peers["home"], true)
	for i := range 20 {
		code, agent, _ := tb.chat(fmt.Sprintf("down%d", i))
		if code != http.StatusOK || agent != "cloud" {
			t.Fatalf("home down, request %d: %d from %s", i, code, agent)
		}
	}
	if row := tableRow(t, tb.relay, "home"); row.Breaker != scheduler.BreakerOpen.String() {
		t.Fatalf("home breaker %s after its failures", row.Breaker)
	}
	// Sessions that overflowed stick to the provider while home is down.
	if _, agent, _ := tb.chat("down3"); agent != "cloud" {
		t.Fatalf("overflowed session: %s", agent)
	}

	// Recovered: once the breaker admits probes, new sessions go home,
	// and so do the sessions that overflowed.
	tb.ft.setDown(tb.peers["home"], false)
	time.Sleep(250 * time.Millisecond)
	for i := range 10 {
		code, agent, _ := tb.chat(fmt.Sprintf("back%d", i))
		if code != http.StatusOK || agent != "home" {
			t.Fatalf("home back, new session %d: %d from %s", i, code, agent)
		}
	}
	if _, agent, _ := tb.chat("down3"); agent != "home" {
		t.Fatalf("overflowed session after recovery: %s", agent)
	}
}

func TestStatusPage(t *testing.T) {
	tb, _ := providerBed(t, []string{"gpu1", "gpu2"}, "", func(c *Config) { c.AdminKey = adminKey })
	srv := adminServer(t, tb.relay)
	for range 3 {
		tb.chat("s")
	}
	st, b := adminDo(t, srv, "GET", "/status", "", "")
	if st != http.StatusOK || !strings.Contains(string(b), "status.json") {
		t.Fatalf("/status: %d", st)
	}
	if st, _ := adminDo(t, srv, "GET", "/status.json", "", ""); st != http.StatusUnauthorized {
		t.Fatalf("status data without the key: %d", st)
	}
	st, b = adminDo(t, srv, "GET", "/status.json", adminKey, "")
	var d struct {
		Endpoints []TableRow
		Series    []StatusPoint
		Summary   map[string]float64
	}
	if st != http.StatusOK || json.Unmarshal(b, &d) != nil {
		t.Fatalf("status.json: %d %s", st, b)
	}
	total := 0
	for _, p := range d.Series {
		total += p.Requests
	}
	if len(d.Endpoints) != 2 || len(d.Series) != statsBuckets || total != 3 || d.Summary["hit_ratio"] < 0.6 {
		t.Fatalf("status data: %d endpoints, %d points, %d requests, summary %v", len(d.Endpoints), len(d.Series), total, d.Summary)
	}

	// Public status: the data without a key, the admin API still closed.
	tb2, _ := providerBed(t, []string{"gpu1"}, "", func(c *Config) { c.StatusPublic = true })
	srv2 := adminServer(t, tb2.relay)
	if st, _ := adminDo(t, srv2, "GET", "/status.json", "", ""); st != http.StatusOK {
		t.Fatalf("public status: %d", st)
	}
	if st, _ := adminDo(t, srv2, "GET", "/admin/v1/endpoints", "", ""); st != http.StatusUnauthorized {
		t.Fatalf("admin API without a key configured: %d", st)
	}
}

// failingListener fails every Accept, as a listener closed under its
// server does.
type failingListener struct{ net.Listener }

func (l failingListener) Accept() (net.Conn, error) { return nil, errors.New("accept: listener gone") }

// The admin server stopping on its own is logged with its error; stopped
// by the relay, it is not.
func TestAdminServeErrorIsLogged(t *testing.T) {
	tb := newTestbed(t, nil, func(c *Config) { c.AdminKey = adminKey })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	stop := tb.relay.serveAdminOn(failingListener{ln})
	defer stop()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(tb.logs.String(), "relay admin stopped serving"); {
		if time.Now().After(deadline) {
			t.Fatalf("log %q, want the admin server's failure", tb.logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if logs := tb.logs.String(); !strings.Contains(logs, "listener gone") || !strings.Contains(logs, `"level":"error"`) {
		t.Fatalf("log %q, want an error line with the cause", logs)
	}

	quiet := newTestbed(t, nil, func(c *Config) { c.AdminKey = adminKey })
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	quiet.relay.serveAdminOn(ln2)()
	if logs := quiet.logs.String(); strings.Contains(logs, "stopped serving") {
		t.Fatalf("a clean stop logged as a failure: %q", logs)
	}
}

// TestPublicStatusHidesClients: a status page served without the admin
// key (StatusPublic) counts who waits but names no client and shows no
// usage; with the key it shows both.
func TestPublicStatusHidesClients(t *testing.T) {
	tb, g := queueBed(t, func(c *Config) { c.AdminKey, c.StatusPublic = adminKey, true }, queueClients)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := []<-chan int{tb.send(ctx, "sk-heavy", "")}
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	done = append(done, tb.send(ctx, "sk-light", ""))
	tb.waitQueued(1)
	public := tb.relay.statusData(false)
	if q := public["queue"].(QueueStatus); q.Waiting != 1 || len(q.Flows) != 1 || q.Flows[0].Client != "" {
		t.Fatalf("public queue %+v: want 1 waiting, no client named", q)
	}
	if _, ok := public["usage"]; ok {
		t.Fatal("the public status data carries the usage")
	}
	if q := tb.relay.statusData(true)["queue"].(QueueStatus); len(q.Flows) != 1 || q.Flows[0].Client != "light" {
		t.Fatalf("operator's queue %+v: want the light client named", q)
	}
	for range len(done) {
		g.release <- struct{}{}
	}
	for _, d := range done {
		<-d
	}
}
