package scheduler

import "math"

// Prefix placement: the sticky policy's choice for a request that has a
// prompt prefix but no live session mapping (no key, a new or expired
// session, or one whose endpoint cannot take it now), and for one whose
// mapped endpoint publishes its cache: that endpoint competes here at its
// affinity capacity and wins ties.
//
// Each admitted endpoint is given a cost in blocks, after NVIDIA Dynamo's
// KV router (prefill blocks left after the overlap plus the load): the
// prefill backlog queued there (the uncached blocks of requests picked and
// not yet started, and the engine's own queue at the mean request size),
// the seed's expected load (in flight, running on the engine, or the
// active share of the sessions mapped there) times loadWeight at the mean
// request size, and the prompt's blocks after the prefix it is believed to
// hold, weighed up by cacheBias. The cost is divided by the endpoint's
// weight and success rate (weight alone during its cold start) and raised
// by its KV-cache use, so the seed's signals still count. The cheapest
// endpoint wins; endpoints within costTolerance of it are equals, and
// among equals the prefix's first blocks choose by rendezvous hashing, so
// that independent relays send a new prefix to the same endpoint.
//
// Guards against a hot prefix piling onto one endpoint (the "death
// spiral"): once the cache's choice is hot (its expected load over hotRel
// times the least loaded endpoint's plus hotAbs), the choice is made again
// with hotCacheBias, where load counts nearly as much as the prefill, so the
// prefix is copied to a second endpoint; and SGLang's balance rule: when
// the busiest candidate has more than balanceAbs requests in flight over
// the idlest and more than balanceRel times as many, the prefix is ignored
// and the least loaded endpoint wins.

const (
	// cacheBias weighs the blocks a request would prefill against the
	// backlog it would wait behind while the load is even: a block
	// prefilled on another endpoint is a block held twice, and the copy
	// evicts other prefixes. The constants here were chosen with the
	// simulation over the Mooncake traces and chat (see the README).
	cacheBias = 100
	// hotCacheBias replaces cacheBias once the cache's choice is hot: its
	// expected load is over hotRel times the least loaded endpoint's plus
	// hotAbs requests, or its prefill backlog over the least one's plus
	// hotBacklog blocks (16K tokens). Then load counts nearly as much as
	// the prefill, and a hot prefix spreads.
	hotCacheBias = 3
	hotRel       = 1.5
	hotAbs       = 2
	hotBacklog   = 256
	// loadWeight turns the expected load (requests) into blocks, at the
	// mean request size.
	loadWeight = 1.0
	// costTolerance: costs within this share of the best, plus one
	// block, are equal.
	costTolerance = 0.02
	// balanceAbs and balanceRel are SGLang's balance thresholds
	// (balance_abs_threshold, balance_rel_threshold).
	balanceAbs = 64
	balanceRel = 1.5
	// hrwBlocks is how many leading blocks name a prefix for rendezvous
	// placement.
	hrwBlocks = 4
)

// pickPrefix returns the admitted endpoint with the lowest prefix cost and
// the number of the prefix's blocks it is believed to hold. It returns nil
// when no endpoint is admitted.
func (a *Attempt) pickPrefix(g *group, now int64) (*endpoint, int) {
	s := a.s
	chain := a.req.Prefix
	s.pickGen++
	gen := s.pickGen
	s.index.overlaps(chain, gen, now)
	a.ovGen = gen
	key := chain[min(hrwBlocks, len(chain))-1]

	sc := s.scoreContext(now, a.req.Model)
	clean := a.clean()
	minLoad, maxLoad := -1, 0
	inFlight, act := 0, 0
	for _, e := range g.eps {
		inFlight += e.inFlight
		act += e.active
	}
	meanBlocks := float64(len(chain))
	if inFlight > 0 {
		meanBlocks = float64(act) / float64(inFlight)
	}

	var hi, lo prefixChoice
	var least *endpoint
	var leastLoad float64
	var leastHRW uint64
	leastAvoid := false
	minSLoad, minBacklog := -1.0, -1.0
	for _, e := range g.eps {
		ok, avoid := a.admitsQuick(e, clean), e.health.Suspect
		if !ok {
			ok, avoid = a.admit(e, now, false)
		}
		if !ok {
			continue
		}
		ov := e.ix.overlapOf(gen)
		load := max(e.inFlight, e.health.Running) + e.health.Waiting
		if minLoad < 0 || load < minLoad {
			minLoad = load
		}
		maxLoad = max(maxLoad, load)

		// The expected time to first token in blocks: the prefill backlog
		// ahead (ours, and the engine's own queue at the mean request
		// size), the seed's expected load (in flight, running on the
		// engine, or the active share of the sessions mapped here) at the
		// mean request size, then this prompt's uncached blocks, weighed
		// up by a bias: a block prefilled here is also a block held twice,
		// taking cache from other prefixes.
		backlog := float64(e.backlog) + float64(e.health.Waiting)*meanBlocks
		sload := float64(max(e.inFlight, e.health.Running))
		if x := sc.duty * float64(e.sessions); x > sload {
			sload = x
		}
		base := backlog + loadWeight*sload*meanBlocks
		f := (1 + e.health.KVCacheUsage*0.5) / e.factor(sc.model)
		if e.requests < s.coldStart {
			f /= e.weight
		} else {
			f /= e.weight * e.successRate(sc.decay)
		}
		hrw := mix64(key ^ e.idHash)
		if e == a.mapped {
			hrw = math.MaxUint64 // the session's endpoint wins among equals
		}
		uncached := float64(len(chain) - ov)
		hi.offer(e, (base+uncached*(1+cacheBias))*f, hrw, avoid, ov, sload, backlog)
		lo.offer(e, (base+uncached*(1+hotCacheBias))*f, hrw, avoid, ov, sload, backlog)
		if !avoid && (minSLoad < 0 || sload < minSLoad) {
			minSLoad = sload
		}
		if !avoid && (minBacklog < 0 || backlog < minBacklog) {
			minBacklog = backlog
		}

		// Least loaded, for the balance rule.
		if l := float64(load); least == nil || (avoid != leastAvoid && !avoid) ||
			(avoid == leastAvoid && (l < leastLoad || (l == leastLoad && hrw > leastHRW))) {
			least, leastLoad, leastHRW, leastAvoid = e, l, hrw, avoid
		}
	}
	if hi.e == nil {
		return nil, 0
	}
	if maxLoad-minLoad > balanceAbs && float64(maxLoad) > balanceRel*float64(minLoad) && least != hi.e && !leastAvoid {
		return least, least.ix.overlapOf(gen)
	}
	// Cache first while the load is even; the load counts for more once
	// the cache's choice is hot.
	if hi.sload > hotRel*minSLoad+hotAbs || hi.backlog > minBacklog+hotBacklog {
		return lo.e, lo.ov
	}
	return hi.e, hi.ov
}

// prefixChoice keeps the cheapest endpoint offered: endpoints not to be
// avoided first, then lower cost; costs within costTolerance (plus one
// block) are equal, and rendezvous hashing picks among equals.
type prefixChoice struct {
	e       *endpoint
	cost    float64
	hrw     uint64
	avoid   bool
	ov      int
	sload   float64
	backlog float64
}

func (c *prefixChoice) offer(e *endpoint, cost float64, hrw uint64, avoid bool, ov int, sload, backlog float64) {
	switch {
	case c.e == nil, avoid != c.avoid && !avoid:
	case avoid != c.avoid:
		return
	case cost < c.cost*(1-costTolerance)-1:
	case cost <= c.cost*(1+costTolerance)+1 && hrw > c.hrw:
	default:
		return
	}
	*c = prefixChoice{e: e, cost: cost, hrw: hrw, avoid: avoid, ov: ov, sload: sload, backlog: backlog}
}
