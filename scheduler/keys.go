package scheduler

import (
	"slices"
	"time"
)

// Keys of an endpoint.
//
// A provider endpoint (a hosted OpenAI-compatible API) is reached with one
// of several API keys. The seed's per-request exclusions are about keys:
// DeadKeys (a 401/403 names that key invalid for the rest of the request)
// and UsedKeys (a 429 already met in this request). For an endpoint with
// Keys, each (endpoint, key) pair is excluded on its own, so a request whose
// first key is refused and whose second is rate limited is served by the
// third. The endpoint as a whole is excluded as a dead key when every key
// answered 401/403 in this request, and as a used key when every key did
// one or the other (and one of them 429).
//
// A 429 opens that key's own breaker for the upstream's Retry-After
// (Config.RateLimitCooldown without one, at most Config.MaxRetryAfter): the
// key is skipped by every request until then, then admits at most
// HalfOpenProbes requests at a time until that many succeed. It does not
// open the endpoint's breaker, which counts what is about the endpoint
// itself: 5xx answers, timeouts and connection failures. Keys are tried in
// the order given: the first key that this request has not excluded and
// whose breaker admits it.

// keyState is the scheduler's state of one key; guarded by Scheduler.mu.
type keyState struct {
	id           string
	br           BreakerState
	openUntil    int64
	gen          uint64 // bumped on every breaker transition
	probes       int    // half-open probes in flight
	probeSuccess int

	successes, deadKeys, rateLimited uint64
}

// KeyStatus is a point-in-time view of one key of an endpoint.
type KeyStatus struct {
	// ID is the key's label from Endpoint.Keys.
	ID string
	// Breaker is the key's rate-limit breaker.
	Breaker BreakerState
	// BreakerUntil is when an open breaker turns half-open; zero when the
	// breaker is not open.
	BreakerUntil time.Time
	// Lifetime counts of outcomes on this key.
	Successes, DeadKeys, RateLimited uint64
}

// keyRef names one (endpoint, key) pair in an attempt's exclusions; key is
// empty for an endpoint without keys.
type keyRef struct{ id, key string }

func (k *keyState) state(now int64) BreakerState {
	if k.br == BreakerOpen && now >= k.openUntil {
		k.br = BreakerHalfOpen
		k.gen++
		k.probes, k.probeSuccess = 0, 0
	}
	return k.br
}

func (k *keyState) open(now int64, d time.Duration) {
	until := now + int64(d)
	if k.br == BreakerOpen {
		k.openUntil = max(k.openUntil, until)
		return
	}
	k.br = BreakerOpen
	k.gen++
	k.openUntil = until
	k.probes, k.probeSuccess = 0, 0
}

// mergeKeys returns the states for ids, reusing those of old with the same
// ID; duplicate and empty IDs are dropped.
func mergeKeys(old []*keyState, ids []string) []*keyState {
	if len(ids) == 0 {
		return nil
	}
	if slices.EqualFunc(old, ids, func(k *keyState, id string) bool { return k.id == id }) {
		return old
	}
	out := make([]*keyState, 0, len(ids))
	for _, id := range ids {
		if id == "" || slices.ContainsFunc(out, func(k *keyState) bool { return k.id == id }) {
			continue
		}
		i := slices.IndexFunc(old, func(k *keyState) bool { return k.id == id })
		if i >= 0 {
			out = append(out, old[i])
		} else {
			out = append(out, &keyState{id: id})
		}
	}
	return out
}

// keysExcluded reports whether every key of e is in set or also, with at
// least one in set; for an endpoint without keys, whether e is in set.
func keysExcluded(e *endpoint, set, also []keyRef) bool {
	if len(e.keys) == 0 {
		return slices.Contains(set, keyRef{id: e.id})
	}
	hit := false
	for _, k := range e.keys {
		ref := keyRef{e.id, k.id}
		switch {
		case slices.Contains(set, ref):
			hit = true
		case slices.Contains(also, ref):
		default:
			return false
		}
	}
	return hit
}

// firstKey returns the first key of e that this attempt may use now, or nil.
func (a *Attempt) firstKey(e *endpoint, now int64) *keyState {
	for _, k := range e.keys {
		ref := keyRef{e.id, k.id}
		if slices.Contains(a.dead, ref) || slices.Contains(a.used, ref) {
			continue
		}
		switch k.state(now) {
		case BreakerOpen:
			continue
		case BreakerHalfOpen:
			if k.probes >= a.s.cfg.HalfOpenProbes {
				continue
			}
		}
		return k
	}
	return nil
}

// keysAdmit reports whether e has a key this attempt may use now (always
// true for an endpoint without keys).
func (a *Attempt) keysAdmit(e *endpoint, now int64) bool {
	return len(e.keys) == 0 || a.firstKey(e, now) != nil
}

// takeKey reserves the key for a pick of p.e and returns its label ("" for
// an endpoint without keys).
func (a *Attempt) takeKey(p *pending, now int64) string {
	if len(p.e.keys) == 0 {
		return ""
	}
	k := a.firstKey(p.e, now)
	if k == nil { // admit checked it; kept safe anyway
		k = p.e.keys[0]
	}
	p.k, p.kgen = k, k.gen
	if k.br == BreakerHalfOpen {
		k.probes++
		p.kprobe = true
	}
	return k.id
}

// keyReport applies a reported class to the pick's key; it returns the ref
// that the attempt's exclusions record.
func (a *Attempt) keyReport(p pending, class Class, now int64, retryAfter time.Duration) keyRef {
	k := p.k
	if k == nil {
		return keyRef{id: p.e.id}
	}
	current := p.kgen == k.gen
	if p.kprobe && current && k.br == BreakerHalfOpen {
		k.probes--
	}
	switch class {
	case ClassSuccess:
		k.successes++
		if p.kprobe && current && k.br == BreakerHalfOpen {
			k.probeSuccess++
			if k.probeSuccess >= a.s.cfg.HalfOpenProbes {
				k.br = BreakerClosed
				k.gen++
				k.probes, k.probeSuccess = 0, 0
			}
		}
	case ClassDeadKey:
		k.deadKeys++
	case ClassRateLimited:
		k.rateLimited++
		d := retryAfter
		if d <= 0 {
			d = a.s.cfg.RateLimitCooldown
		}
		k.open(now, min(d, a.s.cfg.MaxRetryAfter))
	}
	return keyRef{p.e.id, k.id}
}

// keysLimited reports whether every key of e is rate limited for this
// attempt (used in it, or its breaker open), and the shortest wait until an
// open key breaker admits probes (-1 when none is open).
func (a *Attempt) keysLimited(e *endpoint, now int64) (bool, int64) {
	all := true
	var retry int64 = -1
	for _, k := range e.keys {
		limited := slices.Contains(a.used, keyRef{e.id, k.id})
		if k.state(now) == BreakerOpen {
			limited = true
			if d := k.openUntil - now; retry < 0 || d < retry {
				retry = d
			}
		}
		all = all && limited
	}
	return all, retry
}

// keyStatus returns the state of e's keys, for Snapshot.
func (s *Scheduler) keyStatus(e *endpoint, now int64) []KeyStatus {
	if len(e.keys) == 0 {
		return nil
	}
	out := make([]KeyStatus, len(e.keys))
	for i, k := range e.keys {
		out[i] = KeyStatus{ID: k.id, Breaker: k.state(now), Successes: k.successes, DeadKeys: k.deadKeys, RateLimited: k.rateLimited}
		if out[i].Breaker == BreakerOpen {
			out[i].BreakerUntil = s.timeAt(k.openUntil)
		}
	}
	return out
}
