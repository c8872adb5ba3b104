package scheduler

// Prefix placement: the sticky policy's choice for a request that has a
// prompt prefix but no live session mapping (no key, a new or expired
// session, or one whose endpoint cannot take it now).
//
// Each admitted endpoint is given a cost in blocks, as NVIDIA Dynamo's KV
// router does: the blocks of the prompt it would have to prefill (those
// after the prefix it is believed to hold) plus the prompt blocks of the
// requests it is already serving, times loadWeight, plus its engine's queue
// at the mean request size. The cost is divided by the endpoint's weight
// and success rate (weight alone during its cold start), so the seed's
// signals still count. The cheapest endpoint wins; endpoints within
// costTolerance of it are equals, and among equals the prefix's first
// blocks choose by rendezvous hashing, so that independent relays send a
// new prefix to the same endpoint.
//
// Guards against a hot prefix piling onto one endpoint: the load term
// itself (an endpoint holding the prefix stops winning once its queue costs
// more than a cold prefill elsewhere, and then the prefix is held twice),
// and SGLang's balance rule: when the busiest candidate has more than
// balanceAbs requests in flight over the idlest and more than balanceRel
// times as many, the prefix is ignored and the least loaded endpoint wins.

const (
	// loadWeight weighs blocks already in flight on an endpoint against
	// the blocks a request would prefill there.
	loadWeight = 1.0
	// costTolerance: costs within this share of the best are equal.
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
	key := chain[min(hrwBlocks, len(chain))-1]

	sc := s.scoreContext(now)
	clean := len(a.dead)+len(a.used)+len(a.failed) == 0
	minLoad, maxLoad := -1, 0
	waiting, inFlight := 0, 0
	for _, e := range g.eps {
		waiting += e.health.Waiting
		inFlight += e.inFlight
	}
	meanBlocks := float64(len(chain))
	if inFlight > 0 {
		var act int
		for _, e := range g.eps {
			act += e.active
		}
		meanBlocks = float64(act) / float64(inFlight)
	}

	var best, least *endpoint
	var bestCost, leastLoad float64
	var bestHRW, leastHRW uint64
	bestAvoid, leastAvoid := false, false
	bestOv := 0
	for _, e := range g.eps {
		ok, avoid := e.br == BreakerClosed && clean && !e.disabled && !e.removed && e != a.mapped &&
			!e.health.Draining && (e.capacity == 0 || e.inFlight < e.capacity), e.health.Suspect
		if !ok {
			ok, avoid = a.admit(e, now, false)
		}
		if !ok {
			continue
		}
		ov := 0
		if e.ix != nil && e.ix.gen == gen {
			ov = e.ix.overlap
		}
		load := max(e.inFlight, e.health.Running) + e.health.Waiting
		if minLoad < 0 || load < minLoad {
			minLoad = load
		}
		maxLoad = max(maxLoad, load)

		cost := float64(len(chain)-ov) + loadWeight*(float64(e.active)+float64(e.health.Waiting)*meanBlocks)
		cost *= 1 + e.health.KVCacheUsage*0.5
		if e.requests < s.coldStart {
			cost /= e.weight
		} else {
			cost /= e.weight * e.successRate(sc.decay)
		}
		hrw := mix64(key ^ e.idHash)

		// Least loaded, for the balance rule.
		if l := float64(load); least == nil || (avoid != leastAvoid && !avoid) ||
			(avoid == leastAvoid && (l < leastLoad || (l == leastLoad && hrw > leastHRW))) {
			least, leastLoad, leastHRW, leastAvoid = e, l, hrw, avoid
		}
		switch {
		case best == nil, avoid != bestAvoid && !avoid:
		case avoid != bestAvoid:
			continue
		case cost < bestCost*(1-costTolerance):
		case cost <= bestCost*(1+costTolerance) && hrw > bestHRW:
			// An equal: rendezvous hashing decides.
		default:
			continue
		}
		best, bestCost, bestHRW, bestAvoid, bestOv = e, cost, hrw, avoid, ov
	}
	if best == nil {
		return nil, 0
	}
	if maxLoad-minLoad > balanceAbs && float64(maxLoad) > balanceRel*float64(minLoad) && least != best && !leastAvoid {
		ov := 0
		if least.ix != nil && least.ix.gen == gen {
			ov = least.ix.overlap
		}
		return least, ov
	}
	return best, bestOv
}
