package scheduler

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// Request is what the scheduler needs to know about a request.
type Request struct {
	// Model is the requested model name.
	Model string
	// SessionKey identifies the conversation; empty means none.
	SessionKey string
	// Allow, when non-nil, is a hard constraint: only endpoints for which
	// it returns true may serve (the one engine that stores a response the
	// request continues, or those whose engine serves the request's API).
	// It is called with the scheduler's lock held: it must be fast and must
	// not call the scheduler.
	Allow func(endpointID string) bool
	// Prefix is the block-hash chain of the request's prompt (see
	// PromptBlocks); nil means none. With the sticky policy, a request
	// without a live session mapping goes where its prefix is cached,
	// weighed against load. The scheduler does not keep the slice.
	Prefix []uint64
	// Audit marks an audit of the endpoints' standing: a reputation
	// factor of 0 (quarantine) does not exclude an endpoint from it.
	Audit bool
	// Wait says the caller queues the request when the endpoints that
	// could take it are full (see Queue): a tier whose endpoints lack only
	// room is not passed over for the next tier, and Pick returns an
	// *UnavailableError with Full set. Without it a full tier overflows
	// to the next, as a failed one does.
	Wait bool
	// Streamed says the answer is streamed: its first byte (Started) comes
	// once its prompt is prefilled, so its uncached blocks count against
	// the endpoint's PrefillLimit until then. A non-streamed answer's first
	// byte comes when the whole answer is done, which says nothing of its
	// prefill; such a request does not count against the limit.
	Streamed bool
}

// Affinity says how a pick related to the session's previous endpoint. The
// zero value is AffinityNone.
type Affinity uint8

const (
	// AffinityNone: the request carried no session key.
	AffinityNone Affinity = iota
	// AffinityHit: the session's live mapped endpoint was chosen.
	AffinityHit
	// AffinityMiss: the request had a session key but no live mapping, or
	// its mapped endpoint was not chosen.
	AffinityMiss
)

// String returns "none", "hit" or "miss".
func (a Affinity) String() string {
	switch a {
	case AffinityHit:
		return "hit"
	case AffinityMiss:
		return "miss"
	}
	return "none"
}

// Choice is the result of a successful Pick. Hand it back to Report exactly
// once, whatever happens to the request.
type Choice struct {
	// EndpointID is the chosen endpoint's ID.
	EndpointID string
	// Affinity says whether the session's previous endpoint was chosen.
	Affinity Affinity
	// Probe is true when the choice holds one of a half-open breaker's
	// probe slots.
	Probe bool
	// CachedBlocks is how many leading blocks of the request's Prefix the
	// chosen endpoint was believed to hold.
	CachedBlocks int
	// Key is the label of the endpoint key to use (see keys.go); empty for
	// an endpoint without keys.
	Key string

	seq uint64
}

// ErrUnknownModel is returned by Pick when no registered endpoint lists the
// model at all (HTTP 404).
var ErrUnknownModel = errors.New("scheduler: unknown model")

// ErrUnavailable matches (with errors.Is) every *UnavailableError.
var ErrUnavailable = errors.New("scheduler: no endpoint available")

// UnavailableError is returned by Pick when endpoints serve the model but
// none may take the request now.
type UnavailableError struct {
	// Model is the requested model.
	Model string
	// RateLimited is true when every candidate is rate limited (HTTP 429);
	// otherwise the condition is an HTTP 503.
	RateLimited bool
	// RetryAfter is the time until the first open breaker among the
	// candidates admits probes again; 0 when unknown.
	RetryAfter time.Duration
	// Full is true when a candidate lacked only a free slot: the request
	// can wait for one.
	Full bool
}

// Error describes the condition.
func (e *UnavailableError) Error() string {
	what := "no endpoint available"
	if e.RateLimited {
		what = "every endpoint is rate limited"
	}
	if e.RetryAfter > 0 {
		return fmt.Sprintf("scheduler: model %q: %s (retry after %v)", e.Model, what, e.RetryAfter)
	}
	return fmt.Sprintf("scheduler: model %q: %s", e.Model, what)
}

// Is makes errors.Is(err, ErrUnavailable) true.
func (e *UnavailableError) Is(target error) bool { return target == ErrUnavailable }

// Exclusion is why an attempt may not use an endpoint at all, reported in
// the order the checks run. The zero value ExclusionNone means no
// exclusion applies (the endpoint may still be unavailable right now, e.g.
// its breaker is open).
type Exclusion uint8

const (
	// ExclusionNone: not excluded.
	ExclusionNone Exclusion = iota
	// ExclusionDisabled: the endpoint is disabled (or unknown).
	ExclusionDisabled
	// ExclusionDeadKey: it answered 401/403 earlier in this request.
	ExclusionDeadKey
	// ExclusionUsedKey: it answered 429 earlier in this request.
	ExclusionUsedKey
	// ExclusionModel: it does not serve the requested model.
	ExclusionModel
	// ExclusionAllow: the request's Allow constraint rejects it.
	ExclusionAllow
	// ExclusionQuarantined: reputation put it in quarantine for the
	// requested model (SetModelWeight with 0).
	ExclusionQuarantined
)

// String returns a short lower-case name.
func (x Exclusion) String() string {
	return [...]string{"none", "disabled", "dead-key", "used-key", "model", "allow", "quarantined"}[min(int(x), 6)]
}

// Attempt is the per-request state: the exclusions learned from earlier
// tries of this request and its picks not yet reported. Exclusions never
// leave the attempt. An Attempt is safe for concurrent use.
type Attempt struct {
	s   *Scheduler
	req Request

	// Guarded by s.mu.
	dead, used []keyRef // (endpoint, key) pairs refused (401/403) and rate limited (429)
	failed     []string // endpoint IDs
	pending    []pending
	pendingBuf [2]pending
	mapped     *endpoint // the session's live endpoint, during a Pick
	wait       bool      // Request.Wait until StopWaiting
	// ovGen is the index generation of the prefix overlaps this Pick
	// computed (pickPrefix); 0 before, and for policies that do not.
	ovGen uint64
}

type pending struct {
	seq   uint64
	e     *endpoint
	gen   uint64 // breaker generation at pick time
	probe bool
	// The key taken (nil without keys), its breaker generation, and
	// whether the pick holds one of its probe slots.
	k      *keyState
	kgen   uint64
	kprobe bool
	blocks int // prompt blocks counted in e.active
	// uncached is this request's share of e.backlog until it starts.
	uncached int
	started  bool
	queued   bool // uncached counts in e.queuedPrefill until it starts
}

// Begin starts the scheduling of one request.
func (s *Scheduler) Begin(r Request) *Attempt {
	return &Attempt{s: s, req: r, wait: r.Wait}
}

// StopWaiting clears the request's Wait: its next Pick overflows to a
// further tier when its own is full. The caller has waited long enough.
func (a *Attempt) StopWaiting() {
	a.s.mu.Lock()
	a.wait = false
	a.s.mu.Unlock()
}

// Request returns the request the attempt was begun with.
func (a *Attempt) Request() Request { return a.req }

// Excluded reports the first exclusion, in check order (disabled, dead
// key, used key, model), that keeps the attempt from the endpoint id.
func (a *Attempt) Excluded(id string) Exclusion {
	a.s.mu.Lock()
	defer a.s.mu.Unlock()
	e := a.s.endpoints[id]
	if e == nil {
		return ExclusionDisabled
	}
	return a.exclusion(e, true)
}

// exclusion runs the per-request checks in order. checkModel is false for
// endpoints taken from the model's group.
func (a *Attempt) exclusion(e *endpoint, checkModel bool) Exclusion {
	switch {
	case e.disabled || e.removed:
		return ExclusionDisabled
	case len(a.dead) > 0 && keysExcluded(e, a.dead, nil):
		return ExclusionDeadKey
	case len(a.used) > 0 && keysExcluded(e, a.used, a.dead):
		return ExclusionUsedKey
	case checkModel && !e.serves(a.req.Model):
		return ExclusionModel
	case a.req.Allow != nil && !a.req.Allow(e.id):
		return ExclusionAllow
	case e.repute != nil && !a.req.Audit && e.factor(a.req.Model) == 0:
		return ExclusionQuarantined
	}
	return ExclusionNone
}

// admit reports whether e may take this request now: not excluded, not
// draining, its breaker admits it and it has a free slot (counting up to
// affCap on the session's own endpoint, up to capacity elsewhere). avoid is
// true for endpoints to use only when no other is admitted: suspects and
// endpoints that failed earlier in this request.
func (a *Attempt) admit(e *endpoint, now int64, checkModel bool) (ok, avoid bool) {
	if a.exclusion(e, checkModel) != ExclusionNone || e.health.Draining {
		return false, false
	}
	switch e.breakerState(now) {
	case BreakerOpen:
		return false, false
	case BreakerHalfOpen:
		if e.probes >= a.s.cfg.HalfOpenProbes {
			return false, false
		}
	}
	if !a.keysAdmit(e, now) {
		return false, false
	}
	limit := e.capacity
	if e == a.mapped {
		limit = e.affCap
	}
	if limit > 0 && e.inFlight >= limit || !a.prefillRoom(e) {
		return false, false
	}
	avoid = e.health.Suspect || (len(a.failed) > 0 && slices.Contains(a.failed, e.id))
	return true, avoid
}

// full reports whether e lacks only room to take this request (a free slot,
// or room under its PrefillLimit): it is neither excluded nor draining and
// its breaker and keys admit it.
func (a *Attempt) full(e *endpoint, now int64) bool {
	limit := e.capacity
	if e == a.mapped {
		limit = e.affCap
	}
	noSlot := limit > 0 && e.inFlight >= limit
	if !noSlot && a.prefillRoom(e) || a.exclusion(e, false) != ExclusionNone || e.health.Draining {
		return false
	}
	switch e.breakerState(now) {
	case BreakerOpen:
		return false
	case BreakerHalfOpen:
		if e.probes >= a.s.cfg.HalfOpenProbes {
			return false
		}
	}
	return a.keysAdmit(e, now)
}

// prefillRoom reports whether e has room for the request's prefill
// (endpoint.prefillRoom), counting the prefix the index believes e holds
// when this Pick computed the overlaps, else none.
func (a *Attempt) prefillRoom(e *endpoint) bool {
	cached := 0
	if a.ovGen != 0 {
		cached = min(e.ix.overlapOf(a.ovGen), len(a.req.Prefix))
	}
	return e.prefillRoom(cached)
}

// admitsQuick reports whether e is admitted by the fast path of the pick
// loops, equivalent to admit(e, now, false) with avoid = e.health.Suspect
// in the common case: no exclusions in this attempt (clean, from a.clean),
// a closed breaker, not the mapped endpoint, a free slot, no key limits.
// When it reports false the caller asks admit. It is small enough to be
// inlined, and admit's call stays out of the common case.
func (a *Attempt) admitsQuick(e *endpoint, clean bool) bool {
	return clean && e.br == BreakerClosed && e != a.mapped && e.plain()
}

// clean reports whether the attempt excludes no endpoint yet (nothing dead,
// used or failed, no allow list), the condition of admitsQuick.
func (a *Attempt) clean() bool {
	return len(a.dead)+len(a.used)+len(a.failed) == 0 && a.req.Allow == nil
}

// Pick chooses an endpoint for the request and reserves a slot on it (and
// a probe slot if its breaker is half-open). Every returned Choice must be
// passed to Report. Errors: ErrUnknownModel, or an *UnavailableError.
func (a *Attempt) Pick() (Choice, error) {
	s := a.s
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	s.sessions.purge(now)
	g := s.groups[a.req.Model]
	if g == nil {
		return Choice{}, fmt.Errorf("%w: %q", ErrUnknownModel, a.req.Model)
	}
	var mapped *endpoint
	if a.req.SessionKey != "" {
		mapped = s.sessions.lookup(a.req.SessionKey, now)
	}
	a.mapped = mapped
	if t := a.tierGroup(g, now); t != nil {
		g = t
		if mapped != nil && mapped.priority != t.priority {
			mapped, a.mapped = nil, nil
		}
	}
	var e *endpoint
	cached := 0
	switch s.cfg.Policy {
	case PolicySticky:
		if mapped != nil {
			if ok, avoid := a.admit(mapped, now, true); ok && !avoid && !s.engineSaturated(mapped) {
				e = mapped
			}
		}
		switch {
		case e != nil && len(a.req.Prefix) > 0 && e.publishes():
			// The session's endpoint tells what it holds: it competes on
			// the prefix cost with the others, at its affinity capacity and
			// winning ties, so a busy one is passed over for an endpoint
			// where the request starts sooner, as a request without a key
			// would be.
			e, cached = a.pickPrefix(g, now)
		case e == nil && len(a.req.Prefix) > 0:
			e, cached = a.pickPrefix(g, now)
		}
		if e == nil {
			e = a.pickScored(g, now)
		}
	case PolicyRoundRobin:
		e = a.pickRoundRobin(g, now)
	case PolicyRandom:
		e = a.pickRandom(g, now)
	case PolicyLeastLoaded:
		e = a.pickLeastLoaded(g, now)
	case PolicyConsistentHash:
		e = a.pickHash(g, now)
	case PolicyPrefixHash:
		e = a.pickPrefixHash(g, now)
	case PolicyDualMap:
		e = a.pickDualMap(g, now)
	case PolicySGLang:
		e, cached = a.pickSGLang(g, now)
	}
	if e == nil {
		return Choice{}, a.unavailable(g, now)
	}

	c := Choice{EndpointID: e.id, Affinity: AffinityNone, CachedBlocks: cached}
	if a.req.SessionKey != "" {
		c.Affinity = AffinityMiss
		if e == mapped {
			c.Affinity = AffinityHit
		}
	}
	e.inFlight++
	s.inFlight++
	e.requests++
	if e.br == BreakerHalfOpen {
		e.probes++
		c.Probe = true
	}
	s.seq++
	c.seq = s.seq
	if a.pending == nil {
		a.pending = a.pendingBuf[:0]
	}
	blocks := len(a.req.Prefix)
	e.active += blocks
	uncached := blocks - cached
	e.backlog += uncached
	p := pending{seq: c.seq, e: e, gen: e.brGen, probe: c.Probe, blocks: blocks, uncached: uncached, queued: a.req.Streamed}
	if p.queued {
		e.queuedPrefill += uncached
	}
	c.Key = a.takeKey(&p, now)
	a.pending = append(a.pending, p)
	if blocks > 0 && s.cfg.Policy == PolicySticky {
		if e.ix == nil {
			e.ix = s.index.endpointIndex(e.id, true)
		}
		if e.ix != nil {
			s.index.recordRoute(e.ix, a.req.Prefix, now)
		}
	}
	return c, nil
}

// unavailable builds the error for a pick that found nothing.
func (a *Attempt) unavailable(g *group, now int64) error {
	err := &UnavailableError{Model: a.req.Model, RateLimited: true}
	candidates := 0
	var retry int64 = -1
	for _, e := range g.eps {
		if e.disabled {
			continue
		}
		candidates++
		limited := false
		if e.breakerState(now) == BreakerOpen {
			if d := e.openUntil - now; retry < 0 || d < retry {
				retry = d
			}
			limited = e.openForLimit
		}
		if len(e.keys) > 0 {
			kl, kd := a.keysLimited(e, now)
			limited = limited || kl
			if kd >= 0 && (retry < 0 || kd < retry) {
				retry = kd
			}
		} else if slices.Contains(a.used, keyRef{id: e.id}) {
			limited = true
		}
		if !limited {
			err.RateLimited = false
		}
		if !err.Full && a.full(e, now) {
			err.Full = true
		}
	}
	if candidates == 0 || err.Full {
		err.RateLimited = false
	}
	if retry > 0 {
		err.RetryAfter = time.Duration(retry)
	}
	return err
}

// Started tells the scheduler that the request of c has begun answering
// (its first byte arrived): its prompt is prefilled, so its uncached blocks
// no longer count as work queued on the endpoint. Calling it is optional
// (Report releases what it did not) and it may be called at most once per
// Choice; a Choice not from this attempt is ignored.
func (a *Attempt) Started(c Choice) {
	s := a.s
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range a.pending {
		if p := &a.pending[i]; p.seq == c.seq && c.seq != 0 {
			if !p.started {
				p.started = true
				p.e.backlog -= p.uncached
				if p.queued {
					p.e.queuedPrefill -= p.uncached
				}
			}
			return
		}
	}
}

// Report records how a picked request ended, releases its slot and returns
// the outcome's class. It updates the endpoint's latency average, success
// rate and breaker, the session's affinity, and this attempt's exclusions.
// A Choice not from this attempt, or reported twice, only gets classified.
func (a *Attempt) Report(c Choice, o Outcome) Class {
	class := Classify(o.Status, o.Err)
	s := a.s
	s.mu.Lock()
	defer s.mu.Unlock()
	i := slices.IndexFunc(a.pending, func(p pending) bool { return p.seq == c.seq })
	if c.seq == 0 || i < 0 {
		return class
	}
	p := a.pending[i]
	a.pending = slices.Delete(a.pending, i, i+1)
	e := p.e
	now := s.now()
	e.inFlight--
	s.inFlight--
	e.active -= p.blocks
	if !p.started {
		e.backlog -= p.uncached
		if p.queued {
			e.queuedPrefill -= p.uncached
		}
	}
	w := 1 / s.decayNow(now) // one outcome, in stored units
	current := p.gen == e.brGen
	if p.probe && current && e.br == BreakerHalfOpen {
		e.probes--
	}
	ref := a.keyReport(p, class, now, o.RetryAfter)
	switch class {
	case ClassSuccess:
		e.successes++
		e.good += w
		e.brOK += w
		e.consecFails = 0
		s.observeLatency(e, o.Latency)
		if p.probe && current && e.br == BreakerHalfOpen {
			e.probeSuccess++
			if e.probeSuccess >= s.cfg.HalfOpenProbes {
				e.close()
			}
		}
		if a.req.SessionKey != "" && !e.removed {
			s.sessions.touch(a.req.SessionKey, e, now)
		}
	case ClassDeadKey:
		e.deadKeys++
		e.bad += w
		a.dead = append(a.dead, ref)
	case ClassRateLimited:
		e.rateLimited++
		a.used = append(a.used, ref)
		if p.k != nil {
			break // the key's breaker opened (keyReport), not the endpoint's
		}
		d := o.RetryAfter
		if d <= 0 {
			d = s.cfg.RateLimitCooldown
		}
		e.open(now, min(d, s.cfg.MaxRetryAfter), true)
	case ClassEndpointFailure:
		e.failures++
		e.bad += w
		e.brBad += w
		e.consecFails++
		a.failed = append(a.failed, e.id)
		if o.Latency > 0 && (!e.hasEWMA || float64(o.Latency) > e.ewma) {
			// A timeout is evidence of slowness; a fast error is no
			// evidence of speed.
			s.observeLatency(e, o.Latency)
		}
		if a.req.SessionKey != "" {
			s.sessions.evictIf(a.req.SessionKey, e)
		}
		switch {
		case o.Err == nil && o.Status == 503:
			e.open(now, s.cfg.Cooldown, false)
		case !current:
			// Picked before the breaker last changed state: stale news.
		case e.br == BreakerHalfOpen && p.probe:
			e.open(now, s.cfg.Cooldown, false)
		case e.br == BreakerClosed && s.shouldTrip(e, 1/w):
			e.open(now, s.cfg.Cooldown, false)
		}
	case ClassClientFault:
		e.clientFaults++
	}
	return class
}

// shouldTrip applies the closed breaker's two rules; f is decayNow's factor.
func (s *Scheduler) shouldTrip(e *endpoint, f float64) bool {
	if s.cfg.FailureThreshold > 0 && e.consecFails >= s.cfg.FailureThreshold {
		return true
	}
	n := (e.brOK + e.brBad) * f
	return n >= s.cfg.FailureRateMinSamples && e.brBad*f >= s.cfg.FailureRate*n
}

func (s *Scheduler) observeLatency(e *endpoint, d time.Duration) {
	if d <= 0 {
		return
	}
	x := float64(d)
	if !e.hasEWMA {
		e.ewma, e.hasEWMA = x, true
		return
	}
	a := s.cfg.EWMAAlpha
	e.ewma = (1-a)*e.ewma + a*x
}
