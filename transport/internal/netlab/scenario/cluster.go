package scenario

// Scenarios with the real binary: a computeflux relay on the public segment,
// and in each home a computeflux sim-engine on the home host's loopback with
// a computeflux agent next to it, every one a separate process in its
// namespace. The controller talks to the relay's OpenAI API from the client
// namespace and reads the processes' JSON logs.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/transport/internal/netlab"
)

// Lab addresses of the binary scenarios.
const (
	// RelayHTTP is the relay's OpenAI API on the public segment.
	RelayHTTP = netlab.RelayIP + ":8080"
	// RelayP2P is the relay's libp2p listen address.
	RelayP2P = "/ip4/" + netlab.RelayIP + "/udp/4001/quic-v1"
	// EngineListen is each home's sim-engine, on the home host's loopback.
	EngineListen = "127.0.0.1:8000"
	// SharedModel is served by every home; HomeModel(i) by home i only, so
	// that a request for it proves the path to that home, and the relay's
	// model list shows whether that home is routable.
	SharedModel = "lab-shared"
)

// HomeModel is the model only home i's engine serves.
func HomeModel(i int) string { return fmt.Sprintf("lab-h%d", i) }

// AgentName is home i's agent name.
func AgentName(i int) string { return fmt.Sprintf("h%d", i) }

// Features are the optional flags the binary under test understands; the
// harness passes them only when present, so it runs against older binaries.
type Features struct {
	RelayPublicCIDR bool // relay --public-cidr
	AgentPublicCIDR bool // agent --public-cidr
	Gossip          bool // relay and agent take part in gossip (--no-gossip exists)
}

// Probe reads the features from the binary's help texts.
func Probe(bin string) (Features, error) {
	help := func(cmd string) (string, error) {
		out, err := exec.Command(bin, cmd, "-h").CombinedOutput()
		// -h exits 0 with flag.ErrHelp; anything else without usage text is
		// a broken binary.
		if err != nil && !bytes.Contains(out, []byte("Usage of")) {
			return "", fmt.Errorf("%s %s -h: %w: %s", bin, cmd, err, out)
		}
		return string(out), nil
	}
	r, err := help("relay")
	if err != nil {
		return Features{}, err
	}
	a, err := help("agent")
	if err != nil {
		return Features{}, err
	}
	return Features{
		RelayPublicCIDR: strings.Contains(r, "-public-cidr"),
		AgentPublicCIDR: strings.Contains(a, "-public-cidr"),
		Gossip:          strings.Contains(r, "-no-gossip") && strings.Contains(a, "-no-gossip"),
	}, nil
}

// ClusterConfig describes a cluster.
type ClusterConfig struct {
	// Bin is the computeflux binary (required).
	Bin string
	// Dir holds the token, identities and one log file per process
	// (required; the caller removes it).
	Dir string
	// Homes is one NAT kind per home; each home gets an engine and an agent.
	Homes []netlab.NATKind
	// Prefix and Logf are passed to netlab.
	Prefix string
	Logf   func(string, ...any)
	// Seeds are the homes' engine seeds, by home; a missing or zero one
	// is i+1 (every home another model of SharedModel).
	Seeds []uint64
	// RelayArgs and AgentArgs are added to the relay's and agents' flags.
	RelayArgs, AgentArgs []string
	// Features overrides the probe of the binary when set.
	Features *Features
	// Env is added to every process's environment (e.g. GOLOG_LOG_LEVEL for
	// libp2p's own logs).
	Env []string
}

// Cluster is a lab running the computeflux binary.
type Cluster struct {
	Lab      *netlab.Lab
	Features Features
	// Relay is the current relay process; RelayID its peer ID (stable across
	// restarts: the identity is kept in Dir).
	Relay   *Process
	RelayID string
	Engines []*Process
	Agents  []*Process // nil entries for agents not running
	// Extra are agents added to homes by AddAgent.
	Extra []*Process

	cfg    ClusterConfig
	client *http.Client
	mu     sync.Mutex // guards procs
	procs  []*Process
}

// NewCluster builds the lab and starts the relay, then every home's engine
// and agent, and waits until every agent has joined. On error everything
// started is stopped and the lab removed.
func NewCluster(ctx context.Context, cfg ClusterConfig) (c *Cluster, err error) {
	if cfg.Bin == "" || cfg.Dir == "" {
		return nil, errors.New("scenario: cluster needs Bin and Dir")
	}
	var feat Features
	if cfg.Features != nil {
		feat = *cfg.Features
	} else if feat, err = Probe(cfg.Bin); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(cfg.Dir, "token"), []byte("netlab-join-secret\n"), 0o600); err != nil {
		return nil, err
	}
	lab, err := netlab.New(netlab.Config{Homes: cfg.Homes, Prefix: cfg.Prefix, Logf: cfg.Logf})
	if err != nil {
		return nil, err
	}
	c = &Cluster{Lab: lab, Features: feat, cfg: cfg, client: lab.HTTPClient(lab.Client.NS)}
	c.Agents = make([]*Process, len(cfg.Homes))
	defer func() {
		if err != nil {
			c.Close()
			c = nil
		}
	}()
	if err := c.StartRelay(ctx); err != nil {
		return nil, err
	}
	for i := range cfg.Homes {
		e, err := c.startEngine(ctx, i)
		if err != nil {
			return nil, err
		}
		c.Engines = append(c.Engines, e)
	}
	for i := range cfg.Homes {
		if err := c.StartAgent(ctx, i); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Close stops every process (agents first, so that they leave cleanly) and
// removes the lab.
func (c *Cluster) Close() {
	c.client.CloseIdleConnections()
	stopAll := func(ps []*Process) {
		var wg sync.WaitGroup
		for _, p := range ps {
			if p == nil {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				p.Stop(3 * time.Second)
			}()
		}
		wg.Wait()
	}
	stopAll(c.Agents)
	stopAll(c.Extra)
	c.mu.Lock()
	procs := slices.Clone(c.procs)
	c.mu.Unlock()
	stopAll(procs)
	_ = c.Lab.Close()
}

func (c *Cluster) start(ns, name string, argv ...string) (*Process, error) {
	// A restarted process gets a log of its own: relay.log, relay-2.log, ...
	c.mu.Lock()
	n := 0
	for _, p := range c.procs {
		if p.Name == name {
			n++
		}
	}
	c.mu.Unlock()
	file := name + ".log"
	if n > 0 {
		file = fmt.Sprintf("%s-%d.log", name, n+1)
	}
	f, err := os.Create(filepath.Join(c.cfg.Dir, file))
	if err != nil {
		return nil, err
	}
	lb := newLogBook(f)
	p, err := c.Lab.Start(ns, c.cfg.Env, lb, append([]string{c.cfg.Bin}, argv...)...)
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	pr := &Process{Name: name, Log: lb, Started: time.Now(), proc: p, file: f, drained: make(chan struct{})}
	// Standard output carries a line or two (addresses, peer ID): keep it in
	// the same book, so that the pipe never fills.
	go func() {
		defer close(pr.drained)
		_, _ = io.Copy(lb, p.Stdout)
	}()
	c.mu.Lock()
	c.procs = append(c.procs, pr)
	c.mu.Unlock()
	return pr, nil
}

func (c *Cluster) path(name string) string { return filepath.Join(c.cfg.Dir, name) }

// StartRelay starts a relay (a new process; the identity file persists) and
// waits until it serves HTTP.
func (c *Cluster) StartRelay(ctx context.Context) error {
	args := []string{"relay",
		"--listen", RelayHTTP,
		"--p2p-listen", RelayP2P,
		"--identity", c.path("relay.key"),
		"--token-file", c.path("token"),
		"--addr-file", c.path("relay.addrs"),
		"--no-auth",
		"--log-format", "json", "--log-level", "debug",
	}
	if c.Features.RelayPublicCIDR {
		args = append(args, "--public-cidr", netlab.PublicCIDR)
	}
	args = append(args, c.cfg.RelayArgs...)
	p, err := c.start(c.Lab.Relay.NS, "relay", args...)
	if err != nil {
		return err
	}
	c.Relay = p
	l, err := p.Log.Wait(ctx, Msg("relay p2p listening"))
	if err != nil {
		return fmt.Errorf("relay start: %w\n%s", err, p.Log.Tail(20))
	}
	c.RelayID, _ = l.Fields["peer"].(string)
	if c.RelayID == "" {
		return fmt.Errorf("relay start: no peer ID in %s", l.Raw)
	}
	if _, err := p.Log.Wait(ctx, Msg("relay http listening")); err != nil {
		return fmt.Errorf("relay start: %w\n%s", err, p.Log.Tail(20))
	}
	return nil
}

// StopRelay ends the relay with SIGTERM (a clean restart).
func (c *Cluster) StopRelay() {
	c.Relay.Stop(10 * time.Second)
}

// KillRelay ends the relay with SIGKILL (a crash: no goodbye to anyone).
func (c *Cluster) KillRelay() {
	c.Relay.Kill()
}

func (c *Cluster) startEngine(ctx context.Context, i int) (*Process, error) {
	seed := uint64(i + 1)
	if i < len(c.cfg.Seeds) && c.cfg.Seeds[i] != 0 {
		seed = c.cfg.Seeds[i]
	}
	p, err := c.start(c.Lab.Homes[i].NS, "engine-"+AgentName(i), "sim-engine",
		"--listen", EngineListen,
		"--model", SharedModel, "--model", HomeModel(i),
		"--time-scale", "20", "--default-max-tokens", "8", "--seed", fmt.Sprint(seed),
		"--log-format", "json", "--log-level", "warn",
	)
	if err != nil {
		return nil, err
	}
	if _, err := p.Log.Wait(ctx, Contains("sim-engine listening")); err != nil {
		return nil, fmt.Errorf("engine %d: %w\n%s", i, err, p.Log.Tail(20))
	}
	return p, nil
}

// StartAgent starts home i's agent and waits until it has joined the relay.
func (c *Cluster) StartAgent(ctx context.Context, i int) error {
	p, err := c.startAgent(ctx, i, AgentName(i), "4001")
	if p != nil {
		c.Agents[i] = p
	}
	return err
}

// AddAgent starts one more agent in home i, named name, in front of the
// home's engine, and waits until it has joined: several agents behind one
// NAT, as one person can run.
func (c *Cluster) AddAgent(ctx context.Context, i int, name string) error {
	p, err := c.startAgent(ctx, i, name, "0")
	if p != nil {
		c.mu.Lock()
		c.Extra = append(c.Extra, p)
		c.mu.Unlock()
	}
	return err
}

func (c *Cluster) startAgent(ctx context.Context, i int, name, port string) (*Process, error) {
	args := []string{"agent",
		"--relay", RelayP2P + "/p2p/" + c.RelayID,
		"--token-file", c.path("token"),
		"--upstream", "http://" + EngineListen,
		"--name", name,
		"--identity", c.path(name + ".key"),
		"--p2p-listen", "/ip4/0.0.0.0/udp/" + port + "/quic-v1",
		"--drain-timeout", "2s",
		"--log-format", "json", "--log-level", "debug",
	}
	if c.Features.AgentPublicCIDR {
		args = append(args, "--public-cidr", netlab.PublicCIDR)
	}
	args = append(args, c.cfg.AgentArgs...)
	p, err := c.start(c.Lab.Homes[i].NS, "agent-"+name, args...)
	if err != nil {
		return nil, err
	}
	if _, err := p.Log.Wait(ctx, Msg("joined relay")); err != nil {
		return p, fmt.Errorf("agent %s: %w\n%s", name, err, p.Log.Tail(20))
	}
	if l, err := p.Log.Wait(ctx, Contains("agent peer ID: ")); err == nil {
		p.PeerID = strings.TrimSpace(l.Raw[strings.Index(l.Raw, "agent peer ID: ")+len("agent peer ID: "):])
	}
	return p, nil
}

// Process is one computeflux process of a cluster.
type Process struct {
	Name    string
	Log     *LogBook
	Started time.Time
	PeerID  string // agents: the peer ID the agent printed

	proc    *netlab.Proc
	file    *os.File
	drained chan struct{}
	once    sync.Once
}

// PID is the process's ID.
func (p *Process) PID() int { return p.proc.PID }

// Running reports whether the process has not exited.
func (p *Process) Running() bool {
	select {
	case <-p.proc.Done():
		return false
	default:
		return true
	}
}

// Stop ends the process (SIGTERM, then SIGKILL after grace) and closes its
// log file. Safe to call more than once.
func (p *Process) Stop(grace time.Duration) {
	p.once.Do(func() {
		_ = p.proc.Stdin.Close()
		p.proc.Stop(grace)
		<-p.drained
		p.Log.close()
		_ = p.file.Close()
	})
}

// Kill ends the process with SIGKILL and closes its log file.
func (p *Process) Kill() {
	p.once.Do(func() {
		_ = p.proc.Stdin.Close()
		p.proc.Kill()
		<-p.drained
		p.Log.close()
		_ = p.file.Close()
	})
}

// Line is one line a process wrote, with the time the controller read it.
type Line struct {
	At     time.Time
	Raw    string
	Fields map[string]any // the JSON object, nil for other lines
}

// Message is the log line's "message" field.
func (l Line) Message() string { s, _ := l.Fields["message"].(string); return s }

// Str returns field k as a string ("" when absent or not a string).
func (l Line) Str(k string) string { s, _ := l.Fields[k].(string); return s }

// Msg matches JSON log lines whose message is m.
func Msg(m string) func(Line) bool { return func(l Line) bool { return l.Message() == m } }

// Contains matches lines containing s.
func Contains(s string) func(Line) bool {
	return func(l Line) bool { return strings.Contains(l.Raw, s) }
}

// LogBook keeps a process's output lines, copies them to a file (each line
// prefixed with the time it was read), and lets callers wait for a line. It is an io.Writer safe for concurrent use.
type LogBook struct {
	mu      sync.Mutex // guards the following fields
	w       io.Writer
	partial []byte
	lines   []Line
	changed chan struct{} // closed and replaced on every new line
	closed  bool
}

func newLogBook(w io.Writer) *LogBook {
	return &LogBook{w: w, changed: make(chan struct{})}
}

// Write implements io.Writer.
func (b *LogBook) Write(p []byte) (int, error) {
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.partial = append(b.partial, p...)
	added := false
	for {
		i := bytes.IndexByte(b.partial, '\n')
		if i < 0 {
			break
		}
		raw := string(bytes.TrimRight(b.partial[:i], "\r"))
		b.partial = b.partial[i+1:]
		if b.w != nil {
			// The processes' own timestamps have one-second resolution:
			// the file gets the controller's, to the microsecond.
			_, _ = fmt.Fprintf(b.w, "%s %s\n", now.Format("15:04:05.000000"), raw)
		}
		l := Line{At: now, Raw: raw}
		if strings.HasPrefix(raw, "{") {
			var f map[string]any
			if json.Unmarshal([]byte(raw), &f) == nil {
				l.Fields = f
			}
		}
		b.lines = append(b.lines, l)
		added = true
	}
	if added {
		close(b.changed)
		b.changed = make(chan struct{})
	}
	return len(p), nil
}

func (b *LogBook) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.w = nil
	if !b.closed {
		b.closed = true
		close(b.changed)
	}
}

// Len is the number of lines so far; pass it to WaitFrom to wait for lines
// written after now.
func (b *LogBook) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.lines)
}

// Lines returns the lines from index from on that match (nil match: all).
func (b *LogBook) Lines(from int, match func(Line) bool) []Line {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []Line
	for _, l := range b.lines[min(from, len(b.lines)):] {
		if match == nil || match(l) {
			out = append(out, l)
		}
	}
	return out
}

// Wait returns the first line matching match, waiting for it until ctx ends.
func (b *LogBook) Wait(ctx context.Context, match func(Line) bool) (Line, error) {
	return b.WaitFrom(ctx, 0, match)
}

// WaitFrom is Wait over the lines from index from on.
func (b *LogBook) WaitFrom(ctx context.Context, from int, match func(Line) bool) (Line, error) {
	for {
		b.mu.Lock()
		for i := from; i < len(b.lines); i++ {
			if match(b.lines[i]) {
				l := b.lines[i]
				b.mu.Unlock()
				return l, nil
			}
		}
		from = max(from, len(b.lines))
		ch, closed := b.changed, b.closed
		b.mu.Unlock()
		if closed {
			return Line{}, errors.New("process output ended")
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return Line{}, ctx.Err()
		}
	}
}

// Tail returns the last n lines as text, for error messages.
func (b *LogBook) Tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var sb strings.Builder
	for _, l := range b.lines[max(0, len(b.lines)-n):] {
		sb.WriteString("\t" + l.Raw + "\n")
	}
	return sb.String()
}

// Completion is the outcome of one request through the relay.
type Completion struct {
	Status   int
	Agent    string // X-ComputeFlux-Agent
	Affinity string // X-ComputeFlux-Affinity
	Content  string // the answer's text
	Chunks   int    // streamed chunks with content
	Done     bool   // a stream ended with [DONE]
	Latency  time.Duration
}

// Complete sends one chat completion to the relay from the client namespace.
// session, when set, goes in X-Session-ID.
func (c *Cluster) Complete(ctx context.Context, model, session string, stream bool) (Completion, error) {
	var out Completion
	body, _ := json.Marshal(map[string]any{
		"model":      model,
		"stream":     stream,
		"max_tokens": 8,
		"messages":   []map[string]string{{"role": "user", "content": "netlab: say something about " + session}},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+RelayHTTP+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return out, err
	}
	req.Header.Set("Content-Type", "application/json")
	if session != "" {
		req.Header.Set("X-Session-ID", session)
	}
	t := time.Now()
	resp, err := c.client.Do(req)
	if err != nil {
		return out, err
	}
	defer resp.Body.Close()
	out.Status = resp.StatusCode
	out.Agent = resp.Header.Get("X-ComputeFlux-Agent")
	out.Affinity = resp.Header.Get("X-ComputeFlux-Affinity")
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		out.Latency = time.Since(t)
		return out, fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
	}
	if !stream {
		var r struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
		}
		err = json.NewDecoder(resp.Body).Decode(&r)
		out.Latency = time.Since(t)
		if err != nil {
			return out, fmt.Errorf("decoding the answer: %w", err)
		}
		if len(r.Choices) == 0 {
			return out, errors.New("answer without choices")
		}
		out.Content = r.Choices[0].Message.Content
		return out, nil
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		return out, fmt.Errorf("stream answered with Content-Type %q", ct)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			out.Done = true
			break
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			return out, fmt.Errorf("stream chunk %q: %w", data, err)
		}
		if len(ch.Choices) > 0 && ch.Choices[0].Delta.Content != "" {
			out.Content += ch.Choices[0].Delta.Content
			out.Chunks++
		}
	}
	out.Latency = time.Since(t)
	if err := sc.Err(); err != nil {
		return out, fmt.Errorf("reading the stream: %w", err)
	}
	if !out.Done {
		return out, errors.New("stream ended without [DONE]")
	}
	return out, nil
}

// Models returns the relay's model list (the models of routable agents).
func (c *Cluster) Models(ctx context.Context) ([]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+RelayHTTP+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("models: status %d", resp.StatusCode)
	}
	var r struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return nil, err
	}
	var ids []string
	for _, m := range r.Data {
		ids = append(ids, m.ID)
	}
	return ids, nil
}

// Poll calls f every interval until it returns true, an error, or ctx ends.
func Poll(ctx context.Context, interval time.Duration, f func(context.Context) (bool, error)) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		ok, err := f(ctx)
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
