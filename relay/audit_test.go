package relay_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/auditor"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/scheduler/audit"
)

// simEngine starts a simulated engine serving model m1 with seed: the same
// seed is the same model, another seed another model under the same name.
func simEngine(t testing.TB, seed uint64) string {
	t.Helper()
	srv, _ := relaytest.RunSimEngine(t, simengine.Config{Models: []string{"m1"}, TimeScale: 20,
		Engine: simengine.EngineConfig{Seed: seed}})
	return srv.URL()
}

const auditAdminKey = "admin-key-for-audit-tests"

// auditRelay starts a relay whose audits run fast: a round every 100 ms
// at most, every pair due every floor.
func auditRelay(t testing.TB, floor time.Duration, endpointsFile string) (*relaytest.Relay, *httptest.Server) {
	t.Helper()
	rl := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Token: []byte(itToken), APIKeys: []string{itKey},
		Logger: zerolog.New(io.Discard), AdminKey: auditAdminKey, AdminListen: "127.0.0.1:0",
		EndpointsFile: endpointsFile,
		// Every agent a voice: they all connect from 127.0.0.1.
		Audit: relay.AuditConfig{Interval: 100 * time.Millisecond, FloorEvery: floor, Timeout: 10 * time.Second,
			Independence: audit.ByAgent, Policy: audit.Policy{BackoffMin: 500 * time.Millisecond}},
	})
	admin := httptest.NewServer(rl.Relay.AdminHandler())
	t.Cleanup(admin.Close)
	return rl, admin
}

// sendTraffic sends n streamed chat requests for m1 and returns how many
// each agent served.
func sendTraffic(t testing.TB, rl *relaytest.Relay, n int) map[string]int {
	t.Helper()
	served := map[string]int{}
	for i := range n {
		body := fmt.Sprintf(`{"model":"m1","messages":[{"role":"user","content":"question %d about the weather in a city by the sea"}],"max_tokens":16,"stream":true}`, i)
		req, _ := http.NewRequest(http.MethodPost, rl.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+itKey)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i, resp.StatusCode)
		}
		served[resp.Header.Get(relay.HeaderAgent)]++
	}
	return served
}

func auditStatus(t testing.TB, admin *httptest.Server) auditor.Status {
	t.Helper()
	var st auditor.Status
	adminGet(t, admin, "/admin/v1/audits", &st)
	return st
}

// adminGet decodes the admin API's JSON answer at path into v.
func adminGet(t testing.TB, admin *httptest.Server, path string, v any) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, admin.URL+path, nil)
	req.Header.Set("Authorization", "Bearer "+auditAdminKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
}

func standing(st auditor.Status, agent string) (audit.Standing, bool) {
	for _, s := range st.Standings {
		if s.Agent == agent && s.Model == "m1" {
			return s, true
		}
	}
	return audit.Standing{}, false
}

func adminPost(t testing.TB, admin *httptest.Server, path, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, admin.URL+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+auditAdminKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestAuditQuarantinesAnotherModel: three agents in front of one model
// (seed 1) and one in front of another (seed 2) under the same name. The
// audits, through the real agents over QUIC, convict the fourth: it is
// quarantined for m1, serves no client request afterwards, and the admin
// API shows the audit that convicted it; the three keep full weight. The
// operator's release and quarantine by hand work through the admin API.
func TestAuditQuarantinesAnotherModel(t *testing.T) {
	rl, admin := auditRelay(t, 200*time.Millisecond, "")
	for i := range 3 {
		relaytest.RunAgent(t, relaytest.AgentConfig(fmt.Sprintf("honest-%d", i), itToken, simEngine(t, 1), rl.Addr()))
	}
	relaytest.RunAgent(t, relaytest.AgentConfig("liar", itToken, simEngine(t, 2), rl.Addr()))
	waitAgents(t, rl, "honest-0", "honest-1", "honest-2", "liar")
	sendTraffic(t, rl, 4) // the auditor shapes its prompts like traffic
	waitFor(t, "liar quarantined", func() bool { return rl.Relay.Scheduler().ModelWeight("liar", "m1") == 0 })

	st := auditStatus(t, admin)
	liar, ok := standing(st, "liar")
	if !ok || liar.Quarantine == nil || liar.Quarantine.Convicted.Audit == "" || liar.LastDisagreement.Against == "" {
		t.Fatalf("liar's standing: %+v", liar)
	}
	t.Logf("liar convicted by %s against %s: %s", liar.Quarantine.Convicted.Audit, liar.Quarantine.Convicted.Against, liar.Quarantine.Convicted.Reason)
	for i := range 3 {
		h, _ := standing(st, fmt.Sprintf("honest-%d", i))
		if h.Quarantine != nil || h.Weight != 1 || h.Audits == 0 || h.Agreements != h.Audits {
			t.Errorf("honest-%d: %+v", i, h)
		}
	}
	// The status page shows the quarantine with the convicting audit.
	var page struct{ Quarantined []auditor.QuarantineRow }
	adminGet(t, admin, "/status.json", &page)
	if len(page.Quarantined) != 1 || page.Quarantined[0].Agent != "liar" || page.Quarantined[0].Audit != liar.Quarantine.Convicted.Audit ||
		page.Quarantined[0].Reason == "" || page.Quarantined[0].Against == "" {
		t.Errorf("status page's quarantined: %+v", page.Quarantined)
	}
	if served := sendTraffic(t, rl, 40); served["liar"] != 0 {
		t.Errorf("quarantined liar served %d of 40: %v", served["liar"], served)
	}

	// By hand: the operator releases the liar; the audits convict it
	// again.
	if code, body := adminPost(t, admin, "/admin/v1/audits/release", `{"agent":"liar","model":"m1"}`); code != 200 {
		t.Fatalf("release: %d %s", code, body)
	}
	if w := rl.Relay.Scheduler().ModelWeight("liar", "m1"); w != 1 {
		t.Errorf("released liar's weight %v", w)
	}
	waitFor(t, "liar quarantined again", func() bool { return rl.Relay.Scheduler().ModelWeight("liar", "m1") == 0 })
	// The operator quarantines an honest agent: clean audits do not
	// release it.
	if code, body := adminPost(t, admin, "/admin/v1/audits/quarantine", `{"agent":"honest-0","model":"m1","reason":"maintenance"}`); code != 200 {
		t.Fatalf("quarantine: %d %s", code, body)
	}
	before, _ := standing(auditStatus(t, admin), "honest-0")
	waitFor(t, "honest-0 audited clean 3 times in quarantine", func() bool {
		h, _ := standing(auditStatus(t, admin), "honest-0")
		return h.Agreements >= before.Agreements+3
	})
	if w := rl.Relay.Scheduler().ModelWeight("honest-0", "m1"); w != 0 {
		t.Errorf("clean audits released an operator's quarantine: weight %v", w)
	}
	// Bad input: clear errors, nothing changed.
	for _, tc := range []struct{ path, body, code string }{
		{"/admin/v1/audits/quarantine", `{"agent":"x"`, "invalid_json"},
		{"/admin/v1/audits/quarantine", `{"agent":"","model":"m1"}`, "invalid_value"},
		{"/admin/v1/audits/release", `{"agent":"honest-1","model":"m1"}`, "not_quarantined"},
	} {
		code, body := adminPost(t, admin, tc.path, tc.body)
		if code/100 != 4 || !strings.Contains(body, `"code":"`+tc.code+`"`) {
			t.Errorf("%s %s: %d %s", tc.path, tc.body, code, body)
		}
	}
	// The metrics tell.
	resp, err := http.Get(rl.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"computeflux_agents_quarantined 2", `computeflux_audit_verdicts_total{outcome="disagree"}`, "computeflux_audit_tokens_total",
		`computeflux_agent_quarantined_since_seconds{agent="honest-0",audit="operator",model="m1"}`,
		`computeflux_agent_quarantined_since_seconds{agent="liar",audit="aud-`} {
		if !strings.Contains(string(mb), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// TestAuditNoEvidenceFromFaults: an agent whose engine refuses with 503
// (overloaded) and one whose engine cuts every stream short (as a restart
// mid-answer does) are audited beside four honest ones and never held to
// disagree: a fault is no evidence.
func TestAuditNoEvidenceFromFaults(t *testing.T) {
	rl, admin := auditRelay(t, 200*time.Millisecond, "")
	for i := range 4 {
		relaytest.RunAgent(t, relaytest.AgentConfig(fmt.Sprintf("honest-%d", i), itToken, simEngine(t, 1), rl.Addr()))
	}
	busy := faultEngine(t, simEngine(t, 1), "busy")
	cut := faultEngine(t, simEngine(t, 1), "cut")
	relaytest.RunAgent(t, relaytest.AgentConfig("busy", itToken, busy, rl.Addr()))
	relaytest.RunAgent(t, relaytest.AgentConfig("cut", itToken, cut, rl.Addr()))
	waitAgents(t, rl, "honest-0", "honest-1", "honest-2", "honest-3", "busy", "cut")
	sendTraffic(t, rl, 6)
	// Rounds of four: some with one faulty agent and three honest ones,
	// who would convict it if its fault counted as an answer.
	waitFor(t, "both faulty agents in 8 rounds", func() bool {
		st := auditStatus(t, admin)
		b, _ := standing(st, "busy")
		c, _ := standing(st, "cut")
		return b.Audits+b.Inconclusive >= 8 && c.Audits+c.Inconclusive >= 8
	})
	st := auditStatus(t, admin)
	for _, name := range []string{"busy", "cut", "honest-0", "honest-1", "honest-2", "honest-3"} {
		s, _ := standing(st, name)
		t.Logf("%s: %d audits, %d agreements, %d inconclusive", name, s.Audits, s.Agreements, s.Inconclusive)
		if s.Quarantine != nil || s.Audits != s.Agreements || s.Weight != 1 {
			t.Errorf("%s held to disagree: %+v", name, s)
		}
	}
}

// faultEngine is a front of the engine at upstream that passes everything
// but chat completions: "busy" answers them 503, "cut" ends every stream
// after its first event without the [DONE] (the engine "restarts"). It
// returns the front's URL.
func faultEngine(t testing.TB, upstream, mode string) string {
	return relaytest.Front(t, upstream, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if r.URL.Path != "/v1/chat/completions" {
			next.ServeHTTP(w, r)
			return
		}
		if mode == "busy" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"error":{"message":"overloaded","type":"server_error"}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n")
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	})
}

// recorder is an engine's answer to every chat request: the same text (so
// audits find everyone in agreement), and a record of what it got.
type recorder struct {
	mu   sync.Mutex
	reqs []recorded
}

type recorded struct {
	header http.Header
	body   []byte
}

func (rc *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/chat/completions" {
		http.NotFound(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	rc.mu.Lock()
	rc.reqs = append(rc.reqs, recorded{header: r.Header.Clone(), body: body})
	rc.mu.Unlock()
	var req struct {
		Stream bool `json:"stream"`
	}
	_ = json.Unmarshal(body, &req)
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"one answer for every prompt, from every engine"},"finish_reason":"stop"}],"usage":{"prompt_tokens":20,"completion_tokens":9}}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	_, _ = io.WriteString(w, "data: {\"model\":\"m1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"one answer for every prompt, from every engine\"}}]}\n\n"+
		"data: {\"model\":\"m1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n")
}

func (rc *recorder) all() []recorded {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return slices.Clone(rc.reqs)
}

// topKeys returns a JSON object's top-level keys in order.
func topKeys(t *testing.T, b []byte) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("not an object: %s", b)
	}
	var keys []string
	for dec.More() {
		tok, _ := dec.Token()
		keys = append(keys, tok.(string))
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

// TestAuditLooksLikeTraffic compares, at the engines behind four real
// agents, the requests of a client with the audits the relay sends: the
// same headers (the request ID fresh, of the same form), the same body
// fields in the same order with the same sampling parameters, stream
// options, user (the pseudonym every request of the client's carries) and
// a seed of the relay's as every request has one; tools of the same form
// under other names; messages of the same roles and sizes, and none of
// the client's words.
func TestAuditLooksLikeTraffic(t *testing.T) {
	rl, admin := auditRelay(t, 200*time.Millisecond, "")
	recs := make([]*recorder, 4)
	for i := range recs {
		recs[i] = &recorder{}
		eng := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: fmt.Sprintf("rec-%d", i)})
		eng.SetAnswer(recs[i].ServeHTTP)
		relaytest.RunAgent(t, relaytest.AgentConfig(eng.Name, itToken, eng.URL(), rl.Addr()))
	}
	waitAgents(t, rl, "rec-0", "rec-1", "rec-2", "rec-3")
	const clientWord = "zanzibar"
	clientBody := `{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"` +
		strings.Repeat(clientWord+" ", 40) + `"}],"model":"m1","stream":true,"stream_options":{"include_usage":true},"max_tokens":16,` +
		`"temperature":0.7,"top_p":0.9,"stop":["END"],"user":"u-42","tool_choice":"auto",` +
		`"tools":[{"type":"function","function":{"name":"zanzibar_lookup","description":"Look up zanzibar","parameters":{"type":"object","properties":{"place":{"type":"string"}},"required":["place"]}}}]}`
	for range 3 {
		req, _ := http.NewRequest(http.MethodPost, rl.URL+"/v1/chat/completions", strings.NewReader(clientBody))
		req.Header.Set("Authorization", "Bearer "+itKey)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "text/event-stream")
		req.Header.Set("OpenAI-Beta", "assistants=v2")
		req.Header.Set("X-Request-ID", "7f3a9c2e-0b1d-4e5f-8a6b-1c2d3e4f5a6b")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	waitFor(t, "an audit round", func() bool { return len(auditStatus(t, admin).Recent) > 0 })

	var client, audits []recorded
	for _, rc := range recs {
		for _, r := range rc.all() {
			if bytes.Contains(r.body, []byte(clientWord)) {
				client = append(client, r)
			} else {
				audits = append(audits, r)
			}
		}
	}
	if len(client) != 3 || len(audits) < 2 {
		t.Fatalf("%d client requests and %d audit requests at the engines", len(client), len(audits))
	}
	c := client[0]
	var cb map[string]any
	if err := json.Unmarshal(c.body, &cb); err != nil {
		t.Fatal(err)
	}
	for _, a := range audits {
		for name := range c.header {
			if name == "Content-Length" {
				continue // the audit's prompt is of a similar size, not the same
			}
			if name == "X-Request-Id" {
				if got, want := a.header.Get(name), c.header.Get(name); len(got) != len(want) || got == want || strings.Count(got, "-") != 4 {
					t.Errorf("audit X-Request-ID %q for the client's %q", got, want)
				}
				continue
			}
			if !slices.Equal(a.header[name], c.header[name]) {
				t.Errorf("header %s: audit %q, client %q", name, a.header[name], c.header[name])
			}
		}
		for name := range a.header {
			if _, ok := c.header[name]; !ok {
				t.Errorf("audit carries header %s the client's request did not", name)
			}
		}
		if ck, ak := topKeys(t, c.body), topKeys(t, a.body); !slices.Equal(ak, ck) || ck[0] != "seed" {
			t.Errorf("audit fields %v, client's %v (the relay's seed first)", ak, ck)
		}
		var ab map[string]any
		if err := json.Unmarshal(a.body, &ab); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "user", "tool_choice"} {
			if x, y := mustJSON(t, ab[k]), mustJSON(t, cb[k]); x != y {
				t.Errorf("%s: audit %s, client %s", k, x, y)
			}
		}
		if cb["user"] == "u-42" {
			t.Errorf("the agent got the client's own user %q", cb["user"])
		}
		if ab["seed"] == cb["seed"] {
			t.Errorf("the audit reused a client's seed %v", ab["seed"])
		}
		tool := ab["tools"].([]any)[0].(map[string]any)["function"].(map[string]any)
		params := tool["parameters"].(map[string]any)
		if tool["name"] == "zanzibar_lookup" || params["type"] != "object" || len(params["properties"].(map[string]any)) != 1 || len(params["required"].([]any)) != 1 {
			t.Errorf("audit tool %v", tool)
		}
		msgs := ab["messages"].([]any)
		size := 0
		for _, m := range msgs {
			size += len(m.(map[string]any)["content"].(string))
		}
		if len(msgs) != 2 || msgs[0].(map[string]any)["role"] != "system" || msgs[1].(map[string]any)["role"] != "user" || size < 200 || size > 600 {
			t.Errorf("audit body %s", a.body)
		}
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestAuditCollusion: two of three agents serve another model together.
// Two independent voices outvote one, so only an operator's reference
// catches them: with the honest one marked in the endpoints file, both
// liars are quarantined and the reference keeps all its traffic.
func TestAuditCollusion(t *testing.T) {
	ef := filepath.Join(t.TempDir(), "endpoints.yaml")
	if err := os.WriteFile(ef, []byte("agents:\n  - name: honest\n    reference: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	rl, admin := auditRelay(t, 200*time.Millisecond, ef)
	relaytest.RunAgent(t, relaytest.AgentConfig("honest", itToken, simEngine(t, 1), rl.Addr()))
	relaytest.RunAgent(t, relaytest.AgentConfig("liar-0", itToken, simEngine(t, 2), rl.Addr()))
	relaytest.RunAgent(t, relaytest.AgentConfig("liar-1", itToken, simEngine(t, 2), rl.Addr()))
	waitAgents(t, rl, "honest", "liar-0", "liar-1")
	sendTraffic(t, rl, 4)
	waitFor(t, "both liars quarantined", func() bool {
		return rl.Relay.Scheduler().ModelWeight("liar-0", "m1") == 0 && rl.Relay.Scheduler().ModelWeight("liar-1", "m1") == 0
	})
	st := auditStatus(t, admin)
	for _, name := range []string{"liar-0", "liar-1"} {
		s, _ := standing(st, name)
		if s.Quarantine == nil || s.Quarantine.Convicted.Against != "honest" {
			t.Errorf("%s: %+v", name, s)
		}
	}
	if s, ok := standing(st, "honest"); ok && (s.Quarantine != nil || s.Weight != 1) {
		t.Errorf("the operator's reference: %+v", s)
	}
	if served := sendTraffic(t, rl, 20); served["honest"] != 20 {
		t.Errorf("after the quarantines the reference served %v of 20", served)
	}
}

// TestClientVerify: a client that asks (verify: 1 in the clients file)
// has its own answers sent again, with the same seed, to the operator's
// reference, and an agent whose answers differ from the reference's is
// convicted by these re-checks alone (one conviction: its weight falls to
// a third, and regular audits would finish it): the client's requests carry legacy
// functions, which the auditor does not take as the form of its prompts,
// so no regular audit runs. The client's prompt reaches the agent that
// served it and the reference, and no other agent.
func TestClientVerify(t *testing.T) {
	dir := t.TempDir()
	ef := filepath.Join(dir, "endpoints.yaml")
	cf := filepath.Join(dir, "clients.yaml")
	if err := os.WriteFile(ef, []byte("agents:\n  - name: ref\n    reference: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cf, []byte("clients:\n  - name: careful\n    keys: ["+itKey+"]\n    verify: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	clients, err := relay.LoadClientsFile(cf)
	if err != nil {
		t.Fatal(err)
	}
	rl := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}, Token: []byte(itToken), Clients: clients,
		Logger: zerolog.New(io.Discard), AdminKey: auditAdminKey, AdminListen: "127.0.0.1:0", EndpointsFile: ef,
		Audit: relay.AuditConfig{Interval: 50 * time.Millisecond, Timeout: 10 * time.Second, Independence: audit.ByAgent},
	})
	admin := httptest.NewServer(rl.Relay.AdminHandler())
	t.Cleanup(admin.Close)
	other := &wordCounter{word: "kilimanjaro"}
	otherURL := other.front(t, simEngine(t, 1))
	relaytest.RunAgent(t, relaytest.AgentConfig("ref", itToken, simEngine(t, 1), rl.Addr()))
	relaytest.RunAgent(t, relaytest.AgentConfig("liar", itToken, simEngine(t, 2), rl.Addr()))
	relaytest.RunAgent(t, relaytest.AgentConfig("other", itToken, otherURL, rl.Addr()))
	waitAgents(t, rl, "ref", "liar", "other")
	servedOther := 0
	servedBy := map[string]int{}
	done := func() bool {
		st := auditStatus(t, admin)
		l, _ := standing(st, "liar")
		o, _ := standing(st, "other")
		return l.Audits > l.Agreements && o.Agreements > 0
	}
	for i := 0; i < 300 && !done(); i++ {
		body := fmt.Sprintf(`{"model":"m1","messages":[{"role":"user","content":"kilimanjaro question %d"}],"max_tokens":8,"temperature":0.7,"functions":[{"name":"f"}]}`, i)
		req, _ := http.NewRequest(http.MethodPost, rl.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+itKey)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		servedBy[resp.Header.Get(relay.HeaderAgent)]++
		if resp.Header.Get(relay.HeaderAgent) == "other" {
			servedOther++
		}
		time.Sleep(60 * time.Millisecond) // one re-check per audit interval
	}
	st := auditStatus(t, admin)
	t.Logf("served %v", servedBy)
	liar, _ := standing(st, "liar")
	var convicting *auditor.Record
	for i, r := range st.Recent {
		if r.ID == liar.LastDisagreement.Audit {
			convicting = &st.Recent[i]
		}
	}
	if convicting == nil || convicting.Why != "client" || liar.LastDisagreement.Against != "ref" || liar.Agreements != 0 {
		t.Fatalf("liar %+v, convicted by %+v", liar, convicting)
	}
	if h, _ := standing(st, "other"); h.Audits != h.Agreements || h.Audits == 0 {
		t.Errorf("honest agent: %+v", h)
	}
	if got := other.count(); got != servedOther {
		t.Errorf("the client's prompt reached the other agent %d times, but it served %d of its requests", got, servedOther)
	}
}

// wordCounter counts the chat requests that carry word on their way to
// an engine.
type wordCounter struct {
	word string
	mu   sync.Mutex
	n    int
}

func (w *wordCounter) front(t testing.TB, upstream string) string {
	return relaytest.Front(t, upstream, func(rw http.ResponseWriter, r *http.Request, next http.Handler) {
		body, _ := io.ReadAll(r.Body)
		if bytes.Contains(body, []byte(w.word)) {
			w.mu.Lock()
			w.n++
			w.mu.Unlock()
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(rw, r)
	})
}

func (w *wordCounter) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.n
}
