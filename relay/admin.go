package relay

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler"
)

// The admin API and the status page.
//
// They are served on a listener of their own (Config.AdminListen, loopback
// by default), never on the client API's, and need the admin key
// (Config.AdminKey) as "Authorization: Bearer KEY"; with no key set there is
// no admin API. Routes:
//
//	GET  /admin/v1/endpoints                  the routing table (TableRow list)
//	POST /admin/v1/endpoints/{name}/disable   the seed's Disabled: never picked; its sessions move
//	POST /admin/v1/endpoints/{name}/enable    undo disable and drain (wins over the file's disabled)
//	POST /admin/v1/endpoints/{name}/drain     no new requests, in-flight ones finish
//	POST /admin/v1/endpoints/{name}/undrain   undo drain
//	POST /admin/v1/endpoints/{name}/weight    {"weight": W}; 0 returns to the declared or file weight
//	GET  /admin/v1/queue                      the requests waiting for room (QueueStatus)
//	GET  /admin/v1/audits                     audit budget, every agent and model's standing, recent audits
//	POST /admin/v1/audits/quarantine          {"agent", "model", "reason"}: no traffic for the model until released
//	POST /admin/v1/audits/release             {"agent", "model"}: end a quarantine (by audits or by hand)
//	GET  /status                              the status page (HTML; its data needs the key)
//	GET  /status.json                         the table plus recent request rate, hit ratio, TTFT, the queue, the last day's usage
//
// Admin settings are kept across reloads of the endpoints file (not across
// restarts: put lasting ones in the file). No response or log line shows a
// key: provider keys appear by position and state only.

// DefaultAdminListen is the admin API's listen address when
// Config.AdminListen is empty: loopback only.
const DefaultAdminListen = "127.0.0.1:8081"

// TableRow is one endpoint of the routing table as the admin API shows it:
// an agent or a provider, with no secret.
type TableRow struct {
	Name string `json:"name"`
	// Kind is "agent" or "provider".
	Kind string `json:"kind"`
	// URL is a provider's base URL; empty for agents.
	URL string `json:"url,omitempty"`
	// Peer is an agent's libp2p peer ID.
	Peer string `json:"peer,omitempty"`
	// State sums up: ok, disabled, draining, dead, suspect, breaker-open,
	// half-open, no-models.
	State string `json:"state"`
	Tier  int    `json:"tier"`
	// Weight is the effective weight; WeightSource says whose it is
	// (declared, capped, file, admin) and DeclaredWeight what the agent or
	// file asked for.
	Weight         float64 `json:"weight"`
	WeightSource   string  `json:"weight_source"`
	DeclaredWeight float64 `json:"declared_weight"`
	Disabled       bool    `json:"disabled"`
	Draining       bool    `json:"draining"`
	Breaker        string  `json:"breaker"`
	// BreakerUntil is when an open breaker admits probes again.
	BreakerUntil   *time.Time `json:"breaker_until,omitempty"`
	EWMATTFTMillis float64    `json:"ewma_ttft_ms"`
	SuccessRate    float64    `json:"success_rate"`
	InFlight       int        `json:"in_flight"`
	Capacity       int        `json:"capacity"`
	Sessions       int        `json:"sessions"`
	Requests       uint64     `json:"requests"`
	// ColdStartLeft is how many more requests score on weight alone.
	ColdStartLeft int      `json:"cold_start_left"`
	Keys          []KeyRow `json:"keys,omitempty"`
	Models        []string `json:"models"`
	// Path is how the relay reaches an agent: direct or relayed; empty
	// for providers and without a connection.
	Path string `json:"path,omitempty"`
	// RTTMillis is the relay's round-trip time to an agent (libp2p's
	// moving average, fed by the liveness probe); 0 when unknown.
	RTTMillis float64 `json:"rtt_ms,omitempty"`
	// Error is why a provider has no models (discovery failed).
	Error string `json:"error,omitempty"`
}

// KeyRow is one provider key's state, by position in the file.
type KeyRow struct {
	N            int        `json:"n"`
	State        string     `json:"state"`
	BreakerUntil *time.Time `json:"breaker_until,omitempty"`
	Successes    uint64     `json:"successes"`
	DeadKeys     uint64     `json:"dead_keys"`
	RateLimited  uint64     `json:"rate_limited"`
}

// Table returns the routing table: every joined agent and every provider
// endpoint, sorted by tier, then name.
func (r *Relay) Table() []TableRow {
	snaps := map[string]scheduler.EndpointStatus{}
	for _, s := range r.sched.Snapshot() {
		snaps[s.ID] = s
	}
	cold := r.sched.Config().ColdStartSamples
	var rows []TableRow
	for _, a := range r.reg.Agents() {
		st := r.ops.agent(a.Name, a.Weight)
		row := TableRow{
			Name: a.Name, Kind: "agent", Peer: a.Peer.String(), Models: a.Models,
			Weight: st.weight, WeightSource: st.weightSource, DeclaredWeight: a.Weight, Tier: st.priority,
			Disabled: st.disabled, Draining: a.Health.Draining, Capacity: a.Capacity,
		}
		suspect := a.Health.Suspect
		if s, ok := snaps[a.Name]; ok && !a.Dead {
			// What the scheduler routes on, as the gauge counts it.
			fillFromSnapshot(&row, s, cold)
			row.Draining, suspect = s.Health.Draining, s.Health.Suspect
		}
		row.Path, row.RTTMillis = r.agentPath(a.Peer)
		row.State = rowState(row, a.Dead, suspect)
		rows = append(rows, row)
	}
	for _, p := range r.providers.table.Load().list {
		st := r.ops.provider(p.spec)
		row := TableRow{
			Name: p.spec.Name, Kind: "provider", URL: p.spec.URL.String(), Models: slices.Clone(p.models),
			Weight: st.weight, WeightSource: st.weightSource, DeclaredWeight: p.spec.Weight, Tier: st.priority,
			Disabled: st.disabled, Draining: st.draining, Capacity: p.spec.MaxConcurrency,
		}
		if p.err != nil {
			row.Error = p.err.Error()
		}
		s, ok := snaps[p.spec.Name]
		if ok {
			fillFromSnapshot(&row, s, cold)
		}
		for i := range p.spec.Keys {
			kr := KeyRow{N: i + 1, State: scheduler.BreakerClosed.String()}
			if ok {
				if j := slices.IndexFunc(s.Keys, func(k scheduler.KeyStatus) bool { return k.ID == p.keyIDs[i] }); j >= 0 {
					ks := s.Keys[j]
					kr.State, kr.Successes, kr.DeadKeys, kr.RateLimited = ks.Breaker.String(), ks.Successes, ks.DeadKeys, ks.RateLimited
					if !ks.BreakerUntil.IsZero() {
						t := ks.BreakerUntil
						kr.BreakerUntil = &t
					}
				}
			}
			row.Keys = append(row.Keys, kr)
		}
		row.State = rowState(row, false, false)
		rows = append(rows, row)
	}
	for i := range rows {
		if rows[i].Weight == 0 {
			rows[i].Weight = 1
		}
		if rows[i].Models == nil {
			rows[i].Models = []string{}
		}
	}
	slices.SortFunc(rows, func(a, b TableRow) int {
		if a.Tier != b.Tier {
			return a.Tier - b.Tier
		}
		return strings.Compare(a.Name, b.Name)
	})
	return rows
}

func fillFromSnapshot(row *TableRow, s scheduler.EndpointStatus, cold int) {
	row.Breaker = s.Breaker.String()
	if !s.BreakerUntil.IsZero() {
		t := s.BreakerUntil
		row.BreakerUntil = &t
	}
	row.EWMATTFTMillis = float64(s.EWMALatency) / 1e6
	row.SuccessRate = s.SuccessRate
	row.InFlight, row.Sessions, row.Requests = s.InFlight, s.Sessions, s.Requests
	row.ColdStartLeft = max(cold-int(min(s.Requests, uint64(math.MaxInt32))), 0)
	row.Disabled = s.Disabled
}

func rowState(row TableRow, dead, suspect bool) string {
	switch {
	case row.Disabled:
		return "disabled"
	case dead:
		return "dead"
	case row.Draining:
		return "draining"
	case len(row.Models) == 0:
		return "no-models"
	case row.Breaker == scheduler.BreakerOpen.String():
		return "breaker-open"
	case row.Breaker == scheduler.BreakerHalfOpen.String():
		return "half-open"
	case suspect:
		return "suspect"
	}
	return "ok"
}

// agentPath tells whether the relay's connection to p is direct or relayed,
// and libp2p's RTT estimate.
func (r *Relay) agentPath(p peer.ID) (string, float64) {
	if r.host == nil || p == "" {
		return "", 0
	}
	path := ""
	for _, c := range r.host.Network().ConnsToPeer(p) {
		if c.Stat().Limited {
			if path == "" {
				path = "relayed"
			}
		} else {
			path = "direct"
		}
	}
	return path, float64(r.host.Peerstore().LatencyEWMA(p)) / 1e6
}

// Admin actions on one endpoint.
var errNoEndpoint = errors.New("no endpoint of that name")

// SetAdmin applies an admin action (disable, enable, drain, undrain, or
// weight with w) to the endpoint name, agent or provider. It takes effect
// before it returns: the next pick sees it.
func (r *Relay) SetAdmin(name, action string, w float64) error {
	isProvider := r.providers.get(name) != nil
	if !isProvider && !r.reg.has(name) {
		return errNoEndpoint
	}
	var fn func(*override)
	switch action {
	case "disable":
		fn = func(o *override) { t := true; o.disabled = &t }
	case "enable":
		fn = func(o *override) { f := false; o.disabled = &f; o.draining = false }
	case "drain":
		fn = func(o *override) { o.draining = true }
	case "undrain":
		fn = func(o *override) { o.draining = false }
	case "weight":
		if !(w >= 0) || math.IsInf(w, 0) || w > 1e6 {
			return fmt.Errorf("weight must be 0..1e6, got %v", w)
		}
		fn = func(o *override) { o.weight = w }
	default:
		return fmt.Errorf("unknown action %q", action)
	}
	r.ops.edit(name, fn)
	if isProvider {
		r.providers.reapply()
	} else {
		r.reg.reapply()
	}
	ev := r.log.Info().Str("endpoint", name).Str("action", action)
	if action == "weight" {
		ev = ev.Float64("weight", w)
	}
	ev.Msg("admin action")
	return nil
}

// AdminHandler returns the admin API and status page handler (see the
// routes above). Without Config.AdminKey only the status page is served,
// and only with Config.StatusPublic.
func (r *Relay) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /admin/v1/endpoints", r.admin(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"endpoints": r.Table()})
	}))
	mux.HandleFunc("POST /admin/v1/endpoints/{name}/{action}", r.admin(r.serveAdminAction))
	mux.HandleFunc("GET /admin/v1/usage", r.admin(r.serveUsage))
	mux.HandleFunc("GET /admin/v1/queue", r.admin(r.serveQueueStatus)) // queue_admin.go
	mux.HandleFunc("GET /admin/v1/audits", r.admin(func(w http.ResponseWriter, _ *http.Request) {
		if r.audits == nil {
			writeJSON(w, http.StatusOK, map[string]any{"disabled": true})
			return
		}
		writeJSON(w, http.StatusOK, r.audits.Status())
	}))
	mux.HandleFunc("POST /admin/v1/audits/{action}", r.admin(r.serveAuditAction))
	mux.HandleFunc("GET /status", r.status(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'")
		_, _ = io.WriteString(w, statusPage)
	}, false))
	mux.HandleFunc("GET /status.json", r.status(func(w http.ResponseWriter, req *http.Request) {
		writeJSON(w, http.StatusOK, r.statusData(r.adminAuthorized(req)))
	}, true))
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		h, pattern := mux.Handler(req)
		if pattern == "" {
			if strings.HasPrefix(req.URL.Path, "/admin/") || strings.HasPrefix(req.URL.Path, "/status") {
				// A known path with the wrong method is a 405 from the mux.
				h.ServeHTTP(w, req)
				return
			}
			writeError(w, errNotFound(req.URL.Path))
			return
		}
		mux.ServeHTTP(w, req)
	})
}

// admin wraps an admin route: the admin key is required.
func (r *Relay) admin(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		if !r.adminAuthorized(req) {
			r.refuseAdmin(w, req)
			return
		}
		h(w, req)
	}
}

// status wraps a status route: the admin key, unless StatusPublic. The
// page itself carries no data, so it is served to anyone who may see the
// data or be asked for the key.
func (r *Relay) status(h http.HandlerFunc, data bool) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		switch {
		case r.cfg.StatusPublic:
		case r.cfg.AdminKey == "":
			writeError(w, errNotFound(req.URL.Path))
			return
		case data && !r.adminAuthorized(req):
			r.refuseAdmin(w, req)
			return
		}
		h(w, req)
	}
}

func (r *Relay) adminAuthorized(req *http.Request) bool {
	if r.cfg.AdminKey == "" {
		return false
	}
	want := sha256.Sum256([]byte(r.cfg.AdminKey))
	got := keyID(req, false)
	return subtle.ConstantTimeCompare(want[:], got[:]) == 1
}

// refuseAdmin answers 401; the log line names the path and the client's
// address, never what it sent as a key.
func (r *Relay) refuseAdmin(w http.ResponseWriter, req *http.Request) {
	r.log.Warn().Str("path", req.URL.Path).Str("remote", req.RemoteAddr).Msg("admin request refused: missing or wrong admin key")
	writeError(w, errUnauthorized())
}

func (r *Relay) serveAdminAction(w http.ResponseWriter, req *http.Request) {
	name, action := req.PathValue("name"), req.PathValue("action")
	var w8 float64
	if action == "weight" {
		var body struct {
			Weight *float64 `json:"weight"`
		}
		dec := json.NewDecoder(io.LimitReader(req.Body, 4<<10))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&body); err != nil || body.Weight == nil {
			writeError(w, errBadRequest("invalid_weight", `Send {"weight": W} with W >= 0 (0 returns to the declared weight)`, err))
			return
		}
		w8 = *body.Weight
	}
	switch err := r.SetAdmin(name, action, w8); {
	case errors.Is(err, errNoEndpoint):
		writeError(w, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "endpoint_not_found",
			Message: "No agent or provider endpoint is named '" + name + "'"})
		return
	case err != nil:
		writeError(w, errBadRequest("invalid_action", err.Error(), err))
		return
	}
	for _, row := range r.Table() {
		if row.Name == name {
			writeJSON(w, http.StatusOK, row)
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"name": name})
}

// serveAdmin serves the admin API on Config.AdminListen until ctx ends, when
// AdminKey or StatusPublic is set; the returned function stops it.
func (r *Relay) serveAdmin() (stop func(), err error) {
	if r.cfg.AdminKey == "" && !r.cfg.StatusPublic {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", r.cfg.AdminListen)
	if err != nil {
		return nil, fmt.Errorf("relay: admin listen: %w", err)
	}
	return r.serveAdminOn(ln), nil
}

// serveAdminOn serves the admin API on ln until the returned function
// stops it. Serving that stops on its own (the listener failed) is logged:
// the admin API and status page are gone while the relay serves on.
func (r *Relay) serveAdminOn(ln net.Listener) (stop func()) {
	r.adminAddr.Store(ln.Addr().String())
	srv := &http.Server{
		Handler:           r.AdminHandler(),
		ReadHeaderTimeout: r.cfg.ReadHeaderTimeout,
		MaxHeaderBytes:    r.cfg.MaxHeaderBytes,
		ErrorLog:          r.serverLog("admin-http"),
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			r.log.Error().Err(err).Str("addr", ln.Addr().String()).Msg("relay admin stopped serving: no admin API or status page until the relay restarts")
		}
	}()
	r.log.Info().Str("addr", ln.Addr().String()).Bool("status_public", r.cfg.StatusPublic).Bool("admin_api", r.cfg.AdminKey != "").Msg("relay admin listening")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if srv.Shutdown(ctx) != nil {
			_ = srv.Close()
		}
		<-done
	}
}

// AdminAddr returns the admin listener's address once Serve runs it; empty
// otherwise.
func (r *Relay) AdminAddr() string {
	s, _ := r.adminAddr.Load().(string)
	return s
}

// Recent traffic, for the status page.

// statsBucket is one statsStep of finished inference requests.
type statsBucket struct {
	start            int64 // unix seconds, a multiple of statsStep
	requests, errors int
	hits, misses     int
	ttftSum          time.Duration
	ttftCount        int
}

const (
	statsStep    = 10 // seconds per bucket
	statsBuckets = 30 // five minutes
)

// statsWindow keeps the last statsBuckets buckets of requests.
type statsWindow struct {
	mu      sync.Mutex // guards buckets
	buckets [statsBuckets]statsBucket
}

func newStatsWindow() *statsWindow { return &statsWindow{} }

func (s *statsWindow) observe(rl *reqLog, now time.Time) {
	if rl.status == 0 {
		return
	}
	t := now.Unix() / statsStep * statsStep
	s.mu.Lock()
	defer s.mu.Unlock()
	b := &s.buckets[(t/statsStep)%statsBuckets]
	if b.start != t {
		*b = statsBucket{start: t}
	}
	b.requests++
	if rl.status >= 500 {
		b.errors++
	}
	switch rl.affinity {
	case "hit":
		b.hits++
	case "miss":
		b.misses++
	}
	if rl.ttfb > 0 {
		b.ttftSum += rl.ttfb
		b.ttftCount++
	}
}

// StatusPoint is one step of the status page's series.
type StatusPoint struct {
	Time     int64   `json:"t"` // unix seconds at the step's start
	Requests int     `json:"requests"`
	Errors   int     `json:"errors"`
	Hits     int     `json:"hits"`
	Misses   int     `json:"misses"`
	TTFTMean float64 `json:"ttft_ms"` // mean time to first byte, ms; 0 without samples
}

// series returns the last statsBuckets steps, oldest first, zeros where
// nothing happened.
func (s *statsWindow) series(now time.Time) []StatusPoint {
	end := now.Unix() / statsStep * statsStep
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]StatusPoint, 0, statsBuckets)
	for i := statsBuckets - 1; i >= 0; i-- {
		t := end - int64(i)*statsStep
		p := StatusPoint{Time: t}
		if b := s.buckets[(t/statsStep)%statsBuckets]; b.start == t {
			p.Requests, p.Errors, p.Hits, p.Misses = b.requests, b.errors, b.hits, b.misses
			if b.ttftCount > 0 {
				p.TTFTMean = float64(b.ttftSum) / float64(b.ttftCount) / 1e6
			}
		}
		out = append(out, p)
	}
	return out
}

// statusData is what /status.json serves. Who uses the fleet (the
// clients waiting, the last day's usage by client) is the operator's:
// without the admin key (a public status page) the queue shows counts
// only and the usage is left out, and the ledger is not read.
func (r *Relay) statusData(operator bool) map[string]any {
	now := r.cfg.Clock.Now()
	series := r.stats.series(now)
	var req, hits, misses, lastMin, n int
	var ttft float64
	for i, p := range series {
		req += p.Requests
		hits += p.Hits
		misses += p.Misses
		if p.TTFTMean > 0 {
			ttft += p.TTFTMean * float64(p.Requests)
			n += p.Requests
		}
		if i >= len(series)-6 {
			lastMin += p.Requests
		}
	}
	sum := map[string]any{"requests": req, "rate_per_s_last_minute": float64(lastMin) / 60}
	if hits+misses > 0 {
		sum["hit_ratio"] = float64(hits) / float64(hits+misses)
	}
	if n > 0 {
		sum["ttft_ms_mean"] = ttft / float64(n)
	}
	out := map[string]any{
		"time":         now.UTC().Format(time.RFC3339),
		"endpoints":    r.Table(),
		"series":       series,
		"step_seconds": statsStep,
		"summary":      sum,
		"sessions":     r.sched.Sessions(),
		"queue":        r.QueueStatus(),
	}
	if operator {
		out["usage"] = r.lastDayUsage(now)
	} else {
		q := out["queue"].(QueueStatus)
		for i := range q.Flows {
			q.Flows[i].Client = ""
		}
	}
	if r.audits != nil {
		// Agents quarantined for a model, with the audit that convicted them.
		out["quarantined"] = r.audits.Quarantined()
	}
	return out
}

// dayUsage is the status page's view of the ledger: the last 24 hours by
// client and by agent, with the cache's share and savings.
type dayUsage struct {
	Clients []ledger.ReportRow `json:"clients"`
	Agents  []ledger.ReportRow `json:"agents"`
}

// lastDayUsage reads the ledger's last 24 hours by client and by agent;
// nil without a ledger or when it cannot be read (the page says so).
func (r *Relay) lastDayUsage(now time.Time) *dayUsage {
	l := r.cfg.Ledger
	if l == nil {
		return nil
	}
	since := now.Add(-24 * time.Hour)
	clients, err := l.Usage(since, ledger.ByClient)
	if err != nil {
		return nil
	}
	agents, err := l.Usage(since, ledger.ByAgent)
	if err != nil {
		return nil
	}
	return &dayUsage{Clients: clients.Rows, Agents: agents.Rows}
}

//go:embed status.html
var statusPage string
