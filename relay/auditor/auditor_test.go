package auditor

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// clock is a test clock moved by hand.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// fleet is a fake fleet: every member answers with a text that is a
// function of its model's seed and the request (its prompt and seed), as
// engines of one model under one seed do.
type fleet struct {
	mu      sync.Mutex
	members []Member
	model   map[string]string // member -> the model it really runs
	sent    map[string]int    // member -> requests it got
}

func (f *fleet) add(name, runs string, addr string, opts ...func(*Member)) {
	m := Member{Name: name, Models: []string{"m1"}, Kind: "llamacpp"}
	if addr != "" {
		m.Addr = netip.MustParseAddr(addr)
	}
	for _, o := range opts {
		o(&m)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.members = append(f.members, m)
	if f.model == nil {
		f.model, f.sent = map[string]string{}, map[string]int{}
	}
	f.model[name] = runs
}

func (f *fleet) fleet() []Member {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Member(nil), f.members...)
}

func (f *fleet) send(_ context.Context, req Request) (*http.Response, error) {
	f.mu.Lock()
	runs := f.model[req.Endpoint]
	f.sent[req.Endpoint]++
	f.mu.Unlock()
	h := sha256.Sum256(append([]byte(runs+"\x00"), req.Body...))
	text := strings.Repeat(hex.EncodeToString(h[:]), 2)
	body, _ := json.Marshal(map[string]any{"model": "m1", "choices": []any{map[string]any{"index": 0,
		"message": map[string]any{"role": "assistant", "content": text}, "finish_reason": "length"}},
		"usage": map[string]int{"prompt_tokens": len(req.Body) / 4, "completion_tokens": 32}})
	return &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"application/json"}},
		Body: io.NopCloser(strings.NewReader(string(body)))}, nil
}

func (f *fleet) requests(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.sent[name]
}

// testAuditor returns an auditor over f, never started: the test calls
// tick itself.
func testAuditor(t *testing.T, f *fleet, c *clock, edit func(*Config)) (*Auditor, map[string]float64) {
	weights := map[string]float64{}
	var mu sync.Mutex
	cfg := Config{
		Settings: Settings{Policy: audit.Policy{BackoffMin: time.Second}},
		Clock:    c, Logger: zerolog.New(io.Discard), Fleet: f.fleet, Send: f.send,
		SetWeight:     func(agent, model string, w float64) { mu.Lock(); weights[agent] = w; mu.Unlock() },
		Seed:          func(b []byte) []byte { return b },
		Pseudonym:     func(s string) string { return s },
		EngineHeaders: func(h http.Header) http.Header { return h.Clone() },
	}
	if edit != nil {
		edit(&cfg)
	}
	a := New(cfg)
	t.Cleanup(a.Close)
	return a, weights
}

// traffic hands the auditor n sampled client requests of m1.
func traffic(a *Auditor, c *clock, n int) {
	for i := range n {
		body := fmt.Sprintf(`{"model":"m1","messages":[{"role":"user","content":"question %d about the weather by the sea"}],"temperature":0.8,"max_tokens":48,"user":"u-%d"}`, i, i%5)
		a.Answered(&Exchange{Model: "m1", Client: fmt.Sprintf("c%d", i%4), Body: []byte(body), Header: http.Header{}})
		c.add(shapeEvery)
	}
}

// run ticks the auditor n times, a second apart, with traffic paying for
// the budget.
func run(a *Auditor, c *clock, n int) {
	for range n {
		a.Served(20000)
		a.tick()
		c.add(time.Second)
	}
}

func quarantined(a *Auditor, name string) bool {
	st, _ := a.Standing(name, "m1")
	return st.Quarantine != nil
}

// Small fleets are audited: two honest agents convict a third that runs
// another model; three agents of one network lying together are one
// voice and lose to two honest ones; a provider endpoint serving the
// model is a voice beside one honest agent; one honest agent and one liar
// alone decide nothing.
func TestSmallFleets(t *testing.T) {
	for _, tc := range []struct {
		name    string
		build   func(f *fleet)
		caught  []string
		cleared []string
	}{
		{"two honest, one liar", func(f *fleet) {
			f.add("h1", "good", "198.18.1.1")
			f.add("h2", "good", "198.18.2.1")
			f.add("liar", "cheap", "198.18.3.1")
		}, []string{"liar"}, []string{"h1", "h2"}},
		{"three liars behind one network, two honest", func(f *fleet) {
			f.add("h1", "good", "198.18.1.1")
			f.add("h2", "good", "198.18.2.1")
			for i := range 3 {
				f.add(fmt.Sprintf("liar%d", i), "cheap", fmt.Sprintf("198.18.9.%d", i+1))
			}
		}, []string{"liar0", "liar1", "liar2"}, []string{"h1", "h2"}},
		{"one honest, one liar, a provider", func(f *fleet) {
			f.add("h1", "good", "198.18.1.1")
			f.add("liar", "cheap", "198.18.3.1")
			f.add("cloud", "good", "", func(m *Member) { m.Provider = true })
		}, []string{"liar"}, []string{"h1"}},
		{"one honest, one liar", func(f *fleet) {
			f.add("h1", "good", "198.18.1.1")
			f.add("liar", "cheap", "198.18.3.1")
		}, nil, []string{"h1", "liar"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fleet{}
			tc.build(f)
			c := &clock{t: time.Unix(1_800_000_000, 0)}
			a, weights := testAuditor(t, f, c, nil)
			traffic(a, c, 10)
			run(a, c, 120)
			for _, n := range tc.caught {
				if !quarantined(a, n) || weights[n] != 0 {
					st, _ := a.Standing(n, "m1")
					t.Errorf("%s not quarantined: %+v", n, st)
				}
			}
			for _, n := range tc.cleared {
				if st, _ := a.Standing(n, "m1"); st.Quarantine != nil || st.Score < 0.9 {
					t.Errorf("%s: %+v", n, st)
				}
			}
			if st := a.Status(); float64(st.AuditTokens) > 0.02*float64(st.ServedTokens)+audit.DefaultBurst {
				t.Errorf("audits spent %d tokens of %d served", st.AuditTokens, st.ServedTokens)
			}
		})
	}
}

// An agent audited from the bank gets a prompt others answered before,
// alone: a new agent's first audits cost one request each once the bank
// holds prompts its network was never sent.
func TestBankAuditsAlone(t *testing.T) {
	f := &fleet{}
	for i := range 3 {
		f.add(fmt.Sprintf("h%d", i), "good", fmt.Sprintf("198.18.%d.1", i+1))
	}
	c := &clock{t: time.Unix(1_800_000_000, 0)}
	a, _ := testAuditor(t, f, c, nil)
	traffic(a, c, 10)
	run(a, c, 30)
	if a.Status().Bank == 0 {
		t.Fatal("no prompt kept in the bank")
	}
	before := map[string]int{}
	for i := range 3 {
		before[fmt.Sprintf("h%d", i)] = f.requests(fmt.Sprintf("h%d", i))
	}
	f.add("newcomer", "cheap", "198.18.9.1")
	run(a, c, 3)
	st := a.Status()
	var replays int
	for _, r := range st.Recent {
		if r.Subject == "newcomer" && r.Replay {
			replays++
			if len(r.Verdicts) != 1 {
				t.Errorf("a replay went to %v", r.Verdicts)
			}
		}
	}
	if replays == 0 || !quarantined(a, "newcomer") {
		s, _ := a.Standing("newcomer", "m1")
		t.Errorf("newcomer: %d replays, standing %+v", replays, s)
	}
}

// TestTapDueSampled: a model's answers are kept for the answer checks at
// most once every answerEvery; a client's re-check is always kept.
func TestTapDueSampled(t *testing.T) {
	c := &clock{t: time.Unix(1_800_000_000, 0)}
	a, _ := testAuditor(t, &fleet{}, c, nil)
	if !a.TapDue("m9", false) {
		t.Fatal("a model's first answer is not kept")
	}
	traffic(a, c, 1)
	a.Answered(&Exchange{Model: "m9", Body: []byte(`{"model":"m9","messages":[{"role":"user","content":"x"}]}`)})
	kept := 0
	for range 100 {
		if a.TapDue("m9", false) {
			kept++
		}
		c.add(answerEvery / 10)
	}
	// 100 requests over 10 answerEvery: one kept in each.
	if kept != 10 {
		t.Fatalf("kept %d answers of 100 over 10 intervals, want 10", kept)
	}
	if !a.TapDue("m9", true) {
		t.Fatal("an answer to re-check was not kept")
	}
}

// An agent that has served for a day is not outvoted by two newcomers of
// two networks lying together; with equal tenure it would be.
func TestTenureWeighsVotes(t *testing.T) {
	for _, tc := range []struct {
		name      string
		firstSeen time.Duration // the honest agent's tenure at the start
		convicted bool
	}{
		{"honest agent a day old", 48 * time.Hour, false},
		{"all new", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fleet{}
			f.add("h1", "good", "198.18.1.1")
			f.add("liar1", "cheap", "198.18.2.1")
			f.add("liar2", "cheap", "198.18.3.1")
			c := &clock{t: time.Unix(1_800_000_000, 0)}
			start := c.Now()
			a, _ := testAuditor(t, f, c, func(cfg *Config) {
				cfg.FirstSeen = func(agent string) time.Time {
					if agent == "h1" {
						return start.Add(-tc.firstSeen)
					}
					return time.Time{}
				}
			})
			traffic(a, c, 10)
			run(a, c, 60)
			if got := quarantined(a, "h1"); got != tc.convicted {
				st, _ := a.Standing("h1", "m1")
				t.Errorf("h1 quarantined %v, want %v: %+v", got, tc.convicted, st)
			}
		})
	}
}

// TestWhatACheaterGetsAwayWith pins the limits docs/audits.md states:
// an agent that claims an engine kind no other agent of its model runs
// is compared with nobody under sampled traffic (inconclusive, never
// convicted, and the admin API shows it); and a relay whose model has
// fewer than three clients writes its prompts from the built-in
// vocabulary, which a cheater can recognise.
func TestWhatACheaterGetsAwayWith(t *testing.T) {
	f := &fleet{}
	f.add("h1", "good", "198.18.1.1")
	f.add("h2", "good", "198.18.2.1")
	f.add("odd", "cheap", "198.18.3.1", func(m *Member) { m.Kind = "another-engine" })
	c := &clock{t: time.Unix(1_800_000_000, 0)}
	a, _ := testAuditor(t, f, c, nil)
	traffic(a, c, 10)
	run(a, c, 60)
	st, _ := a.Standing("odd", "m1")
	if st.Quarantine != nil || st.Audits != 0 || st.Inconclusive == 0 {
		t.Errorf("an agent of a kind of its own: %+v", st)
	}

	// Two clients only: the vocabulary.
	f2 := &fleet{}
	f2.add("h1", "good", "198.18.1.1")
	f2.add("h2", "good", "198.18.2.1")
	a2, _ := testAuditor(t, f2, c, nil)
	for i := range 10 {
		a2.Answered(&Exchange{Model: "m1", Client: fmt.Sprintf("c%d", i%2), Header: http.Header{},
			Body: []byte(`{"model":"m1","messages":[{"role":"user","content":"zebra quokka narwhal ocelot tapir zebra quokka narwhal"}],"temperature":0.8}`)})
		c.add(shapeEvery)
	}
	a2.mu.Lock()
	text := a2.traffic["m1"].phrases.Text(200, a2.rng)
	a2.mu.Unlock()
	for _, w := range strings.Fields(text) {
		if !slices.Contains(audit.Vocabulary, strings.ToLower(strings.TrimSuffix(w, "."))) {
			t.Errorf("two clients' text %q has %q: want the built-in vocabulary", text, w)
		}
	}
}
