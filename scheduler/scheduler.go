package scheduler

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Scheduler chooses endpoints for requests. It is safe for concurrent use
// by many goroutines; it starts none and does no I/O.
type Scheduler struct {
	cfg   Config
	clock Clock
	epoch time.Time // times inside are nanoseconds since epoch

	// Derived from cfg, for the hot path.
	coldStart   uint64
	halfLife    float64 // ns
	invLatScale float64 // 1/ns

	mu        sync.Mutex // guards the fields below and every endpoint's state
	endpoints map[string]*endpoint
	groups    map[string]*group // by model
	sessions  *sessionTable
	rng       *rand.Rand
	seq       uint64 // numbers choices, so a Report is matched to its Pick
	inFlight  int    // picks not yet reported, over all endpoints
	index     *prefixIndex
	pickGen   uint64 // numbers prefix picks, stamping overlap scratch
	// repute holds the reputation factors below 1, by endpoint ID then
	// model (SetModelWeight); it outlives the endpoints, so that an agent
	// that leaves and joins again keeps its standing.
	repute map[string]map[string]float64

	// Decayed counts are stored in units that make decay one shared
	// factor: an outcome at time t adds 2^((t-decayBase)/halfLife), and a
	// count's value at now is the stored number times
	// 2^(-(now-decayBase)/halfLife). A pick computes that factor once
	// instead of once per endpoint. decayBase moves forward (rescaling every
	// endpoint) before the stored numbers could overflow.
	decayBase int64
	decayAt   int64   // when decayF was computed
	decayF    float64 // the factor at decayAt
}

// decayReuse is how long a computed decay factor is reused: with the default
// one-minute half-life it is off by at most 1.2e-5 relative, and busy
// schedulers skip most exponentials.
const decayReuse = int64(time.Millisecond)

// maxDecayExponent bounds (now-decayBase)/halfLife before a rebase; 2^256
// keeps the stored numbers far from float64 overflow.
const maxDecayExponent = 256

// decayNow returns the factor that turns stored decayed counts into their
// value at now.
func (s *Scheduler) decayNow(now int64) float64 {
	if s.decayF != 0 && now >= s.decayAt && now-s.decayAt < decayReuse {
		return s.decayF
	}
	x := float64(max(now-s.decayBase, 0)) / s.halfLife
	if x > maxDecayExponent {
		f := math.Exp2(-x)
		for _, e := range s.endpoints {
			e.good *= f
			e.bad *= f
			e.brOK *= f
			e.brBad *= f
		}
		s.decayBase, x = now, 0
	}
	s.decayAt, s.decayF = now, math.Exp2(-x)
	return s.decayF
}

// group is the endpoints serving one model, sorted by ID.
type group struct {
	eps  []*endpoint
	rr   uint64 // next round-robin start
	ring []ringPoint
	// ringDirty is set when eps or a weight changes; the ring is rebuilt on
	// the next consistent-hash pick.
	ringDirty bool
	tierState // priority tiers (tier.go)
}

// New returns a Scheduler for cfg, whose zero fields take their defaults.
func New(cfg Config) (*Scheduler, error) {
	cfg = cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	seed := uint64(cfg.Seed)
	if seed == 0 {
		seed = rand.Uint64()
	}
	s := &Scheduler{
		cfg:         cfg,
		clock:       cfg.Clock,
		epoch:       cfg.Clock.Now(),
		coldStart:   uint64(cfg.ColdStartSamples),
		halfLife:    float64(cfg.SuccessHalfLife),
		invLatScale: 1 / float64(cfg.LatencyScale),
		endpoints:   make(map[string]*endpoint),
		groups:      make(map[string]*group),
		sessions:    newSessionTable(int64(cfg.SessionTTL), cfg.MaxSessions),
		rng:         rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		index:       newPrefixIndex(),
	}
	return s, nil
}

// Config returns the scheduler's configuration with defaults filled in.
func (s *Scheduler) Config() Config { return s.cfg }

// now returns the clock's time as nanoseconds since s.epoch.
func (s *Scheduler) now() int64 { return int64(s.clock.Now().Sub(s.epoch)) }

func (s *Scheduler) timeAt(ns int64) time.Time { return s.epoch.Add(time.Duration(ns)) }

// Upsert adds an endpoint or updates the one with the same ID, keeping its
// statistics, breaker, health and sessions. An empty ID is ignored.
func (s *Scheduler) Upsert(ep Endpoint) {
	if ep.ID == "" {
		return
	}
	models, weight, capacity := normalizeEndpoint(ep)
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.endpoints[ep.ID]
	if e == nil {
		e = &endpoint{id: ep.ID, idHash: hashString(ep.ID), ix: s.index.byID[ep.ID], repute: s.repute[ep.ID]}
		s.endpoints[ep.ID] = e
	} else {
		for _, m := range e.models {
			if _, ok := slices.BinarySearch(models, m); !ok {
				s.leave(m, e)
			}
		}
	}
	old := e.models
	weightChanged := e.weight != weight
	s.setTierAndKeys(e, ep)
	e.models, e.weight, e.capacity, e.disabled = models, weight, capacity, ep.Disabled
	e.prefillLimit = max(ep.PrefillLimit, 0)
	e.affCap = int(math.Ceil(float64(capacity) * s.cfg.AffinityCapacity))
	e.invCap = 0
	if capacity > 0 {
		e.invCap = 1 / float64(capacity)
	}
	for _, m := range models {
		if _, ok := slices.BinarySearch(old, m); !ok {
			s.join(m, e)
		} else if weightChanged {
			s.groups[m].ringDirty, s.groups[m].tiersDirty = true, true
		}
	}
}

func (s *Scheduler) join(model string, e *endpoint) {
	g := s.groups[model]
	if g == nil {
		g = &group{}
		s.groups[model] = g
	}
	i, _ := slices.BinarySearchFunc(g.eps, e.id, func(x *endpoint, id string) int {
		return cmpString(x.id, id)
	})
	g.eps = slices.Insert(g.eps, i, e)
	g.ringDirty, g.tiersDirty = true, true
}

func (s *Scheduler) leave(model string, e *endpoint) {
	g := s.groups[model]
	if g == nil {
		return
	}
	g.eps = slices.DeleteFunc(g.eps, func(x *endpoint) bool { return x == e })
	g.ringDirty, g.tiersDirty = true, true
	if len(g.eps) == 0 {
		delete(s.groups, model)
	}
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Remove drops an endpoint, its statistics and the sessions mapped to it.
// Reports for its requests still in flight are accepted and ignored.
func (s *Scheduler) Remove(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.endpoints[id]
	if e == nil {
		return
	}
	for _, m := range e.models {
		s.leave(m, e)
	}
	delete(s.endpoints, id)
	s.indexDrop(id)
	e.ix = nil
	// Sessions notice the flag on their next lookup or purge; a scan of a
	// million sessions under the lock is what this avoids.
	e.removed = true
}

// SetHealth records what gossip says about an endpoint. Health for an
// unknown ID is ignored: the registry calls Upsert first.
func (s *Scheduler) SetHealth(id string, h Health) {
	h = normalizeHealth(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.endpoints[id]; e != nil {
		e.health = h
	}
}

// Models returns the sorted union of the models of routable endpoints
// (neither disabled nor draining).
func (s *Scheduler) Models() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for m, g := range s.groups {
		for _, e := range g.eps {
			if !e.disabled && !e.health.Draining {
				out = append(out, m)
				break
			}
		}
	}
	slices.Sort(out)
	return out
}

// Routable reports whether endpoint id is registered and in ordinary
// service: it serves a model and is neither disabled, draining nor suspect,
// so Pick considers it without falling back. Its breaker and free slots are
// not considered: they change request by request.
func (s *Scheduler) Routable(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.endpoints[id]
	return e != nil && e.routable()
}

// Sessions returns the number of session mappings held, including expired
// ones not yet purged.
func (s *Scheduler) Sessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sessions.len()
}

// Snapshot returns the state of every endpoint, sorted by ID.
func (s *Scheduler) Snapshot() []EndpointStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	sc := s.scoreContext(now, "")
	out := make([]EndpointStatus, 0, len(s.endpoints))
	for _, e := range s.endpoints {
		st := EndpointStatus{
			ID:           e.id,
			Models:       slices.Clone(e.models),
			Weight:       e.weight,
			Capacity:     e.capacity,
			Disabled:     e.disabled,
			Health:       e.health,
			InFlight:     e.inFlight,
			Probes:       e.probes,
			Requests:     e.requests,
			Successes:    e.successes,
			DeadKeys:     e.deadKeys,
			RateLimited:  e.rateLimited,
			Failures:     e.failures,
			ClientFaults: e.clientFaults,
			SuccessRate:  e.successRate(sc.decay),
			Sessions:     e.sessions,
			Breaker:      e.breakerState(now),
			ColdStart:    e.requests < s.coldStart,
			Score:        s.score(e, sc),
			Backlog:      e.backlog,
			Priority:     e.priority,
			Keys:         s.keyStatus(e, now),
		}
		if e.hasEWMA {
			st.EWMALatency = time.Duration(e.ewma)
		}
		if st.Breaker == BreakerOpen {
			st.BreakerUntil = s.timeAt(e.openUntil)
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b EndpointStatus) int { return cmpString(a.ID, b.ID) })
	return out
}

// SetModelWeight sets the routing factor that reputation gives endpoint id
// for model: f in (0, 1) multiplies its weight in the scores of requests
// for that model, so a doubtful agent loses part of its share; 0
// quarantines it for the model (ExclusionQuarantined: never picked, not
// even as a last resort, and sessions bound to it move); 1 (or more)
// restores it. Values are clamped to [0, 1]; NaN counts as 0. The factor
// is kept for an ID that is not (or no longer) registered and applies
// when it registers. Consistent-hash and the comparison policies honour
// quarantine only.
func (s *Scheduler) SetModelWeight(id, model string, f float64) {
	if !(f > 0) {
		f = 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.repute[id]
	if f >= 1 {
		if m == nil {
			return
		}
		delete(m, model)
		if len(m) == 0 {
			delete(s.repute, id)
			m = nil
		}
	} else {
		if m == nil {
			if s.repute == nil {
				s.repute = make(map[string]map[string]float64)
			}
			m = make(map[string]float64)
			s.repute[id] = m
		}
		m[model] = f
	}
	if e := s.endpoints[id]; e != nil {
		e.repute = m
		if g := s.groups[model]; g != nil {
			g.tiersDirty = true
		}
	}
}

// ModelWeight returns the reputation factor of endpoint id for model (1
// unless SetModelWeight lowered it).
func (s *Scheduler) ModelWeight(id, model string) float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if m := s.repute[id]; m != nil {
		if f, ok := m[model]; ok {
			return f
		}
	}
	return 1
}
