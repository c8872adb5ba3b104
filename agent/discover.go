package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// DefaultEnginePorts are the ports FindEngine tries on 127.0.0.1, each
// with the engine whose default it is.
var DefaultEnginePorts = []EnginePort{
	{8000, "vLLM"}, {30000, "SGLang"}, {8080, "llama.cpp"}, {3000, "TGI"}, {11434, "Ollama"},
}

// EnginePort is a port an engine listens on by default.
type EnginePort struct {
	Port   int
	Engine string // the engine that listens there by default
}

// FoundEngine is an engine FindEngine found.
type FoundEngine struct {
	URL    string // base URL, e.g. http://127.0.0.1:8000
	Engine EngineInfo
	Models []string
}

// ErrNoEngine is returned by FindEngine when no port answered as an engine.
var ErrNoEngine = errors.New("no inference engine found")

// FindEngine looks for engines on 127.0.0.1 at ports (DefaultEnginePorts
// when empty): one that answers GET /v1/models with a model list is
// identified like the agent identifies its upstream. Ports are tried
// concurrently, each within timeout (0 means 2 s); the result keeps the
// order of ports. It returns ErrNoEngine, wrapped with what to pass, when
// none answered.
func FindEngine(ctx context.Context, ports []EnginePort, timeout time.Duration) ([]FoundEngine, error) {
	if len(ports) == 0 {
		ports = DefaultEnginePorts
	}
	if timeout == 0 {
		timeout = 2 * time.Second
	}
	client := &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
	found := make([]*FoundEngine, len(ports))
	var wg sync.WaitGroup
	for i, p := range ports {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			found[i] = probePort(ctx, client, p.Port)
		}()
	}
	wg.Wait()
	var out []FoundEngine
	for _, f := range found {
		if f != nil {
			out = append(out, *f)
		}
	}
	if len(out) == 0 {
		var tried []string
		for _, p := range ports {
			tried = append(tried, fmt.Sprintf("%d (%s)", p.Port, p.Engine))
		}
		return nil, fmt.Errorf("%w on 127.0.0.1 ports %s: start your engine, or pass --upstream http://HOST:PORT (its OpenAI base URL, without /v1)",
			ErrNoEngine, strings.Join(tried, ", "))
	}
	return out, nil
}

// probePort returns the engine on 127.0.0.1:port, or nil.
func probePort(ctx context.Context, client *http.Client, port int) *FoundEngine {
	base := &url.URL{Scheme: "http", Host: "127.0.0.1:" + strconv.Itoa(port)}
	p := &engineProber{client: client, base: base}
	list, err := p.models(ctx)
	if err != nil || list.Data == nil {
		return nil
	}
	f := &FoundEngine{URL: base.String()}
	var ownedBy string
	for i, d := range list.Data {
		if i == 0 {
			ownedBy = d.OwnedBy
		}
		f.Models = append(f.Models, d.ID)
	}
	f.Engine, _, _ = p.identify(ctx, ownedBy)
	return f
}

// Describe is a one-line account of a found engine.
func (f FoundEngine) Describe() string {
	name := string(f.Engine.Kind)
	if f.Engine.Kind == EngineUnknown {
		name = "an OpenAI-compatible engine (kind not recognised)"
	}
	if f.Engine.Version != "" {
		name += " " + f.Engine.Version
	}
	return fmt.Sprintf("%s at %s serving %s", name, f.URL, strings.Join(f.Models, ", "))
}
