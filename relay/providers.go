package relay

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/libp2p/go-libp2p/core/peer"
)

// Provider endpoints: OpenAI-compatible APIs (a hosted vLLM, OpenAI,
// OpenRouter, ...) that the relay calls itself, with API keys, beside the
// agents in one routing table. They come from Config.EndpointsFile and are
// replaced as a whole by ReloadEndpoints (SIGHUP in the binary): endpoints
// that stay keep their statistics, breakers, keys' states and sessions, and
// requests in flight finish with the endpoint and key they started with.
//
// A key is known to the scheduler by a label, an HMAC of the key under a
// secret drawn at start, so that a key keeps its state across reloads
// wherever it moves in the file; the label reveals nothing of the key, and
// the admin API shows keys only by their position.

// DefaultDiscoveryTimeout bounds GET /models on a provider whose models the
// file does not list.
const DefaultDiscoveryTimeout = 10 * time.Second

// rediscoverEvery is how often discovery is retried for providers whose
// models could not be discovered.
const rediscoverEvery = 30 * time.Second

// provider is one loaded provider endpoint. Immutable once in a table.
type provider struct {
	spec   ProviderSpec
	keyIDs []string // scheduler labels, parallel to spec.Keys
	models []string // spec.Models, or discovered
	err    error    // why discovery failed (models then empty)
}

// providerTable is the loaded set of providers; replaced, never edited.
type providerTable struct {
	list   []*provider
	byName map[string]*provider
}

// providerSet is the relay's provider endpoints.
type providerSet struct {
	r    *Relay
	rt   http.RoundTripper
	salt [32]byte

	table atomic.Pointer[providerTable]
	// reload serializes ReloadEndpoints and rediscovery, and guards looping.
	reload  sync.Mutex
	looping bool // the rediscovery loop runs

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func newProviderSet(r *Relay) *providerSet {
	ps := &providerSet{r: r, rt: r.cfg.ProviderTransport}
	if ps.rt == nil {
		ps.rt = newProviderTransport()
	}
	_, _ = rand.Read(ps.salt[:])
	ps.table.Store(&providerTable{byName: map[string]*provider{}})
	ps.ctx, ps.cancel = context.WithCancel(context.Background())
	return ps
}

// newProviderTransport is the HTTP client side for provider APIs.
func newProviderTransport() *http.Transport {
	return &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		TLSClientConfig:       &tls.Config{MinVersion: tls.VersionTLS12},
	}
}

func (ps *providerSet) keyID(key string) string {
	m := hmac.New(sha256.New, ps.salt[:])
	m.Write([]byte(key))
	return hex.EncodeToString(m.Sum(nil)[:8])
}

func (ps *providerSet) get(name string) *provider { return ps.table.Load().byName[name] }

// close stops rediscovery and waits for it.
func (ps *providerSet) close() {
	ps.cancel()
	ps.wg.Wait()
	if c, ok := ps.rt.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// ReloadEndpoints reads Config.EndpointsFile again and puts its providers
// and agent settings in force. On any error the table in force stays as it
// was, and the error (naming the line and field) is logged and returned.
// Admin overrides (disable, drain, weight) are kept. It does nothing
// without an endpoints file.
func (r *Relay) ReloadEndpoints(ctx context.Context) error {
	if r.cfg.EndpointsFile == "" {
		return nil
	}
	ef, err := LoadEndpointsFile(r.cfg.EndpointsFile)
	if err == nil {
		err = r.providers.apply(ctx, ef)
	}
	if err != nil {
		r.log.Error().Err(err).Msg("endpoints file not applied; the routing table in force stays")
		return err
	}
	r.auditRefs.set(ef.References())
	return nil
}

// apply puts ef in force: discovery first (without locks), then the swap.
func (ps *providerSet) apply(ctx context.Context, ef *EndpointsFile) error {
	ps.reload.Lock()
	defer ps.reload.Unlock()
	r := ps.r
	names := make([]string, 0, len(ef.Endpoints))
	for _, sp := range ef.Endpoints {
		if r.reg.has(sp.Name) {
			return fmt.Errorf("endpoint %q: an agent is joined under that name", sp.Name)
		}
		names = append(names, sp.Name)
	}
	old := ps.table.Load()
	next := &providerTable{byName: make(map[string]*provider, len(ef.Endpoints))}
	var wg sync.WaitGroup
	for _, sp := range ef.Endpoints {
		p := &provider{spec: sp, models: slices.Clone(sp.Models)}
		for _, k := range sp.Keys {
			p.keyIDs = append(p.keyIDs, ps.keyID(k))
		}
		next.list = append(next.list, p)
		next.byName[sp.Name] = p
		if len(p.models) > 0 {
			continue
		}
		if o := old.byName[sp.Name]; o != nil && o.err == nil && o.spec.URL.String() == sp.URL.String() {
			p.models = o.models // discovered before: keep, refresh quietly
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			models, err := ps.discover(ctx, p.spec)
			switch {
			case err == nil:
				p.models, p.err = models, nil
			case len(p.models) == 0:
				p.err = err
			}
			if err != nil {
				r.log.Warn().Str("endpoint", p.spec.Name).Err(err).Msg("provider model discovery failed")
			}
		}()
	}
	wg.Wait()

	r.ops.setFile(ef.Agents, names)
	ps.table.Store(next)
	if r.cfg.Ledger != nil {
		r.cfg.Ledger.SetPrices(ef.Prices())
	}
	for _, p := range next.list {
		ps.upsert(p)
	}
	for _, p := range old.list {
		if next.byName[p.spec.Name] == nil {
			r.sched.Remove(p.spec.Name)
			r.log.Info().Str("endpoint", p.spec.Name).Msg("provider endpoint removed")
		}
	}
	r.reg.reapply()
	for _, p := range next.list {
		r.log.Info().Str("endpoint", p.spec.Name).Str("url", p.spec.URL.String()).Int("keys", len(p.spec.Keys)).
			Strs("models", p.models).Int("priority", p.spec.Priority).Msg("provider endpoint loaded")
	}
	if ps.needsDiscovery() && !ps.looping && ps.ctx.Err() == nil {
		ps.looping = true
		ps.startRediscovery()
	}
	return nil
}

// upsert hands provider p to the scheduler with the operator's settings.
func (ps *providerSet) upsert(p *provider) {
	st := ps.r.ops.provider(p.spec)
	ps.r.sched.Upsert(scheduler.Endpoint{
		ID: p.spec.Name, Models: p.models, Weight: st.weight, Capacity: p.spec.MaxConcurrency,
		Priority: st.priority, Keys: p.keyIDs, Disabled: st.disabled,
	})
	ps.r.sched.SetHealth(p.spec.Name, scheduler.Health{Draining: st.draining})
}

// reapply hands every provider to the scheduler again.
func (ps *providerSet) reapply() {
	for _, p := range ps.table.Load().list {
		ps.upsert(p)
	}
}

func (ps *providerSet) needsDiscovery() bool {
	for _, p := range ps.table.Load().list {
		if p.err != nil {
			return true
		}
	}
	return false
}

// startRediscovery retries discovery every rediscoverEvery for providers
// without models, until none is left or the relay closes.
func (ps *providerSet) startRediscovery() {
	ps.wg.Add(1)
	go func() {
		defer ps.wg.Done()
		t := time.NewTicker(rediscoverEvery)
		defer t.Stop()
		for {
			select {
			case <-ps.ctx.Done():
				return
			case <-t.C:
			}
			if !ps.rediscover() {
				return
			}
		}
	}()
}

// rediscover retries failed discoveries once; it reports whether some are
// still missing.
func (ps *providerSet) rediscover() bool {
	ps.reload.Lock()
	defer ps.reload.Unlock()
	cur := ps.table.Load()
	next := &providerTable{list: slices.Clone(cur.list), byName: make(map[string]*provider, len(cur.list))}
	missing := false
	for i, p := range next.list {
		if p.err != nil {
			models, err := ps.discover(ps.ctx, p.spec)
			if err == nil {
				cp := *p
				cp.models, cp.err = models, nil
				next.list[i] = &cp
				ps.r.log.Info().Str("endpoint", p.spec.Name).Strs("models", models).Msg("provider models discovered")
			} else {
				missing = true
			}
		}
		next.byName[next.list[i].spec.Name] = next.list[i]
	}
	ps.table.Store(next)
	for _, p := range next.list {
		ps.upsert(p)
	}
	ps.looping = missing
	return missing
}

// maxModelsBody bounds a provider's GET /models answer.
const maxModelsBody = 4 << 20

// discover asks the provider for its models, with each key in turn until
// one is accepted.
func (ps *providerSet) discover(ctx context.Context, sp ProviderSpec) ([]string, error) {
	keys := sp.Keys
	if len(keys) == 0 {
		keys = []string{""}
	}
	var errs []error
	for i, key := range keys {
		models, err := ps.discoverWith(ctx, sp, key)
		if err == nil {
			return models, nil
		}
		errs = append(errs, fmt.Errorf("key %d: %w", i+1, err))
		if ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("GET %s/models: %w", sp.URL, errors.Join(errs...))
}

func (ps *providerSet) discoverWith(ctx context.Context, sp ProviderSpec, key string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, DefaultDiscoveryTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, sp.URL.String()+"/models", nil)
	if err != nil {
		return nil, err
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := ps.rt.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
		return nil, fmt.Errorf("status %d", resp.StatusCode)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxModelsBody {
		return nil, errors.New("model list too large")
	}
	return parseModelList(b)
}

// parseModelList reads OpenAI's model list ({"data":[{"id":...}]}),
// sorted and without duplicates; an empty list is an error.
func parseModelList(b []byte) ([]string, error) {
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return nil, fmt.Errorf("not a model list: %w", err)
	}
	var out []string
	for _, m := range list.Data {
		if id := strings.TrimSpace(m.ID); id != "" && len(id) <= 256 {
			out = append(out, id)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("the model list is empty")
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// target is where one attempt goes: the URL, the round tripper, and the
// provider key to present ("" for agents), or the agent's peer ("" for
// providers).
type target struct {
	u      url.URL // the upstream URL, built without parsing a string
	rt     http.RoundTripper
	key    string
	keyNum int // the key's position in the provider's list, from 1; 0 for agents
	peer   peer.ID
}

// authorize sets the provider key on an upstream request.
func (t target) authorize(h http.Header) {
	if t.key != "" {
		h.Set("Authorization", "Bearer "+t.key)
	}
}

// target resolves choice c for a request on path (/v1/...).
func (r *Relay) target(c scheduler.Choice, path string) (target, bool) {
	if p := r.providers.get(c.EndpointID); p != nil {
		// The base URL was parsed and checked once (no query, fragment or
		// raw path; see parseProviderURL): the request's URL is a copy
		// with the path appended, which is what parsing
		// base+path would give for our own clean API paths.
		t := target{u: *p.spec.URL, rt: r.providers.rt}
		t.u.Path += strings.TrimPrefix(path, "/v1")
		t.u.ForceQuery = false
		if i := slices.Index(p.keyIDs, c.Key); i >= 0 {
			t.key, t.keyNum = p.spec.Keys[i], i+1
		}
		return t, true
	}
	host, p, ok := r.reg.upstream(c.EndpointID)
	// host is a peer ID (base58), path one of our API paths: nothing to
	// parse or escape.
	return target{u: url.URL{Scheme: "http", Host: host, Path: path}, rt: r.rt, peer: p}, ok
}

// logAttempt writes the one line for a failed attempt: the endpoint, the
// attempt's number and, for a provider, the key's position (never the key).
func (r *Relay) logAttempt(c scheduler.Choice, n int, err error) {
	ev := r.log.Info().Str("agent", c.EndpointID).Int("attempt", n)
	if p := r.providers.get(c.EndpointID); p != nil {
		if i := slices.Index(p.keyIDs, c.Key); i >= 0 {
			ev = ev.Int("key", i+1)
		}
	}
	ev.AnErr("error", err).Msg("attempt failed")
}
