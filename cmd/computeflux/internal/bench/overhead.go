package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The overhead benchmark measures what the relay path itself costs: a stub
// engine that answers at once is reached directly, through frp (when its
// binaries are given), through Go's reverse proxy and the stock floor
// (baselines built of stock parts, see floor.go) and through a real relay
// and agent, each run as a process of the computeflux binary, as users run
// them. Every phase visits
// the targets interleaved, so that all of them see the same machine state,
// and reports each path against direct.

// Environment variables naming frp's binaries for OverheadConfig.
const (
	EnvFRPS = "COMPUTEFLUX_FRPS"
	EnvFRPC = "COMPUTEFLUX_FRPC"
)

// EnvPprof names the loopback address on which the computeflux binary serves
// net/http/pprof when set (see cmd/computeflux). The overhead benchmark sets
// it on its relay and agent when asked for profiles.
const EnvPprof = "COMPUTEFLUX_PPROF"

// OverheadConfig configures RunOverhead. Zero values are the defaults.
type OverheadConfig struct {
	// Binary is the computeflux binary run as relay and agent (default: the
	// running executable).
	Binary string
	// BaseBinary, when set, is a second computeflux binary timed in the same
	// run as path "computeflux-base": before and after a change, side by side.
	BaseBinary string
	// RelayArgs and BaseRelayArgs are added to the command line of the
	// relay of Binary and of BaseBinary (for instance --ledger-file none on
	// one side only: a mechanism's cost, side by side). Each relay keeps its
	// usage ledger, as by default, in a file of its own in the run's
	// directory.
	RelayArgs, BaseRelayArgs []string
	// FRPS and FRPC are frp's server and client binaries (default: the
	// COMPUTEFLUX_FRPS and COMPUTEFLUX_FRPC environment variables). frp is
	// timed only when both are set.
	FRPS, FRPC string
	// Sequential is the number of requests per kind (small, stream) and
	// target, one at a time (default 2000).
	Sequential int
	// Concurrent is the number of small requests per target sent by Clients
	// clients at once (default 10000).
	Concurrent int
	// Clients is the number of concurrent clients (default 32).
	Clients int
	// Rounds is how many times the whole measurement is repeated; the report
	// gives medians over rounds (default 3).
	Rounds int
	// LogLevel is the relay's and agent's --log-level (default info, what
	// users run).
	LogLevel string
	// ProfileDir, when set, receives CPU and allocation profiles of the relay
	// and the agent taken under the concurrent load after the rounds.
	ProfileDir string
	// ProfileSeconds is how long the CPU profiles run (default 10).
	ProfileSeconds int
	// Progress receives progress lines; nil means none.
	Progress io.Writer
}

func (c *OverheadConfig) defaults() {
	if c.Binary == "" {
		c.Binary, _ = os.Executable()
	}
	if c.FRPS == "" {
		c.FRPS = os.Getenv(EnvFRPS)
	}
	if c.FRPC == "" {
		c.FRPC = os.Getenv(EnvFRPC)
	}
	if c.Sequential <= 0 {
		c.Sequential = 2000
	}
	if c.Concurrent <= 0 {
		c.Concurrent = 10000
	}
	if c.Clients <= 0 {
		c.Clients = 32
	}
	if c.Rounds <= 0 {
		c.Rounds = 3
	}
	if c.LogLevel == "" {
		c.LogLevel = "info"
	}
	if c.ProfileSeconds <= 0 {
		c.ProfileSeconds = 10
	}
}

// Bounds on the benchmark's load, whatever the flags say.
const (
	maxSequential = 100000
	maxConcurrent = 500000
	maxClients    = 1024
	maxRounds     = 20
)

// OverheadRound is one round's figures for one path.
type OverheadRound struct {
	SmallP50, SmallP99   time.Duration // whole small response, sequential
	StreamP50, StreamP99 time.Duration // a stream's first byte, sequential
	LoadP50, LoadP99     time.Duration // small responses at Clients clients
	RPS                  float64       // small requests per second at Clients clients
	// CPUPerRequest is the CPU time of the path's own processes (user plus
	// system) per request of the concurrent phase, by process; empty for
	// direct.
	CPUPerRequest map[string]time.Duration
	Errors        int64
}

// OverheadPath is one path's rounds and their medians against direct.
type OverheadPath struct {
	Name   string
	Rounds []OverheadRound
	// Medians over rounds of the figure minus direct's in the same round
	// (ratio for throughput).
	AddedSmallP50, AddedSmallP99   time.Duration
	AddedStreamP50, AddedStreamP99 time.Duration
	AddedLoadP50                   time.Duration
	LoadP50                        time.Duration
	RPS, RPSRatio                  float64
	CPUPerRequest                  map[string]time.Duration
	Errors                         int64 // failed requests over all rounds, and a third party's failed warm-up requests
	NoStream                       bool  // streams were not timed (the Added* stream figures are 0)
}

// OverheadReport is RunOverhead's result.
type OverheadReport struct {
	Sequential, Concurrent, Clients, Rounds int
	LoadBefore, LoadAfter                   string // /proc/loadavg around the run
	Paths                                   []*OverheadPath
	Profiles                                []string // files written to ProfileDir
}

// target is one path to the stub engine.
type target struct {
	name   string
	url    string
	client *http.Client
	procs  []*proc // the path's own processes, for CPU time
	rounds []OverheadRound
	// noStream: streamed requests are not timed on this path.
	noStream bool
	// foreign: a third party's path (frp), whose failed warm-up requests
	// are counted in its errors (warmErrs) rather than ending the run;
	// frp's http proxy drops a request now and then.
	foreign  bool
	warmErrs int64
}

// RunOverhead starts the stub engine, the paths to it and measures them; it
// stops every process it started before returning.
func RunOverhead(ctx context.Context, cfg OverheadConfig) (_ *OverheadReport, err error) {
	cfg.defaults()
	cfg.Sequential = min(cfg.Sequential, maxSequential)
	cfg.Concurrent = min(cfg.Concurrent, maxConcurrent)
	cfg.Clients = min(cfg.Clients, maxClients)
	cfg.Rounds = min(cfg.Rounds, maxRounds)
	progress := func(format string, args ...any) {
		if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, format+"\n", args...)
		}
	}
	dir, err := os.MkdirTemp("", "computeflux-overhead-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)

	eng, err := startStubEngine()
	if err != nil {
		return nil, err
	}
	defer func() {
		// An engine that stopped serving under the run spoils its figures.
		if cerr := eng.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()

	var procs []*proc
	defer func() {
		for _, p := range procs {
			p.stop()
		}
	}()
	targets := []*target{{name: "direct", url: eng.url}}

	if cfg.FRPS != "" && cfg.FRPC != "" {
		progress("starting frp (%s, %s)", cfg.FRPS, cfg.FRPC)
		fts, fps, err := startFRP(ctx, cfg.FRPS, cfg.FRPC, dir, eng.port)
		procs = append(procs, fps...)
		if err != nil {
			return nil, fmt.Errorf("frp: %w", err)
		}
		targets = append(targets, fts...)
	} else {
		progress("frp not timed: set %s and %s to its binaries", EnvFRPS, EnvFRPC)
	}

	progress("starting Go's reverse proxy (%s)", cfg.Binary)
	gt, gp, err := startReverseProxy(ctx, cfg, dir, eng.url)
	if gp != nil {
		procs = append(procs, gp)
	}
	if err != nil {
		return nil, fmt.Errorf("go-reverse-proxy: %w", err)
	}
	targets = append(targets, gt)

	progress("starting the stock floor's relay and agent sides (%s)", cfg.Binary)
	ft, fps, err := startStockFloor(ctx, cfg, dir, eng.url)
	procs = append(procs, fps...)
	if err != nil {
		return nil, fmt.Errorf("stock-floor: %w", err)
	}
	targets = append(targets, ft)

	progress("starting relay and agent (%s)", cfg.Binary)
	ct, cps, pprofAddrs, err := startComputeflux(ctx, cfg, dir, eng.url, "")
	procs = append(procs, cps...)
	if err != nil {
		return nil, fmt.Errorf("computeflux: %w", err)
	}
	targets = append(targets, ct)
	if cfg.BaseBinary != "" {
		bc := cfg
		bc.Binary, bc.ProfileDir, bc.RelayArgs = cfg.BaseBinary, "", cfg.BaseRelayArgs
		progress("starting base relay and agent (%s)", bc.Binary)
		bt, bps, _, err := startComputeflux(ctx, bc, dir, eng.url, "base-")
		procs = append(procs, bps...)
		if err != nil {
			return nil, fmt.Errorf("computeflux-base: %w", err)
		}
		bt.name = "computeflux-base"
		targets = append(targets, bt)
	}

	for _, t := range targets {
		tr := &http.Transport{
			MaxIdleConnsPerHost: cfg.Clients * 2,
			MaxIdleConns:        cfg.Clients * 8,
			DisableCompression:  true,
		}
		defer tr.CloseIdleConnections()
		t.client = &http.Client{Transport: tr, Timeout: 30 * time.Second}
		if err := t.warm(ctx, 200); err != nil {
			return nil, fmt.Errorf("%s: warm-up: %w", t.name, err)
		}
	}

	rep := &OverheadReport{Sequential: cfg.Sequential, Concurrent: cfg.Concurrent, Clients: cfg.Clients, Rounds: cfg.Rounds, LoadBefore: loadavg()}
	for round := 0; round < cfg.Rounds; round++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		progress("round %d/%d: %d sequential requests per kind and path, %d at %d clients per path", round+1, cfg.Rounds, cfg.Sequential, cfg.Concurrent, cfg.Clients)
		if err := measureRound(ctx, cfg, targets, round); err != nil {
			return nil, err
		}
	}
	rep.LoadAfter = loadavg()

	if cfg.ProfileDir != "" {
		progress("profiling relay and agent for %ds at %d clients", cfg.ProfileSeconds, cfg.Clients)
		files, err := profile(ctx, cfg, ct, pprofAddrs)
		if err != nil {
			return nil, fmt.Errorf("profile: %w", err)
		}
		rep.Profiles = files
	}

	for _, t := range targets {
		rep.Paths = append(rep.Paths, summarizeOverhead(t, targets[0]))
	}
	return rep, nil
}

// measureRound runs the sequential and the concurrent phases once.
func measureRound(ctx context.Context, cfg OverheadConfig, targets []*target, round int) error {
	n := len(targets)
	small := make([][]time.Duration, n)
	stream := make([][]time.Duration, n)
	errs := make([]int64, n)
	// Sequential: each request goes to every target in turn, the order
	// rotating, so that no path always follows another.
	for i := 0; i < cfg.Sequential; i++ {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		for j := 0; j < n; j++ {
			k := (i + j) % n
			t := targets[k]
			if d, err := t.do(ctx, false); err == nil {
				small[k] = append(small[k], d)
			} else {
				errs[k]++
			}
			if t.noStream {
				continue
			}
			if d, err := t.do(ctx, true); err == nil {
				stream[k] = append(stream[k], d)
			} else {
				errs[k]++
			}
		}
	}
	// Concurrent: one target at a time (at once they would share the CPU),
	// in an order that rotates with the round.
	load := make([][]time.Duration, n)
	rps := make([]float64, n)
	cpu := make([]map[string]time.Duration, n)
	for j := 0; j < n; j++ {
		k := (round + j) % n
		t := targets[k]
		before := cpuTimes(t.procs)
		lat, el, e := t.load(ctx, cfg.Clients, cfg.Concurrent, 0)
		after := cpuTimes(t.procs)
		errs[k] += e
		load[k] = lat
		rps[k] = float64(len(lat)) / el.Seconds()
		if len(t.procs) > 0 && len(lat) > 0 {
			cpu[k] = map[string]time.Duration{}
			for i, p := range t.procs {
				if before[i] >= 0 && after[i] >= 0 {
					cpu[k][p.name] = (after[i] - before[i]) / time.Duration(len(lat))
				}
			}
		}
	}
	for k, t := range targets {
		r := OverheadRound{RPS: rps[k], CPUPerRequest: cpu[k], Errors: errs[k]}
		r.SmallP50, r.SmallP99 = percentile(small[k], .50), percentile(small[k], .99)
		r.StreamP50, r.StreamP99 = percentile(stream[k], .50), percentile(stream[k], .99)
		r.LoadP50, r.LoadP99 = percentile(load[k], .50), percentile(load[k], .99)
		t.rounds = append(t.rounds, r)
	}
	return nil
}

// summarizeOverhead takes medians over rounds of t's figures against direct's in
// the same round.
func summarizeOverhead(t, direct *target) *OverheadPath {
	p := &OverheadPath{Name: t.name, Rounds: t.rounds, CPUPerRequest: map[string]time.Duration{}, NoStream: t.noStream}
	var as50, as99, at50, at99, al50, l50 []time.Duration
	var rps, ratio []float64
	cpu := map[string][]time.Duration{}
	for i, r := range t.rounds {
		d := direct.rounds[i]
		as50 = append(as50, r.SmallP50-d.SmallP50)
		as99 = append(as99, r.SmallP99-d.SmallP99)
		at50 = append(at50, r.StreamP50-d.StreamP50)
		at99 = append(at99, r.StreamP99-d.StreamP99)
		al50 = append(al50, r.LoadP50-d.LoadP50)
		l50 = append(l50, r.LoadP50)
		rps = append(rps, r.RPS)
		if d.RPS > 0 {
			ratio = append(ratio, r.RPS/d.RPS)
		}
		for k, v := range r.CPUPerRequest {
			cpu[k] = append(cpu[k], v)
		}
		p.Errors += r.Errors
	}
	p.Errors += t.warmErrs
	p.AddedSmallP50, p.AddedSmallP99 = median(as50), median(as99)
	if !t.noStream {
		p.AddedStreamP50, p.AddedStreamP99 = median(at50), median(at99)
	}
	p.AddedLoadP50, p.LoadP50 = median(al50), median(l50)
	p.RPS = median(rps)
	if len(ratio) > 0 {
		p.RPSRatio = median(ratio)
	}
	for k, v := range cpu {
		p.CPUPerRequest[k] = median(v)
	}
	return p
}

// WriteTable prints the report as a table, one row per path.
func (r *OverheadReport) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "Relay path overhead: stub engine answering at once; %d sequential requests per kind and path, %d small requests at %d clients per path; medians of %d rounds, each path against direct in the same round.\n",
		r.Sequential, r.Concurrent, r.Clients, r.Rounds)
	fmt.Fprintf(&b, "load average before: %s, after: %s\n\n", r.LoadBefore, r.LoadAfter)
	ms := func(d time.Duration) string { return fmt.Sprintf("%+.3f ms", float64(d)/1e6) }
	fmt.Fprintf(&b, "| path | added p50, small | added p99, small | added p50, stream first byte | added p99, stream first byte | p50 at %d clients | req/s at %d clients | vs direct | CPU per request | errors |\n", r.Clients, r.Clients)
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, p := range r.Paths {
		cpu := "-"
		if len(p.CPUPerRequest) > 0 {
			var names []string
			for k := range p.CPUPerRequest {
				names = append(names, k)
			}
			slices.Sort(names)
			var parts []string
			var total time.Duration
			for _, k := range names {
				parts = append(parts, fmt.Sprintf("%s %d", k, p.CPUPerRequest[k].Microseconds()))
				total += p.CPUPerRequest[k]
			}
			cpu = fmt.Sprintf("%d us (%s)", total.Microseconds(), strings.Join(parts, " + "))
		}
		if p.Name == "direct" {
			d := p.Rounds
			var s50, s99, t50, t99 []time.Duration
			for _, x := range d {
				s50, s99, t50, t99 = append(s50, x.SmallP50), append(s99, x.SmallP99), append(t50, x.StreamP50), append(t99, x.StreamP99)
			}
			fmt.Fprintf(&b, "| direct | (%.3f ms) | (%.3f ms) | (%.3f ms) | (%.3f ms) | %.2f ms | %.0f | 1.00x | - | %d |\n",
				float64(median(s50))/1e6, float64(median(s99))/1e6, float64(median(t50))/1e6, float64(median(t99))/1e6,
				float64(p.LoadP50)/1e6, p.RPS, p.Errors)
			continue
		}
		t50, t99 := ms(p.AddedStreamP50), ms(p.AddedStreamP99)
		if p.NoStream {
			t50, t99 = "-", "-"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %.2f ms | %.0f | %.2fx | %s | %d |\n", p.Name,
			ms(p.AddedSmallP50), ms(p.AddedSmallP99), t50, t99,
			float64(p.LoadP50)/1e6, p.RPS, p.RPSRatio, cpu, p.Errors)
	}
	for _, f := range r.Profiles {
		fmt.Fprintf(&b, "profile: %s\n", f)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// Request bodies: a small chat completion, and the same streamed.
const (
	smallBody  = `{"model":"m1","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	streamBody = `{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
)

// do sends one request and returns the time to the whole response (small)
// or to its first body byte (stream); a stream is then read to its end.
func (t *target) do(ctx context.Context, stream bool) (time.Duration, error) {
	body := smallBody
	if stream {
		body = streamBody
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.url+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := t.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return 0, fmt.Errorf("status %d", resp.StatusCode)
	}
	var one [1]byte
	if stream {
		if _, err := io.ReadFull(resp.Body, one[:]); err != nil {
			return 0, err
		}
		d := time.Since(start)
		rest, err := io.ReadAll(resp.Body)
		if err != nil {
			return 0, err
		}
		if !bytes.Contains(rest, []byte("data: [DONE]")) {
			return 0, errors.New("stream ended without [DONE]")
		}
		return d, nil
	}
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

func (t *target) warm(ctx context.Context, n int) error {
	for i := 0; i < n; i++ {
		if _, err := t.do(ctx, i%2 == 1 && !t.noStream); err != nil {
			if !t.foreign || ctx.Err() != nil {
				return err
			}
			t.warmErrs++
		}
	}
	_, _, errs := t.load(ctx, 32, 500, 0)
	if errs > 0 && !t.foreign {
		return fmt.Errorf("%d failed requests", errs)
	}
	t.warmErrs += errs
	if t.warmErrs > int64(n+500)/10 {
		return fmt.Errorf("%d of %d requests failed", t.warmErrs, n+500)
	}
	return nil
}

// load sends n small requests from clients goroutines (or, with n == 0,
// requests until d has passed) and returns their latencies and the elapsed
// time.
func (t *target) load(ctx context.Context, clients, n int, d time.Duration) ([]time.Duration, time.Duration, int64) {
	var next, errs atomic.Int64
	lats := make([][]time.Duration, clients)
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if n > 0 {
					if next.Add(1) > int64(n) {
						return
					}
				} else if time.Now().After(deadline) {
					return
				}
				lat, err := t.do(ctx, false)
				if err != nil {
					errs.Add(1)
					continue
				}
				lats[c] = append(lats[c], lat)
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	var all []time.Duration
	for _, l := range lats {
		all = append(all, l...)
	}
	return all, el, errs.Load()
}

// stubEngine answers at once: a small JSON completion, or a short stream of
// server-sent events, each flushed; GET /v1/models names model m1.
type stubEngine struct {
	srv      *http.Server
	url      string
	port     int
	served   chan struct{} // closed when Serve returns
	serveErr error         // why Serve returned, unless Close ended it
}

func startStubEngine() (*stubEngine, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"object":"list","data":[{"id":"m1","object":"model","owned_by":"bench"}]}`)
	})
	const reply = `{"id":"cmpl-1","object":"chat.completion","created":1,"model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`
	events := []string{
		`{"id":"cmpl-1","object":"chat.completion.chunk","created":1,"model":"m1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`,
		`{"id":"cmpl-1","object":"chat.completion.chunk","created":1,"model":"m1","choices":[{"index":0,"delta":{"content":"hel"}}]}`,
		`{"id":"cmpl-1","object":"chat.completion.chunk","created":1,"model":"m1","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}`,
	}
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		if !bytes.Contains(b, []byte(`"stream":true`)) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", strconv.Itoa(len(reply)))
			io.WriteString(w, reply)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
		f, _ := w.(http.Flusher)
		for _, ev := range events {
			io.WriteString(w, "data: "+ev+"\n\n")
			if f != nil {
				f.Flush()
			}
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	s := &stubEngine{srv: &http.Server{Handler: mux}, url: "http://" + ln.Addr().String(), port: ln.Addr().(*net.TCPAddr).Port, served: make(chan struct{})}
	go func() {
		defer close(s.served)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.serveErr = err
		}
	}()
	return s, nil
}

// Close stops the engine and returns why it stopped serving before, if it
// did on its own: the figures measured with it would not be worth much.
func (s *stubEngine) Close() error {
	err := s.srv.Close()
	<-s.served
	if s.serveErr != nil {
		return fmt.Errorf("stub engine stopped serving: %w", s.serveErr)
	}
	return err
}

// proc is a child process of the benchmark.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// childEnv is a child's environment: inherited with extra appended, but
// for COMPUTEFLUX_* variables (as the chaos run's children get it). Those
// would set the relay's and the agent's flags under measurement, and
// EnvPprof, which the benchmark gives each child its own address in when it
// profiles, would go to every child: all but the first would fail to listen
// on it and exit.
func childEnv(inherited, extra []string) []string {
	out := make([]string, 0, len(inherited)+len(extra))
	for _, kv := range inherited {
		if !strings.HasPrefix(kv, "COMPUTEFLUX_") {
			out = append(out, kv)
		}
	}
	return append(out, extra...)
}

func startProc(ctx context.Context, name, dir string, env []string, bin string, args ...string) (*proc, error) {
	logPath := filepath.Join(dir, name+".log")
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Env = childEnv(os.Environ(), env)
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		lf.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// tail is the end of the process's log, for error messages.
func (p *proc) tail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// cpuTimes returns the user plus system CPU time of each process so far
// (from /proc; -1 where it cannot be read).
func cpuTimes(ps []*proc) []time.Duration {
	out := make([]time.Duration, len(ps))
	for i, p := range ps {
		out[i] = procCPU(p.cmd.Process.Pid)
	}
	return out
}

// clockTick is USER_HZ, 100 on every Linux architecture Go supports.
const clockTick = 100

func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return -1
	}
	// The command name may hold spaces: fields count from after its ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return -1
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return -1
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64) // field 14, utime
	st, err2 := strconv.ParseInt(f[12], 10, 64) // field 15, stime
	if err1 != nil || err2 != nil {
		return -1
	}
	return time.Duration(ut+st) * time.Second / clockTick
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// freePort returns a loopback TCP or UDP port free at the time of the call.
func freePort(network string) (int, error) {
	if network == "udp" {
		c, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		defer c.Close()
		return c.LocalAddr().(*net.UDPAddr).Port, nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// waitReady polls url until it answers 200 and its body holds want.
func waitReady(ctx context.Context, url, want string, ps []*proc) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c := &http.Client{Timeout: 2 * time.Second}
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if resp, err := c.Do(req); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && strings.Contains(string(b), want) {
				return nil
			}
		}
		for _, p := range ps {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited: %s", p.name, p.tail())
			default:
			}
		}
		select {
		case <-ctx.Done():
			var logs []string
			for _, p := range ps {
				logs = append(logs, p.name+": "+p.tail())
			}
			return fmt.Errorf("%s not ready: %w\n%s", url, ctx.Err(), strings.Join(logs, "\n"))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// startFRP starts one frps with a TCP and a QUIC port, and one frpc per
// transport, each exposing the engine as a tcp proxy.
func startFRP(ctx context.Context, frps, frpc, dir string, enginePort int) ([]*target, []*proc, error) {
	bindPort, err := freePort("tcp")
	if err != nil {
		return nil, nil, err
	}
	quicPort, err := freePort("udp")
	if err != nil {
		return nil, nil, err
	}
	vhostPort, err := freePort("tcp")
	if err != nil {
		return nil, nil, err
	}
	const token = "computeflux-bench"
	srvConf := filepath.Join(dir, "frps.toml")
	if err := os.WriteFile(srvConf, fmt.Appendf(nil, "bindAddr = \"127.0.0.1\"\nbindPort = %d\nquicBindPort = %d\nvhostHTTPPort = %d\nproxyBindAddr = \"127.0.0.1\"\nauth.token = %q\nlog.level = \"warn\"\n",
		bindPort, quicPort, vhostPort, token), 0o600); err != nil {
		return nil, nil, err
	}
	s, err := startProc(ctx, "frps", dir, nil, frps, "-c", srvConf)
	if err != nil {
		return nil, nil, err
	}
	procs := []*proc{s}
	if err := waitTCP(ctx, fmt.Sprintf("127.0.0.1:%d", bindPort), s); err != nil {
		return nil, procs, err
	}
	var targets []*target
	// frp-tcp and frp-quic are frp's tcp proxy (frps copies bytes; frpc
	// too) over each transport; frp-http is its http proxy, where frps
	// serves HTTP (Go's net/http and httputil.ReverseProxy) and routes by
	// Host: one HTTP hop, the nearest of frp's modes to a relay that must
	// read each request to route it.
	for _, tr := range []struct{ name, proto, kind string }{{"frp-tcp", "tcp", "tcp"}, {"frp-quic", "quic", "tcp"}, {"frp-http", "tcp", "http"}} {
		remote, err := freePort("tcp")
		if err != nil {
			return nil, procs, err
		}
		port := bindPort
		if tr.proto == "quic" {
			port = quicPort
		}
		proxy := fmt.Sprintf("type = \"tcp\"\nremotePort = %d\n", remote)
		if tr.kind == "http" {
			remote = vhostPort
			proxy = "type = \"http\"\ncustomDomains = [\"127.0.0.1\"]\n"
		}
		conf := filepath.Join(dir, tr.name+".toml")
		if err := os.WriteFile(conf, fmt.Appendf(nil, "serverAddr = \"127.0.0.1\"\nserverPort = %d\nauth.token = %q\nlog.level = \"warn\"\nloginFailExit = false\ntransport.protocol = %q\n\n[[proxies]]\nname = %q\n%slocalIP = \"127.0.0.1\"\nlocalPort = %d\n",
			port, token, tr.proto, tr.name, proxy, enginePort), 0o600); err != nil {
			return nil, procs, err
		}
		c, err := startProc(ctx, tr.name+"-frpc", dir, nil, frpc, "-c", conf)
		if err != nil {
			return nil, procs, err
		}
		procs = append(procs, c)
		t := &target{name: tr.name, url: fmt.Sprintf("http://127.0.0.1:%d", remote), procs: []*proc{s, c}, foreign: true}
		if err := waitReady(ctx, t.url+"/v1/models", `"m1"`, []*proc{s, c}); err != nil {
			return nil, procs, err
		}
		targets = append(targets, t)
	}
	// frps serves both transports; its CPU is split by the phases, which
	// run one target at a time.
	for _, t := range targets {
		t.procs[0] = &proc{name: "frps", cmd: s.cmd, log: s.log, done: s.done}
		t.procs[1].name = "frpc"
	}
	return targets, procs, nil
}

// ServeReverseProxy serves Go's httputil.ReverseProxy in front of upstream
// on addr (a loopback host:port: it has no auth) until ctx ends: one HTTP
// hop in stock Go (net/http parses the request, http.Transport sends it on
// a pooled connection), the least an HTTP-reading relay costs before any
// routing, auth or second hop.
func ServeReverseProxy(ctx context.Context, addr, upstream string) error {
	if err := checkLoopbackHostPort(addr); err != nil {
		return fmt.Errorf("reverse proxy: %w", err)
	}
	u, err := url.Parse(upstream)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return fmt.Errorf("--upstream %q: want an http:// URL", upstream)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.Transport = &http.Transport{MaxIdleConnsPerHost: 2 * maxClients, DisableCompression: true}
	srv := &http.Server{Handler: rp, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// startReverseProxy runs ServeReverseProxy as a process of cfg.Binary.
func startReverseProxy(ctx context.Context, cfg OverheadConfig, dir, engineURL string) (*target, *proc, error) {
	port, err := freePort("tcp")
	if err != nil {
		return nil, nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	p, err := startProc(ctx, "go-reverse-proxy", dir, nil, cfg.Binary, "bench", "--overhead",
		"--serve-reverse-proxy", addr, "--upstream", engineURL)
	if err != nil {
		return nil, nil, err
	}
	// Streams are left out: httputil.ReverseProxy over http.Transport cut
	// 1-2% of the stub's event streams here ("use of closed network
	// connection" on its upstream read), which would time the failures.
	t := &target{name: "go-reverse-proxy", url: "http://" + addr, procs: []*proc{p}, noStream: true}
	if err := waitReady(ctx, t.url+"/v1/models", `"m1"`, t.procs); err != nil {
		return nil, p, err
	}
	return t, p, nil
}

// startComputeflux starts a relay and one agent in front of the engine, as
// processes of cfg.Binary, and waits until the relay routes to the agent.
func startComputeflux(ctx context.Context, cfg OverheadConfig, dir, engineURL, prefix string) (*target, []*proc, map[string]string, error) {
	if cfg.Binary == "" {
		return nil, nil, nil, errors.New("no computeflux binary")
	}
	httpPort, err := freePort("tcp")
	if err != nil {
		return nil, nil, nil, err
	}
	const token = "computeflux-bench-token"
	addrFile := filepath.Join(dir, prefix+"relay.addrs")
	pprofAddrs := map[string]string{}
	env := func(name string) []string {
		if cfg.ProfileDir == "" {
			return nil
		}
		port, err := freePort("tcp")
		if err != nil {
			return nil
		}
		a := fmt.Sprintf("127.0.0.1:%d", port)
		pprofAddrs[name] = a
		return []string{EnvPprof + "=" + a}
	}
	r, err := startProc(ctx, prefix+"relay", dir, env("relay"), cfg.Binary, append([]string{"relay",
		"--listen", fmt.Sprintf("127.0.0.1:%d", httpPort),
		"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1",
		"--token", token, "--no-auth", "--addr-file", addrFile,
		// The default ledger file is per identity, and these relays have
		// none: each gets its own, as two relays of one host would.
		"--ledger-file", filepath.Join(dir, prefix+"relay-usage.db"),
		"--log-level", cfg.LogLevel}, cfg.RelayArgs...)...)
	if err != nil {
		return nil, nil, nil, err
	}
	procs := []*proc{r}
	relayAddr, err := waitAddrFile(ctx, addrFile, r)
	if err != nil {
		return nil, procs, nil, err
	}
	a, err := startProc(ctx, prefix+"agent", dir, env("agent"), cfg.Binary, "agent",
		"--relay", relayAddr, "--token", token, "--upstream", engineURL,
		"--name", "bench", "--ephemeral-identity",
		"--p2p-listen", "/ip4/127.0.0.1/udp/0/quic-v1",
		"--log-level", cfg.LogLevel)
	if err != nil {
		return nil, procs, nil, err
	}
	procs = append(procs, a)
	t := &target{name: "computeflux", url: fmt.Sprintf("http://127.0.0.1:%d", httpPort), procs: procs}
	if err := waitReady(ctx, t.url+"/v1/models", `"m1"`, procs); err != nil {
		return nil, procs, nil, err
	}
	return t, procs, pprofAddrs, nil
}

// waitTCP waits until addr accepts TCP connections.
func waitTCP(ctx context.Context, addr string, p *proc) error {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited: %s", p.name, p.tail())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s: nothing listening on %s: %s", p.name, addr, p.tail())
}

// waitAddrFile waits for the relay's address file and returns its first
// loopback multiaddr.
func waitAddrFile(ctx context.Context, path string, p *proc) (string, error) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if b, err := os.ReadFile(path); err == nil {
			sc := bufio.NewScanner(bytes.NewReader(b))
			for sc.Scan() {
				if l := strings.TrimSpace(sc.Text()); strings.HasPrefix(l, "/ip4/127.0.0.1/") {
					return l, nil
				}
			}
		}
		select {
		case <-p.done:
			return "", fmt.Errorf("relay exited: %s", p.tail())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return "", fmt.Errorf("relay wrote no address to %s: %s", path, p.tail())
}

// profile takes CPU profiles of the relay and the agent while t is under
// load, then their allocation profiles, and writes them to cfg.ProfileDir.
func profile(ctx context.Context, cfg OverheadConfig, t *target, addrs map[string]string) ([]string, error) {
	if err := os.MkdirAll(cfg.ProfileDir, 0o755); err != nil {
		return nil, err
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		files []string
		errs  []error
	)
	get := func(name, url, file string) {
		defer wg.Done()
		c := &http.Client{Timeout: time.Duration(cfg.ProfileSeconds+30) * time.Second}
		resp, err := c.Get(url)
		if err == nil {
			defer resp.Body.Close()
			var b []byte
			b, err = io.ReadAll(resp.Body)
			if err == nil && resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("%s: status %d: %s", url, resp.StatusCode, b)
			}
			if err == nil {
				path := filepath.Join(cfg.ProfileDir, file)
				err = os.WriteFile(path, b, 0o644)
				mu.Lock()
				files = append(files, path)
				mu.Unlock()
			}
		}
		if err != nil {
			mu.Lock()
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			mu.Unlock()
		}
	}
	for name, a := range addrs {
		wg.Add(1)
		go get(name, fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", a, cfg.ProfileSeconds), name+".cpu.pprof")
	}
	t.load(ctx, cfg.Clients, 0, time.Duration(cfg.ProfileSeconds)*time.Second+time.Second)
	wg.Wait()
	for name, a := range addrs {
		wg.Add(1)
		get(name, fmt.Sprintf("http://%s/debug/pprof/allocs", a), name+".allocs.pprof")
	}
	slices.Sort(files)
	return files, errors.Join(errs...)
}
