package scheduler

import "time"

// The dispatch limit.
//
// An engine batches a number of sequences at once and queues the rest in
// arrival order. Requests sent beyond its batch gain nothing there (they
// wait as they would at the relay) and lose what the relay's queue gives:
// fair order and the choice of engine when a slot frees. So each agent
// takes at most as many requests as its engine batches: its dispatch limit.
//
// Limiter finds that number. An engine that says its batch size (or the
// operator's --dispatch-limit) fixes it. Otherwise it is measured from the
// engine's own metrics, sampled every few seconds: while the engine queues
// requests (Waiting > 0 in two samples running) it batches what it runs,
// so the limit drops to the most it was seen running then (never rises
// so: an engine that runs more than the limit and still queues has other
// work than this agent's); while requests
// use the whole limit and the engine queues none, the limit grows at most
// once per GrowEvery: it doubles until the engine first queues (an engine
// of 256 slots is found in 5 steps from 8), then grows by a quarter below
// the last size that made the engine queue and by one at or above it (as
// TCP's slow start and congestion avoidance probe for a window). Probing above the last cut costs a
// request queued in the engine for a few samples, so when the engine
// queued with its KV cache far from full (its batch is bounded by its
// sequence count, which does not change), it probes above that bound only
// once per HardEvery; a batch bounded by the KV cache changes with the
// prompts' lengths and is probed every GrowEvery. An engine that reports
// no load is not measured: its limit stays Initial.

// LimitConfig configures a Limiter. The zero value of every field means its
// default.
type LimitConfig struct {
	// Fixed, when positive, is the limit: the engine's declared batch size
	// or the operator's. Nothing is measured.
	Fixed int
	// Initial is the limit before any measure. Zero means 8.
	Initial int
	// Min and Max bound the measured limit. Zero means 1 and 1024.
	Min, Max int
	// GrowEvery is the least time between two increases. Zero means 2 s.
	GrowEvery time.Duration
	// HardEvery is the least time between two probes above a cut made
	// with the KV cache below HardKV full. Zero means 1 minute.
	HardEvery time.Duration
}

// HardKV is the KV-cache usage below which an engine that queues is taken
// to be bounded by its sequence count, not its cache.
const HardKV = 0.9

func (c LimitConfig) populate() LimitConfig {
	if c.Initial <= 0 {
		c.Initial = 8
	}
	if c.Min <= 0 {
		c.Min = 1
	}
	if c.Max <= 0 {
		c.Max = 1024
	}
	c.Max = max(c.Max, c.Min)
	c.Initial = min(max(c.Initial, c.Min), c.Max)
	if c.GrowEvery <= 0 {
		c.GrowEvery = 2 * time.Second
	}
	if c.HardEvery <= 0 {
		c.HardEvery = time.Minute
	}
	return c
}

// LimitSample is one observation of an engine under the limit.
type LimitSample struct {
	// At is when it was taken.
	At time.Time
	// InFlight is the requests the agent had sent the engine and not seen
	// answered, at the moment of the sample.
	InFlight int
	// Running and Waiting are the engine's own counts.
	Running, Waiting int
	// KVCacheUsage is the engine's KV-cache usage, 0..1.
	KVCacheUsage float64
	// Known is false when the engine's metrics could not be read: the
	// sample says nothing.
	Known bool
}

// Limiter adapts a dispatch limit to an engine. It is not safe for
// concurrent use.
type Limiter struct {
	cfg      LimitConfig
	limit    int
	ceiling  int       // the limit the engine last queued at; 0 before
	hard     bool      // the engine queued at ceiling with KV to spare
	queued   int       // samples running in which the engine queued
	queueMax int       // the most running seen over those samples
	kvMax    float64   // the highest KV usage over those samples
	grown    time.Time // the last increase or cut
}

// NewLimiter returns a Limiter at its initial (or fixed) limit.
func NewLimiter(cfg LimitConfig) *Limiter {
	cfg = cfg.populate()
	l := &Limiter{cfg: cfg, limit: cfg.Initial}
	if cfg.Fixed > 0 {
		l.limit = cfg.Fixed
	}
	return l
}

// Limit returns the current limit.
func (l *Limiter) Limit() int { return l.limit }

// Observe takes a sample and returns the limit after it.
func (l *Limiter) Observe(s LimitSample) int {
	if l.cfg.Fixed > 0 || !s.Known {
		return l.limit
	}
	if s.Waiting > 0 {
		l.queued++
		l.queueMax = max(l.queueMax, s.Running)
		l.kvMax = max(l.kvMax, s.KVCacheUsage)
		// One sample may catch a request between its arrival and the
		// engine's next step: two in a row mean the batch is full.
		if l.queued >= 2 && l.queueMax > 0 {
			// At or above the limit, the engine queues others' work
			// (it may serve more than this agent): the limit holds.
			l.limit = min(max(min(l.queueMax, l.limit), l.cfg.Min), l.cfg.Max)
			l.ceiling = l.limit
			l.hard = l.kvMax < HardKV
			l.grown = s.At
		}
		return l.limit
	}
	l.queued, l.queueMax, l.kvMax = 0, 0, 0
	wait := l.cfg.GrowEvery
	if l.hard && l.limit >= l.ceiling {
		wait = l.cfg.HardEvery
	}
	if s.InFlight < l.limit || s.KVCacheUsage >= 0.95 || s.At.Sub(l.grown) < wait {
		return l.limit
	}
	var step int
	switch {
	case l.ceiling == 0:
		step = l.limit // slow start: the engine never queued yet
	case l.limit < l.ceiling:
		step = max(1, l.limit/4)
	default:
		step = 1
	}
	l.limit = min(l.limit+step, l.cfg.Max)
	l.grown = s.At
	return l.limit
}
