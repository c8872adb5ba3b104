package scheduler

import (
	"math"
	"slices"
	"strconv"
)

// selector keeps the best endpoint offered so far. Ordering: endpoints not
// to be avoided first; then higher score; then (when byInFlight) fewer
// requests in flight; remaining ties are broken uniformly at random by
// reservoir sampling, so equal endpoints share load without allocating.
type selector struct {
	s          *Scheduler
	byInFlight bool
	best       *endpoint
	avoid      bool
	score      float64
	ties       int
}

// scoreEpsilon is the relative difference under which two scores are equal.
const scoreEpsilon = 1e-9

func (sel *selector) offer(e *endpoint, avoid bool, score float64) {
	if sel.best != nil {
		if avoid != sel.avoid {
			if avoid {
				return
			}
		} else {
			if c := compareScores(score, sel.score); c != 0 {
				if c < 0 {
					return
				}
			} else if sel.byInFlight && e.inFlight != sel.best.inFlight {
				if e.inFlight > sel.best.inFlight {
					return
				}
			} else {
				sel.ties++
				if sel.s.rng.IntN(sel.ties) == 0 {
					sel.best = e
				}
				return
			}
		}
	}
	sel.best, sel.avoid, sel.score, sel.ties = e, avoid, score, 1
}

func compareScores(a, b float64) int {
	if math.Abs(a-b) <= scoreEpsilon*max(math.Abs(a), math.Abs(b)) {
		return 0
	}
	if a > b {
		return 1
	}
	return -1
}

// pickScored returns the admitted endpoint with the best sticky score.
func (a *Attempt) pickScored(g *group, now int64) *endpoint {
	sel := selector{s: a.s, byInFlight: true}
	clean := a.clean()
	sc := a.s.scoreContext(now, a.req.Model)
	for _, e := range g.eps {
		ok, avoid := a.admitsQuick(e, clean), e.health.Suspect
		if !ok {
			ok, avoid = a.admit(e, now, false)
		}
		if !ok {
			continue
		}
		score := a.s.score(e, sc)
		if sel.best != nil && avoid == sel.avoid && score < sel.score*(1-2*scoreEpsilon) {
			continue // clearly worse: skip the full comparison
		}
		sel.offer(e, avoid, score)
	}
	return sel.best
}

// pickRandom returns a uniformly random admitted endpoint.
func (a *Attempt) pickRandom(g *group, now int64) *endpoint {
	sel := selector{s: a.s}
	for _, e := range g.eps {
		if ok, avoid := a.admit(e, now, false); ok {
			sel.offer(e, avoid, 0)
		}
	}
	return sel.best
}

// pickLeastLoaded returns the admitted endpoint with the fewest requests in
// flight.
func (a *Attempt) pickLeastLoaded(g *group, now int64) *endpoint {
	sel := selector{s: a.s}
	for _, e := range g.eps {
		if ok, avoid := a.admit(e, now, false); ok {
			sel.offer(e, avoid, -float64(e.inFlight))
		}
	}
	return sel.best
}

// pickRoundRobin returns the first admitted endpoint at or after the
// group's cursor, and advances the cursor.
func (a *Attempt) pickRoundRobin(g *group, now int64) *endpoint {
	n := uint64(len(g.eps))
	start := g.rr % n
	g.rr++
	var fallback *endpoint
	for i := range n {
		e := g.eps[(start+i)%n]
		ok, avoid := a.admit(e, now, false)
		switch {
		case !ok:
		case !avoid:
			return e
		case fallback == nil:
			fallback = e
		}
	}
	return fallback
}

// ringPoint is one virtual node of the consistent-hash ring.
type ringPoint struct {
	hash uint64
	e    *endpoint
}

// maxRingWeight caps the virtual nodes of one heavy endpoint.
const maxRingWeight = 10

// buildRing places round(VirtualNodes*weight) points per endpoint.
func (s *Scheduler) buildRing(g *group) {
	g.ring = g.ring[:0]
	for _, e := range g.eps {
		n := max(1, int(math.Round(float64(s.cfg.VirtualNodes)*min(e.weight, maxRingWeight))))
		buf := make([]byte, 0, len(e.id)+8)
		for i := range n {
			buf = append(buf[:0], e.id...)
			buf = append(buf, '#')
			buf = strconv.AppendInt(buf, int64(i), 10)
			g.ring = append(g.ring, ringPoint{hash: hashBytes(buf), e: e})
		}
	}
	slices.SortFunc(g.ring, func(x, y ringPoint) int {
		switch {
		case x.hash < y.hash:
			return -1
		case x.hash > y.hash:
			return 1
		}
		return cmpString(x.e.id, y.e.id)
	})
	g.ringDirty = false
}

// pickHash walks the ring clockwise from the session key's hash to the first
// admitted endpoint. Without a session key it picks at random.
func (a *Attempt) pickHash(g *group, now int64) *endpoint {
	if a.req.SessionKey == "" {
		return a.pickRandom(g, now)
	}
	return a.walkRing(g, now, hashString(a.req.SessionKey))
}

// walkRing returns the first admitted endpoint clockwise from h.
func (a *Attempt) walkRing(g *group, now int64, h uint64) *endpoint {
	if g.ringDirty {
		a.s.buildRing(g)
	}
	start, _ := slices.BinarySearchFunc(g.ring, h, func(p ringPoint, h uint64) int {
		switch {
		case p.hash < h:
			return -1
		case p.hash > h:
			return 1
		}
		return 0
	})
	var fallback *endpoint
	for i := range len(g.ring) {
		e := g.ring[(start+i)%len(g.ring)].e
		ok, avoid := a.admit(e, now, false)
		switch {
		case !ok:
		case !avoid:
			return e
		case fallback == nil:
			fallback = e
		}
	}
	return fallback
}

// FNV-1a, finished with a splitmix64 mix so nearby keys spread over the ring.
func hashString(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return mix64(h)
}

func hashBytes(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return mix64(h)
}

func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// prefixKeyBlocks is how many leading blocks name a prefix for the
// prefix-hash and dualmap policies: 16 blocks of 64 tokens, about the first
// 1,000 tokens.
const prefixKeyBlocks = 16

func prefixKey(chain []uint64) uint64 { return mix64(chain[min(prefixKeyBlocks, len(chain))-1]) }

// anyUnavoided reports whether g has an admitted endpoint not to be
// avoided. The policies that rank endpoints by a rule of their own
// (dualmap, sglang) then leave the avoided ones (suspect, or failed in this
// request) out, as every other policy prefers the rest.
func (a *Attempt) anyUnavoided(g *group, now int64) bool {
	for _, e := range g.eps {
		if ok, avoid := a.admit(e, now, false); ok && !avoid {
			return true
		}
	}
	return false
}

// pickPrefixHash walks the ring from the prefix's hash.
func (a *Attempt) pickPrefixHash(g *group, now int64) *endpoint {
	if len(a.req.Prefix) == 0 {
		return a.pickRandom(g, now)
	}
	return a.walkRing(g, now, prefixKey(a.req.Prefix))
}

// pickDualMap takes the two admitted endpoints of highest rendezvous hash
// with the prefix and returns the one with fewer requests in flight (the
// first on a tie).
func (a *Attempt) pickDualMap(g *group, now int64) *endpoint {
	if len(a.req.Prefix) == 0 {
		return a.pickRandom(g, now)
	}
	key := prefixKey(a.req.Prefix)
	var c1, c2 *endpoint
	var h1, h2 uint64
	skipAvoided := a.anyUnavoided(g, now)
	for _, e := range g.eps {
		if ok, avoid := a.admit(e, now, false); !ok || avoid && skipAvoided {
			continue
		}
		switch h := mix64(key ^ e.idHash); {
		case c1 == nil || h > h1:
			c1, c2, h1, h2 = e, c1, h, h1
		case c2 == nil || h > h2:
			c2, h2 = e, h
		}
	}
	if c2 != nil && c2.inFlight < c1.inFlight {
		return c2
	}
	return c1
}

// SGLang's defaults: cache_threshold, and max_tree_size in characters.
const (
	sglangCacheThreshold = 0.3
	sglangTreeBytes      = 1 << 24
)

// pickSGLang is SGLang's cache-aware policy over approximate per-endpoint
// trees, kept as block LRUs of the prefixes routed to each endpoint (block
// granularity instead of characters).
func (a *Attempt) pickSGLang(g *group, now int64) (*endpoint, int) {
	chain := a.req.Prefix
	minLoad, maxLoad := -1, 0
	var shortest, matched, smallest *endpoint
	bestMatch := 0
	skipAvoided := a.anyUnavoided(g, now)
	for _, e := range g.eps {
		if ok, avoid := a.admit(e, now, false); !ok || avoid && skipAvoided {
			continue
		}
		if e.tree == nil {
			e.tree = NewBlockLRU(sglangTreeBytes / PrefixConfig{}.BlockBytes())
		}
		if minLoad < 0 || e.inFlight < minLoad {
			minLoad, shortest = e.inFlight, e
		}
		maxLoad = max(maxLoad, e.inFlight)
		if m := e.tree.Lookup(chain); m > bestMatch {
			bestMatch, matched = m, e
		}
		if smallest == nil || e.tree.Len() < smallest.tree.Len() {
			smallest = e
		}
	}
	if shortest == nil {
		return nil, 0
	}
	e := smallest
	switch {
	case maxLoad-minLoad > balanceAbs && float64(maxLoad) > balanceRel*float64(minLoad):
		e = shortest
	case matched != nil && float64(bestMatch) > sglangCacheThreshold*float64(len(chain)):
		e = matched
	}
	cached, _, _ := e.tree.Insert(chain, nil, nil)
	return e, cached
}
