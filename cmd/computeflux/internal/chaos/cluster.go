package chaos

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// clusterSpec says what processes a cluster runs.
type clusterSpec struct {
	// Name prefixes progress lines ("chaos", "soak").
	Name string
	// Binary is the computeflux executable.
	Binary string
	// Dir holds identities, token and key files (required).
	Dir string
	// Agents is the number of engines, each with its agent.
	Agents int
	// RelayArgs, EngineArgs and AgentArgs are added to each process's
	// command line (a flag given twice takes the last value).
	RelayArgs, EngineArgs, AgentArgs []string
	// Env is added to every process's environment.
	Env []string
	// Keep, if set, says which JSON log lines the processes keep (see
	// procOptions).
	Keep func(logLine) bool
	// Progress receives one line per phase; Echo the processes' output.
	Progress, Echo io.Writer
}

// cluster is the running processes: a relay, sim engines and their
// agents, on loopback.
type cluster struct {
	spec     clusterSpec
	dir      string
	key      string
	adminKey string
	relay    *proc
	relayURL string
	adminURL string
	relayMA  string
	engines  []*proc
	engURL   []string
	agents   []*proc

	mu sync.Mutex // guards started, and agents while a run restarts one
	// started is every process started, restarted ones included.
	started []*proc
}

func newCluster(spec clusterSpec) *cluster { return &cluster{spec: spec, dir: spec.Dir} }

func (c *cluster) progress(format string, a ...any) {
	if c.spec.Progress != nil {
		fmt.Fprintf(c.spec.Progress, c.spec.Name+": "+format+"\n", a...)
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// launch starts a process of the binary and keeps it in c.started.
func (c *cluster) launch(name string, args ...string) (*proc, error) {
	p, err := startWith(name, c.spec.Binary, procOptions{Echo: c.spec.Echo, Env: c.spec.Env, Keep: c.spec.Keep}, args...)
	if err == nil {
		c.mu.Lock()
		c.started = append(c.started, p)
		c.mu.Unlock()
	}
	return p, err
}

// agent returns agent i's current process.
func (c *cluster) agent(i int) *proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.agents[i]
}

// processes returns every process started so far.
func (c *cluster) processes() []*proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*proc(nil), c.started...)
}

func (c *cluster) start() error {
	c.key = "sk-cf-" + randomHex(16)
	c.adminKey = randomHex(16)
	token := filepath.Join(c.dir, "token")
	keys := filepath.Join(c.dir, "keys")
	adminKey := filepath.Join(c.dir, "admin-key")
	if err := os.WriteFile(token, []byte(randomHex(32)), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(keys, []byte(c.key+"\n"), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(adminKey, []byte(c.adminKey+"\n"), 0o600); err != nil {
		return err
	}
	addrFile := filepath.Join(c.dir, "relay.addrs")
	var err error
	c.relay, err = c.launch("relay", append([]string{"relay",
		"--listen", "127.0.0.1:0", "--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1",
		"--identity", filepath.Join(c.dir, "relay.key"), "--token-file", token, "--api-keys-file", keys,
		"--addr-file", addrFile, "--admin-listen", "127.0.0.1:0", "--admin-key-file", adminKey, "--log-format", "json"},
		c.spec.RelayArgs...)...)
	if err != nil {
		return err
	}
	l, err := c.relay.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "relay http listening" })
	if err != nil {
		return err
	}
	c.relayURL = "http://" + l.str("addr")
	l, err = c.relay.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "relay admin listening" })
	if err != nil {
		return err
	}
	c.adminURL = "http://" + l.str("addr")
	b, err := os.ReadFile(addrFile)
	if err != nil {
		return fmt.Errorf("%s: relay addr file: %w", c.spec.Name, err)
	}
	c.relayMA = strings.TrimSpace(strings.Split(string(b), "\n")[0])
	for i := range c.spec.Agents {
		e, err := c.launch(fmt.Sprintf("engine-%d", i), append([]string{"sim-engine",
			"--listen", "127.0.0.1:0", "--log-format", "json"}, c.spec.EngineArgs...)...)
		if err != nil {
			return err
		}
		c.engines = append(c.engines, e)
		l, err := e.waitLog(startTimeout, func(l logLine) bool { return l.str("message") == "sim engine serving" })
		if err != nil {
			return err
		}
		c.engURL = append(c.engURL, l.str("url"))
	}
	for i := range c.spec.Agents {
		c.agents = append(c.agents, nil)
		if _, err := c.startAgent(i); err != nil {
			return err
		}
	}
	c.progress("relay %s, %d engines and agents up", c.relayURL, c.spec.Agents)
	return nil
}

func agentName(i int) string { return fmt.Sprintf("agent-%d", i) }

// startAgent starts agent i on its identity and waits for the relay to
// log its join, returning when it did.
func (c *cluster) startAgent(i int) (time.Time, error) {
	since := time.Now()
	a, err := c.launch(agentName(i), append([]string{"agent",
		"--relay", c.relayMA, "--token-file", filepath.Join(c.dir, "token"), "--upstream", c.engURL[i],
		"--name", agentName(i), "--identity", filepath.Join(c.dir, agentName(i)+".key"),
		"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--log-format", "json"}, c.spec.AgentArgs...)...)
	if err != nil {
		return time.Time{}, err
	}
	c.mu.Lock()
	c.agents[i] = a
	c.mu.Unlock()
	l, err := c.relay.waitLog(startTimeout, func(l logLine) bool {
		return l.at.After(since) && l.str("message") == "agent joined" && l.str("agent") == agentName(i)
	})
	return l.at, err
}

func (c *cluster) stop() {
	var wg sync.WaitGroup
	c.mu.Lock()
	procs := append(append([]*proc{c.relay}, c.agents...), c.engines...)
	c.mu.Unlock()
	for _, p := range procs {
		if p != nil {
			wg.Go(func() { p.stop(5 * time.Second) })
		}
	}
	wg.Wait()
}

// panics returns every panic the cluster's processes reported: lines in
// their logs (recovered by a server, or a crash), and the relay's counters
// of its own recovered panics and of those its agents publish in gossip.
// A process that exited by itself (not stopped) counts too: a crash may
// leave nothing else behind.
func (c *cluster) panics(ctx context.Context, client *http.Client) []string {
	var out []string
	for _, p := range c.processes() {
		for _, l := range p.panicked() {
			out = append(out, p.name+": "+l)
		}
		if alone, err := p.exitedAlone(); alone {
			out = append(out, fmt.Sprintf("%s exited by itself (%v); its last lines: %q", p.name, err, p.rawLines()))
		}
	}
	m, err := c.relayMetrics(ctx, client)
	if err != nil {
		return append(out, "relay: /metrics: "+err.Error())
	}
	for k, v := range m {
		if v > 0 && (strings.HasPrefix(k, "computeflux_panics_total{") || strings.HasPrefix(k, "computeflux_agent_panics_total{")) {
			out = append(out, fmt.Sprintf("relay: %s %v", k, v))
		}
	}
	if _, ok := m[`computeflux_panics_total{component="http"}`]; !ok {
		out = append(out, "relay: /metrics has no computeflux_panics_total")
	}
	return out
}

// relayMetrics returns the relay's /metrics as values by series.
func (c *cluster) relayMetrics(ctx context.Context, client *http.Client) (map[string]float64, error) {
	return fetchMetrics(ctx, client, c.relayURL+"/metrics")
}

// fetchMetrics returns a Prometheus text page's values by series (name and
// labels as written).
func fetchMetrics(ctx context.Context, client *http.Client, url string) (map[string]float64, error) {
	b, err := getBody(ctx, client, url)
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for line := range strings.Lines(string(b)) {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out, nil
}

// getBody GETs url and returns its body (at most 64 MiB), failing on a
// status other than 200.
func getBody(ctx context.Context, client *http.Client, url string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: status %d", url, resp.StatusCode)
	}
	return io.ReadAll(io.LimitReader(resp.Body, 64<<20))
}

// adminRow is the part of a routing table row (relay.TableRow) read here.
type adminRow struct {
	Name  string `json:"name"`
	State string `json:"state"`
}

// table returns the relay's routing table from its admin API.
func (c *cluster) table(ctx context.Context, client *http.Client) ([]adminRow, error) {
	var out struct {
		Endpoints []adminRow `json:"endpoints"`
	}
	err := c.adminDo(ctx, client, http.MethodGet, "/admin/v1/endpoints", &out)
	return out.Endpoints, err
}

// admin applies an admin action to endpoint name.
func (c *cluster) admin(ctx context.Context, client *http.Client, name, action string) error {
	return c.adminDo(ctx, client, http.MethodPost, "/admin/v1/endpoints/"+name+"/"+action, nil)
}

func (c *cluster) adminDo(ctx context.Context, client *http.Client, method, path string, into any) error {
	req, err := http.NewRequestWithContext(ctx, method, c.adminURL+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+c.adminKey)
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("%s: admin %s %s: %w", c.spec.Name, method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("%s: admin %s %s: %w", c.spec.Name, method, path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: admin %s %s: status %d: %s", c.spec.Name, method, path, resp.StatusCode, b)
	}
	if into == nil {
		return nil
	}
	if err := json.Unmarshal(b, into); err != nil {
		return fmt.Errorf("%s: admin %s %s: %w", c.spec.Name, method, path, err)
	}
	return nil
}
