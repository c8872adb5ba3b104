package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/agent/llamaengine"
)

// The audit scenario: agents that lie about their model among honest ones,
// as real processes (a relay, sim engines or llama.cpp engines, and one
// agent process each) under client load as chat front ends send it (no
// session key, sampled decoding, a user field, an API key per client),
// with the relay's audits at their defaults. Liars run another model for
// everything; fronts run the claimed model only for requests that look
// like audits by the earlier audits' own description, another for the
// rest. It reports when each cheater left routing and what every agent
// served before and after, and the audits' share of the tokens.

// Models of the audit scenario: sim engines serve SimModel, llama.cpp
// engines LlamaModel.
const (
	SimModel   = "m1"
	LlamaModel = "tiny"
)

// AuditGroup is a set of agents in the audit scenario serving one model.
// Agents of a group share an engine kind; honest ones run the scenario's
// seed 1 (or GGUF), liars seed 2.
type AuditGroup struct {
	// Honest and Liars count the agents of each kind.
	Honest, Liars int
	// Fronts counts cheating fronts: agents in front of a proxy that sends
	// the requests that look like audits by the earlier description of
	// them (greedy and at most 32 tokens, or no user field), and those
	// repeating a prompt it saw or naming a user it never saw, to an
	// engine of the claimed model, and everything else to one of another.
	Fronts int
	// Reference adds one more honest agent that the endpoints file marks
	// as the operator's reference for the group's model.
	Reference bool
	// Provider adds a provider endpoint in the endpoints file, an engine
	// of the honest model, serving the group's model (not a reference).
	Provider bool
	// Llama runs llama.cpp engines (llamaengine) serving tiny GGUF models
	// instead of sim engines.
	Llama bool
	// Model is the group's model name. Empty: SimModel or LlamaModel,
	// with the group's index when another group of its kind came first.
	Model string
}

// AuditConfig configures RunAudit. The zero value of every field but Binary
// means the default in its comment.
type AuditConfig struct {
	// Binary is the computeflux executable (required).
	Binary string
	// Dir holds identities, keys and models. Empty means a temporary
	// directory removed at the end.
	Dir string
	// Groups are the agents. Default: one sim group of 3 honest agents
	// and 1 liar.
	Groups []AuditGroup
	// Duration is the load's length. Default 2 minutes.
	Duration time.Duration
	// After, if not zero, ends the load this long after the last liar's
	// quarantine when that comes before Duration.
	After time.Duration
	// Workers are concurrent clients, each sending one request at a time,
	// keyless (no session), every other one streamed. Default 4; one in
	// four asks the llama.cpp model when a group runs it.
	Workers int
	// MaxTokens is each answer's length. Default 48.
	MaxTokens int
	// Greedy makes clients decode greedily (temperature 0) and send no
	// user field; the default is what chat front ends send: temperature
	// 0.8 and a user.
	Greedy bool
	// Window is the span at the end of the load over which each agent's
	// share is also reported. Default 30 s.
	Window time.Duration
	// TimeScale speeds up the sim engines. Default 4.
	TimeScale float64
	// RelayArgs are added to the relay's command line (--no-audits,
	// --audit-share ...).
	RelayArgs []string
	// Progress, if set, receives one line per phase; Echo the children's
	// log lines.
	Progress, Echo io.Writer
}

func (c *AuditConfig) populate() {
	if len(c.Groups) == 0 {
		c.Groups = []AuditGroup{{Honest: 3, Liars: 1}}
	}
	if c.Duration == 0 {
		c.Duration = 2 * time.Minute
	}
	if c.Workers == 0 {
		c.Workers = 4
	}
	if c.MaxTokens == 0 {
		c.MaxTokens = 48
	}
	if c.Window == 0 {
		c.Window = 30 * time.Second
	}
	if c.TimeScale == 0 {
		c.TimeScale = DefaultTimeScale
	}
}

// AuditAgent is one agent's part in the run.
type AuditAgent struct {
	Name  string
	Model string
	// Kind is "honest", "liar", "front" or "reference".
	Kind string
	// Served counts the client requests it served; First is when it served
	// its first, since the load began (-1 if none).
	Served int
	First  time.Duration
	// Quarantined is when the relay logged its quarantine for its model,
	// since the load began (0: never); Audit is the convicting audit and
	// Reason what it found.
	Quarantined   time.Duration
	Audit, Reason string
	// ServedAfter counts the requests it served of the AllAfter requests
	// for its model sent after its quarantine.
	ServedAfter, AllAfter int
	// Audits counts the audit rounds it took part in (as the subject or
	// as one of the others its answer was compared with);
	// AuditsToQuarantine those up to the convicting one.
	Audits, AuditsToQuarantine int
	// InWindow counts the requests it served of the AllInWindow for its
	// model sent in the last Window of the load.
	InWindow, AllInWindow int
	// Real and Cheap count, for a front, the requests it sent to the
	// claimed model and to the other one.
	Real, Cheap int
}

// AuditResult is what RunAudit saw.
type AuditResult struct {
	Agents []AuditAgent
	// Requests answered and failed, by model.
	Answered, Failed map[string]int
	Wall             time.Duration
	// AuditTokens and ServedTokens are the relay's counters at the end;
	// Share is its computeflux_audit_share.
	AuditTokens, ServedTokens, Share float64
	// Verdicts are the relay's verdict counts by outcome.
	Verdicts map[string]float64
	// Window is the span the InWindow counts cover.
	Window time.Duration
}

// Write prints the result.
func (r *AuditResult) Write(w io.Writer) {
	fmt.Fprintf(w, "audit (real processes): %v of load, answered %v, failed %v\n", r.Wall.Round(time.Second), r.Answered, r.Failed)
	fmt.Fprintf(w, "  audit tokens %.0f of %.0f served (share %.4f); verdicts %v\n", r.AuditTokens, r.ServedTokens, r.Share, r.Verdicts)
	for _, a := range r.Agents {
		total := r.Answered[a.Model]
		line := fmt.Sprintf("  %-18s %-6s %-9s served %4d (%5.1f%%), last %v %5.1f%% (%d of %d), in %d audits", a.Name, a.Model, a.Kind,
			a.Served, 100*float64(a.Served)/float64(max(total, 1)), r.Window, 100*float64(a.InWindow)/float64(max(a.AllInWindow, 1)),
			a.InWindow, a.AllInWindow, a.Audits)
		if a.Kind == "front" {
			line += fmt.Sprintf(", front sent %d to the claimed model, %d to another", a.Real, a.Cheap)
		}
		if a.Quarantined > 0 {
			line += fmt.Sprintf(", quarantined %v after its first request by its audit %d (%s), having served %d of %d; then %d of %d",
				(a.Quarantined - max(a.First, 0)).Round(100*time.Millisecond), a.AuditsToQuarantine, a.Audit,
				a.Served-a.ServedAfter, total-a.AllAfter, a.ServedAfter, a.AllAfter)
		}
		fmt.Fprintln(w, line)
	}
}

// Agent returns the named agent's part, or nil.
func (r *AuditResult) Agent(name string) *AuditAgent {
	for i := range r.Agents {
		if r.Agents[i].Name == name {
			return &r.Agents[i]
		}
	}
	return nil
}

// auditRun is the running processes of the scenario.
type auditRun struct {
	cfg     AuditConfig
	dir     string
	relay   *proc
	url     string
	relayMA string
	procs   []*proc
	llamas  []*llamaengine.Engine
	agents  []AuditAgent
	models  []string          // the groups' models, in order
	keys    []string          // the clients' API keys, one per worker
	fronts  []*front          // the cheating fronts
	frontOf map[string]*front // by agent name
}

func (a *auditRun) progress(format string, args ...any) {
	if a.cfg.Progress != nil {
		fmt.Fprintf(a.cfg.Progress, "audit: "+format+"\n", args...)
	}
}

// RunAudit starts the scenario's processes, runs the load, stops
// everything and returns what it saw. A group with Llama needs the
// llama.cpp engines (llamaengine.Available); errors are about the run
// itself.
func RunAudit(ctx context.Context, cfg AuditConfig) (*AuditResult, error) {
	cfg.populate()
	if cfg.Binary == "" {
		return nil, errors.New("chaos: no binary")
	}
	a := &auditRun{cfg: cfg, dir: cfg.Dir, frontOf: map[string]*front{}}
	if a.dir == "" {
		d, err := os.MkdirTemp("", "computeflux-audit-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		a.dir = d
	}
	defer a.stop()
	if err := a.start(ctx); err != nil {
		return nil, err
	}
	return a.run(ctx)
}

func (a *auditRun) start(ctx context.Context) error {
	token := filepath.Join(a.dir, "token")
	if err := os.WriteFile(token, []byte(randomHex(32)), 0o600); err != nil {
		return err
	}
	// One API key per client: the relay knows its clients apart, as a
	// shared relay does.
	var keys strings.Builder
	for w := range a.cfg.Workers {
		a.keys = append(a.keys, fmt.Sprintf("sk-audit-%d-%s", w, randomHex(8)))
		keys.WriteString(a.keys[w] + "\n")
	}
	keyFile := filepath.Join(a.dir, "api-keys")
	if err := os.WriteFile(keyFile, []byte(keys.String()), 0o600); err != nil {
		return err
	}
	// The agents, their engines' seeds, and the references.
	type member struct {
		AuditAgent
		seed  uint64
		llama bool
	}
	var members []member
	var refs []string
	var providers []string // endpoints file entries
	seen := map[bool]int{}
	for gi, g := range a.cfg.Groups {
		model, prefix := SimModel, fmt.Sprintf("sim%d", gi)
		if g.Llama {
			model, prefix = LlamaModel, fmt.Sprintf("llama%d", gi)
		}
		if seen[g.Llama] > 0 {
			model = fmt.Sprintf("%s-%d", model, gi)
		}
		seen[g.Llama]++
		if g.Model != "" {
			model = g.Model
		}
		a.models = append(a.models, model)
		add := func(kind string, n int, seed uint64) {
			for i := range n {
				name := fmt.Sprintf("%s-%s-%d", prefix, kind, i)
				members = append(members, member{AuditAgent: AuditAgent{Name: name, Model: model, Kind: kind, First: -1}, seed: seed, llama: g.Llama})
				if kind == "reference" {
					refs = append(refs, name)
				}
			}
		}
		if g.Reference {
			add("reference", 1, 1)
		}
		add("honest", g.Honest, 1)
		add("liar", g.Liars, 2)
		add("front", g.Fronts, 1)
		if g.Provider {
			up, err := a.engine(ctx, prefix+"-provider", model, 1, g.Llama)
			if err != nil {
				return err
			}
			kind := "computeflux-sim"
			if g.Llama {
				kind = "llamacpp"
			}
			providers = append(providers, fmt.Sprintf("  - {name: %s-provider, url: %s/v1, models: [%s], engine: %s}\n", prefix, up, model, kind))
		}
	}
	args := []string{"relay", "--api-keys-file", keyFile, "--listen", "127.0.0.1:0", "--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1",
		"--identity", filepath.Join(a.dir, "relay.key"), "--token-file", token, "--addr-file", filepath.Join(a.dir, "relay.addrs"),
		// Every agent runs on this machine, behind 127.0.0.1: each is a
		// voice of its own (the NAT lab's audit test has them behind
		// addresses of their own).
		"--audit-independence", "agent",
		"--log-format", "json"}
	if len(refs) > 0 || len(providers) > 0 {
		var b strings.Builder
		if len(refs) > 0 {
			b.WriteString("agents:\n")
			for _, r := range refs {
				fmt.Fprintf(&b, "  - name: %s\n    reference: true\n", r)
			}
		}
		if len(providers) > 0 {
			b.WriteString("endpoints:\n")
			for _, p := range providers {
				b.WriteString(p)
			}
		}
		ef := filepath.Join(a.dir, "endpoints.yaml")
		if err := os.WriteFile(ef, []byte(b.String()), 0o600); err != nil {
			return err
		}
		args = append(args, "--endpoints-file", ef)
	}
	args = append(args, a.cfg.RelayArgs...)
	var err error
	if a.relay, err = startWith("relay", a.cfg.Binary, procOptions{Echo: a.cfg.Echo}, args...); err != nil {
		return err
	}
	l, err := a.relay.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "relay http listening" })
	if err != nil {
		return err
	}
	a.url = "http://" + l.str("addr")
	b, err := os.ReadFile(filepath.Join(a.dir, "relay.addrs"))
	if err != nil {
		return fmt.Errorf("chaos: relay addr file: %w", err)
	}
	a.relayMA = strings.TrimSpace(strings.Split(string(b), "\n")[0])

	for _, m := range members {
		upstream, err := a.engine(ctx, m.Name, m.Model, m.seed, m.llama)
		if err != nil {
			return err
		}
		if m.Kind == "front" {
			cheap, err := a.engine(ctx, m.Name+"-cheap", m.Model, 2, m.llama)
			if err != nil {
				return err
			}
			f, err := newFront(upstream, cheap)
			if err != nil {
				return err
			}
			a.fronts = append(a.fronts, f)
			a.frontOf[m.Name] = f
			upstream = f.url
		}
		since := time.Now()
		ag, err := startWith(m.Name, a.cfg.Binary, procOptions{Echo: a.cfg.Echo}, "agent", "--relay", a.relayMA, "--token-file", token,
			"--upstream", upstream, "--name", m.Name, "--identity", filepath.Join(a.dir, m.Name+".key"),
			"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--drain-timeout", "2s", "--log-format", "json")
		if err != nil {
			return err
		}
		a.procs = append(a.procs, ag)
		if _, err := a.relay.waitLog(startTimeout, func(l logLine) bool {
			return l.at.After(since) && l.str("message") == "agent joined" && l.str("agent") == m.Name
		}); err != nil {
			return err
		}
		a.agents = append(a.agents, m.AuditAgent)
	}
	a.progress("relay %s with %d agents up", a.url, len(a.agents))
	return nil
}

// engine starts an engine serving model under name (its process's name),
// running seed's model: a sim engine, or llama.cpp serving the GGUF of
// seed; it returns its base URL.
func (a *auditRun) engine(ctx context.Context, name, model string, seed uint64, llama bool) (string, error) {
	if llama {
		path := filepath.Join(a.dir, fmt.Sprintf("tiny-%d.gguf", seed))
		if _, err := os.Stat(path); err != nil {
			if err := llamaengine.WriteModelFile(path, llamaengine.ModelConfig{Seed: seed}); err != nil {
				return "", err
			}
		}
		sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		e, err := llamaengine.Start(sctx, llamaengine.Config{Model: path, Name: model, Stderr: a.cfg.Echo})
		cancel()
		if err != nil {
			return "", err
		}
		a.llamas = append(a.llamas, e)
		return e.URL, nil
	}
	e, err := startWith(name+"-engine", a.cfg.Binary, procOptions{Echo: a.cfg.Echo}, "sim-engine", "--listen", "127.0.0.1:0",
		"--model", model, "--seed", strconv.FormatUint(seed, 10),
		"--time-scale", fmt.Sprint(a.cfg.TimeScale), "--log-format", "json")
	if err != nil {
		return "", err
	}
	a.procs = append(a.procs, e)
	l, err := e.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "sim engine serving" })
	if err != nil {
		return "", err
	}
	return l.str("url"), nil
}

func (a *auditRun) stop() {
	var wg sync.WaitGroup
	for _, p := range append([]*proc{a.relay}, a.procs...) {
		if p != nil {
			wg.Go(func() { p.stop(5 * time.Second) })
		}
	}
	for _, e := range a.llamas {
		wg.Go(func() { e.Close() })
	}
	for _, f := range a.fronts {
		f.close()
	}
	wg.Wait()
}

// liarsCaught reports whether the relay has logged the quarantine of
// every liar.
func (a *auditRun) liarsCaught() bool {
	left := map[string]bool{}
	for _, ag := range a.agents {
		if ag.Kind == "liar" || ag.Kind == "front" {
			left[ag.Name] = true
		}
	}
	for _, l := range a.relay.logs() {
		if l.str("message") == "agent quarantined for model" {
			delete(left, l.str("agent"))
		}
	}
	return len(left) == 0
}

// served is one answered request: when it was sent (since the load
// began), for which model, by whom.
type served struct {
	at    time.Duration
	model string
	agent string
}

func (a *auditRun) run(ctx context.Context) (*AuditResult, error) {
	tr := &http.Transport{MaxIdleConnsPerHost: a.cfg.Workers}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: DefaultReqTimeout}
	res := &AuditResult{Answered: map[string]int{}, Failed: map[string]int{}, Window: a.cfg.Window}
	var (
		mu   sync.Mutex
		log  []served
		wg   sync.WaitGroup
		stop = make(chan struct{})
	)
	start := time.Now()
	for w := range a.cfg.Workers {
		rng := rand.New(rand.NewPCG(uint64(w), 99))
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-ctx.Done():
					return
				default:
				}
				model := a.models[(w+i)%len(a.models)]
				sent := time.Since(start)
				agent, err := a.ask(ctx, client, w, model, rng, i%2 == 1)
				mu.Lock()
				if err != nil {
					res.Failed[model]++
					if res.Failed[model] <= 3 {
						a.progress("request for %s failed: %v", model, err)
					}
				} else {
					res.Answered[model]++
					log = append(log, served{at: sent, model: model, agent: agent})
				}
				mu.Unlock()
			}
		})
	}
	a.progress("load for %v", a.cfg.Duration)
	end := time.NewTimer(a.cfg.Duration)
	defer end.Stop()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for caught := false; ; {
		select {
		case <-ctx.Done():
		case <-end.C:
		case <-tick.C:
			if a.cfg.After > 0 && !caught && a.liarsCaught() {
				caught = true
				a.progress("every cheater quarantined; %v more", a.cfg.After)
				end.Reset(a.cfg.After)
			}
			continue
		}
		break
	}
	close(stop)
	wg.Wait()
	res.Wall = time.Since(start)
	if err := a.readMetrics(context.WithoutCancel(ctx), client, res); err != nil {
		return res, err
	}
	// Quarantines and audits from the relay's log (a line is timed when
	// read, after the relay changed the routing).
	quarantined := map[string]logLine{}
	audits, before := map[string]int{}, map[string]int{}
	for _, l := range a.relay.logs() {
		switch l.str("message") {
		case "agent quarantined for model":
			if _, ok := quarantined[l.str("agent")]; !ok {
				quarantined[l.str("agent")] = l
			}
		case "audit":
			// verdicts reads "name=outcome ..." for every participant.
			for v := range strings.FieldsSeq(l.str("verdicts")) {
				if name, _, ok := strings.Cut(v, "="); ok {
					audits[name]++
					// The quarantine is logged before the audit that
					// convicted.
					if q, ok := quarantined[name]; !ok || q.str("audit") == l.str("audit") {
						before[name]++
					}
				}
			}
		}
	}
	windowFrom := res.Wall - a.cfg.Window
	for _, ag := range a.agents {
		ag.Audits = audits[ag.Name]
		if _, ok := quarantined[ag.Name]; ok {
			ag.AuditsToQuarantine = before[ag.Name]
		}
		if l, ok := quarantined[ag.Name]; ok && l.at.After(start) {
			ag.Quarantined, ag.Audit, ag.Reason = l.at.Sub(start), l.str("audit"), l.str("reason")
		}
		if f := a.frontOf[ag.Name]; f != nil {
			ag.Real, ag.Cheap = f.counts()
		}
		for _, s := range log {
			if s.agent == ag.Name {
				ag.Served++
				if ag.First < 0 {
					ag.First = s.at
				}
			}
			if s.model == ag.Model && s.at >= windowFrom {
				ag.AllInWindow++
				if s.agent == ag.Name {
					ag.InWindow++
				}
			}
			if ag.Quarantined > 0 && s.model == ag.Model && s.at > ag.Quarantined {
				ag.AllAfter++
				if s.agent == ag.Name {
					ag.ServedAfter++
				}
			}
		}
		res.Agents = append(res.Agents, ag)
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, nil
}

// clientWords make the clients' prompts.
var clientWords = strings.Fields("alpha bravo river mountain green quick table window paper garden music " +
	"history letter market bridge winter summer light water city morning story travel friend number")

// ask sends one chat request for model as client w, with a prompt of its
// own, and returns the agent that served it. Decoding is sampled, with a
// user of the client's (from a pool of 8), unless Greedy.
func (a *auditRun) ask(ctx context.Context, client *http.Client, w int, model string, rng *rand.Rand, stream bool) (string, error) {
	var p strings.Builder
	for range 20 + rng.IntN(40) {
		p.WriteString(clientWords[rng.IntN(len(clientWords))])
		p.WriteByte(' ')
	}
	req := map[string]any{
		"model": model, "messages": []map[string]string{{"role": "user", "content": p.String()}},
		"max_tokens": a.cfg.MaxTokens, "stream": stream, "temperature": 0.8,
		"user": fmt.Sprintf("user-%d-%04d", w, 1000+rng.IntN(8)),
	}
	if a.cfg.Greedy {
		req["temperature"] = 0
		delete(req, "user")
	}
	body, _ := json.Marshal(req)
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, a.url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Authorization", "Bearer "+a.keys[w])
	resp, err := client.Do(hr)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("status %d: %.200s", resp.StatusCode, b)
	}
	if stream && !bytes.Contains(b, []byte("data: [DONE]")) {
		return "", errors.New("stream without [DONE]")
	}
	return resp.Header.Get("X-ComputeFlux-Agent"), nil
}

// readMetrics reads the relay's audit counters.
func (a *auditRun) readMetrics(ctx context.Context, client *http.Client, res *AuditResult) error {
	m, err := fetchMetrics(ctx, client, a.url+"/metrics")
	if err != nil {
		return err
	}
	res.AuditTokens, res.ServedTokens, res.Share = m["computeflux_audit_tokens_total"], m["computeflux_served_tokens_total"], m["computeflux_audit_share"]
	res.Verdicts = map[string]float64{}
	for name, v := range m {
		if o, ok := strings.CutPrefix(name, `computeflux_audit_verdicts_total{outcome="`); ok {
			res.Verdicts[strings.TrimSuffix(o, `"}`)] = v
		}
	}
	return nil
}
