package scheduler

import (
	"math"
	"slices"
	"time"
)

// Endpoint describes one agent and the models it serves.
type Endpoint struct {
	// ID is the stable key of the endpoint (the agent's name). Upsert
	// ignores an endpoint with an empty ID.
	ID string
	// Models lists the model names the endpoint serves.
	Models []string
	// Weight is the static priority; 0 (or a negative or non-finite value)
	// means 1.
	Weight float64
	// Capacity is the maximum number of concurrent requests; 0 (or
	// negative) means unlimited.
	Capacity int
	// Disabled takes the endpoint out of service: it is never picked.
	Disabled bool
	// Priority is the endpoint's tier: Pick uses the lowest tier that has
	// an available candidate (see tier.go). 0, the default, is the first
	// choice; negative values count as 0.
	Priority int
	// Keys names the credentials the endpoint is reached with, each its own
	// unit of the per-request DeadKeys and UsedKeys exclusions and with its
	// own rate-limit breaker (see keys.go). The names are opaque labels,
	// never the secrets. Empty means the endpoint is its own single key.
	Keys []string
	// PrefillLimit bounds the prefill work queued at the endpoint, in
	// prompt blocks as Request.Prefix counts them: once the uncached blocks
	// of its streamed requests picked and not yet started reach it, the
	// endpoint is full (as at its Capacity) until some start, except for a
	// request whose prefix it holds in more blocks than are queued there.
	// So a prompt the engine would only queue behind others waits in the
	// relay's Queue instead, where the order is fair and the endpoint that
	// frees first takes it, while one that waiting for its cache serves
	// sooner still goes to its cache. 0 (or negative) means no limit.
	PrefillLimit int
}

// Health is what gossip and the agent report about an endpoint. The zero
// value means healthy with no engine data.
type Health struct {
	// Suspect endpoints are picked only when no other endpoint is allowed.
	Suspect bool
	// Draining endpoints get no new requests, not even a session's
	// follow-ups; requests in flight finish normally.
	Draining bool
	// Running and Waiting are the engine's running and queued requests.
	// Zero is also how an engine whose load is not known (no figures, or
	// stale ones) is reported: the load is then the scheduler's own
	// in-flight count and sessions alone.
	Running, Waiting int
	// KVCacheUsage is the engine's KV-cache usage, 0..1. Zero is also "not
	// known": an engine is taken as saturated only on a reported queue and
	// a reported full cache.
	KVCacheUsage float64
}

// BreakerState is the state of an endpoint's circuit breaker. The zero
// value is BreakerClosed.
type BreakerState uint8

const (
	// BreakerClosed admits requests normally.
	BreakerClosed BreakerState = iota
	// BreakerOpen admits nothing until its cooldown ends.
	BreakerOpen
	// BreakerHalfOpen admits at most Config.HalfOpenProbes requests at a time.
	BreakerHalfOpen
)

// String returns "closed", "open" or "half-open".
func (b BreakerState) String() string {
	switch b {
	case BreakerClosed:
		return "closed"
	case BreakerOpen:
		return "open"
	case BreakerHalfOpen:
		return "half-open"
	}
	return "unknown"
}

// EndpointStatus is a point-in-time view of one endpoint, for metrics and
// debugging.
type EndpointStatus struct {
	ID       string   // the endpoint's ID
	Models   []string // its models, sorted
	Weight   float64  // its weight (1 when registered as 0)
	Capacity int      // its capacity; 0 means unlimited
	Disabled bool     // whether it is disabled
	Health   Health   // the last health reported

	// InFlight is the number of picked, not yet reported requests; Probes
	// is how many of them are half-open probes.
	InFlight, Probes int
	// Sessions is the number of sessions mapped to the endpoint (expired
	// ones until they are purged).
	Sessions int
	// Requests counts every pick; it ends the cold start.
	Requests uint64
	// Lifetime counts of reported outcomes by class.
	Successes, DeadKeys, RateLimited, Failures, ClientFaults uint64
	// SuccessRate is the decayed success rate used in the score.
	SuccessRate float64
	// EWMALatency is the moving average latency; 0 before the first sample.
	EWMALatency time.Duration
	// Breaker is the breaker state.
	Breaker BreakerState
	// BreakerUntil is when an open breaker turns half-open; zero when the
	// breaker is not open.
	BreakerUntil time.Time
	// ColdStart is true while Requests < Config.ColdStartSamples.
	ColdStart bool
	// Score is the sticky policy's score right now.
	Score float64
	// Backlog is the uncached prefix blocks of requests picked and not yet
	// started: the prefill work believed queued on the endpoint.
	Backlog int
	// Priority is the endpoint's tier (0 first).
	Priority int
	// Keys is the state of each of the endpoint's keys, in Endpoint.Keys
	// order; nil for an endpoint without keys.
	Keys []KeyStatus
}

// endpoint is the scheduler's state for one Endpoint. All fields are
// guarded by Scheduler.mu. Times are nanoseconds since Scheduler.epoch.
type endpoint struct {
	// Read by every pick; kept together at the front for cache locality.
	disabled  bool
	removed   bool // set by Remove; pending reports still land here harmlessly
	hasEWMA   bool
	br        BreakerState
	capacity  int
	affCap    int     // capacity for affinity hits: ceil(capacity × AffinityCapacity)
	invCap    float64 // 1/capacity, 0 when unlimited
	inFlight  int
	sessions  int // session table entries mapped here (expired ones until purged)
	probes    int // half-open probes in flight in the current breaker phase
	requests  uint64
	openUntil int64
	weight    float64
	ewma      float64 // nanoseconds
	// Decayed counts, in units of Scheduler.decayBase (see decayNow).
	good, bad float64 // success rate: successes vs failures and dead keys
	health    Health
	id        string
	idHash    uint64    // hashString(id), for rendezvous placement
	ix        *epIndex  // its entries in the prefix index; nil when none
	active    int       // prompt blocks of its requests in flight
	tree      *BlockLRU // PolicySGLang's approximate tree of what it holds
	// backlog is the prefill work waiting here: the uncached prefix blocks
	// of requests picked and not yet started (see Attempt.Started).
	backlog int
	// queuedPrefill is the share of backlog from streamed requests (see
	// Request.Streamed), held against prefillLimit.
	queuedPrefill, prefillLimit int

	models      []string // sorted, no duplicates
	brOK, brBad float64  // failure-rate rule: successes vs endpoint failures
	consecFails int

	successes, deadKeys, rateLimited, failures, clientFaults uint64

	brGen        uint64 // bumped on every breaker transition
	openForLimit bool   // the breaker was opened by a 429
	probeSuccess int    // successful probes in the current half-open phase

	priority int         // tier (tier.go)
	keys     []*keyState // in Endpoint.Keys order; nil without keys (keys.go)
	// repute holds the routing factors below 1 that reputation set per
	// model (SetModelWeight); nil when every model routes at full weight.
	// It is the Scheduler's map for this ID, kept across Remove and Upsert.
	repute map[string]float64
}

// factor returns e's reputation factor for model: 1 unless SetModelWeight
// lowered it; 0 means quarantined for the model.
func (e *endpoint) factor(model string) float64 {
	if e.repute == nil {
		return 1
	}
	if f, ok := e.repute[model]; ok {
		return f
	}
	return 1
}

func (e *endpoint) serves(model string) bool {
	_, ok := slices.BinarySearch(e.models, model)
	return ok
}

// successRate is the Laplace-smoothed decayed success rate: one imaginary
// success keeps a fresh or fully decayed endpoint at 1. f is
// Scheduler.decayNow's factor.
func (e *endpoint) successRate(f float64) float64 {
	return (e.good*f + 1) / ((e.good+e.bad)*f + 1)
}

// breakerState returns the breaker state at now, turning an open breaker
// half-open once its cooldown has passed.
func (e *endpoint) breakerState(now int64) BreakerState {
	if e.br == BreakerOpen && now >= e.openUntil {
		e.br = BreakerHalfOpen
		e.brGen++
		e.probes = 0
		e.probeSuccess = 0
	}
	return e.br
}

// open opens the breaker until now+d. If it is already open, the later of
// the two deadlines wins.
func (e *endpoint) open(now int64, d time.Duration, rateLimit bool) {
	until := now + int64(d)
	if e.br == BreakerOpen {
		if until > e.openUntil {
			e.openUntil = until
			e.openForLimit = rateLimit
		}
		return
	}
	e.br = BreakerOpen
	e.brGen++
	e.openUntil = until
	e.openForLimit = rateLimit
	e.probes = 0
	e.probeSuccess = 0
}

// close closes the breaker and forgets the failures that opened it.
func (e *endpoint) close() {
	e.br = BreakerClosed
	e.brGen++
	e.probes = 0
	e.probeSuccess = 0
	e.consecFails = 0
	e.brOK, e.brBad = 0, 0
}

// scoreCtx is what a score needs beyond the endpoint, computed once per
// pick.
type scoreCtx struct {
	decay float64 // Scheduler.decayNow's factor
	duty  float64 // in-flight requests per live session, at most 1
	model string  // the requested model: reputation weighs per model
}

func (s *Scheduler) scoreContext(now int64, model string) scoreCtx {
	c := scoreCtx{decay: s.decayNow(now), model: model}
	if n := s.sessions.len(); n > 0 {
		c.duty = min(float64(s.inFlight)/float64(n), 1)
	}
	return c
}

// minLoadFactor keeps a full endpoint's score positive, so ordering among
// full endpoints still follows the other factors.
const minLoadFactor = 0.01

// score is the sticky policy's score; see the package doc. It runs once
// per candidate endpoint per pick, so it is written with one division and
// no float min/max (which handle NaN and cost more).
//
// The expected load is the largest of our own in-flight count, the
// engine's running requests (gossip lags, and the engine's count includes
// ours) and duty × the sessions mapped here, plus the engine's queue.
func (s *Scheduler) score(e *endpoint, c scoreCtx) float64 {
	if e.requests < s.coldStart {
		return e.weight * e.factor(c.model)
	}
	running := e.inFlight
	if e.health.Running > running {
		running = e.health.Running
	}
	load := float64(running)
	if x := c.duty * float64(e.sessions); x > load {
		load = x
	}
	load += float64(e.health.Waiting)

	// weight × successRate × loadFactor / latencyFactor as num/den.
	num := e.weight * e.factor(c.model) * (e.good*c.decay + 1) * (1 - 0.5*e.health.KVCacheUsage)
	den := (e.good+e.bad)*c.decay + 1
	if e.hasEWMA {
		den *= 1 + e.ewma*s.invLatScale
	}
	if e.capacity > 0 {
		lf := 1 - load*e.invCap
		if lf < minLoadFactor {
			lf = minLoadFactor
		}
		num *= lf
	} else {
		den *= 1 + load
	}
	return num / den
}

// engineSaturated reports whether the engine says it cannot take more work
// without hurting everyone: it is queueing and its KV cache is full.
func (s *Scheduler) engineSaturated(e *endpoint) bool {
	return e.health.Waiting > 0 && e.health.KVCacheUsage >= s.cfg.SaturatedKVUsage
}

func normalizeEndpoint(ep Endpoint) (models []string, weight float64, capacity int) {
	models = slices.Clone(ep.Models)
	models = slices.DeleteFunc(models, func(m string) bool { return m == "" })
	slices.Sort(models)
	models = slices.Compact(models)
	weight = ep.Weight
	if !(weight > 0) || math.IsInf(weight, 0) {
		weight = 1
	}
	capacity = max(ep.Capacity, 0)
	return models, weight, capacity
}

func normalizeHealth(h Health) Health {
	h.Running = max(h.Running, 0)
	h.Waiting = max(h.Waiting, 0)
	if !(h.KVCacheUsage > 0) { // also catches NaN
		h.KVCacheUsage = 0
	}
	h.KVCacheUsage = min(h.KVCacheUsage, 1)
	return h
}

// routable reports whether e serves a model and is neither disabled,
// draining nor suspect (see Scheduler.Routable).
func (e *endpoint) routable() bool {
	return len(e.models) > 0 && !e.disabled && !e.removed && !e.health.Draining && !e.health.Suspect
}

// plain reports whether e takes a request with no further check: enabled,
// not removed or draining, a free slot, no key limits.
func (e *endpoint) plain() bool {
	return !e.disabled && !e.removed && !e.health.Draining &&
		(e.capacity == 0 || e.inFlight < e.capacity) && (e.prefillLimit <= 0 || e.queuedPrefill < e.prefillLimit) && e.keys == nil && e.repute == nil
}

// prefillRoom reports whether e may take a prompt of which it holds cached
// blocks and would prefill uncached under its PrefillLimit: the prefill
// queued there is below the limit (so a prompt longer than the limit is
// still served, by an endpoint that has prefilled what it had), or no more
// than the cached blocks, so that waiting behind it costs less than
// prefilling them cold elsewhere.
func (e *endpoint) prefillRoom(cached int) bool {
	q := e.queuedPrefill
	return e.prefillLimit <= 0 || q < e.prefillLimit || q <= cached
}

// publishes reports whether e's agent has published entries to the prefix
// index: whether the index knows what e holds.
func (e *endpoint) publishes() bool {
	return e.ix != nil && len(e.ix.blocks) > 0
}
