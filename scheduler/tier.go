package scheduler

import "slices"

// Priority tiers.
//
// Every endpoint has a Priority (0 first). A pick first chooses the tier,
// then applies the policy (session affinity, score, ...) among that tier's
// endpoints only. The chosen tier is the lowest one holding an endpoint that
// is available to this attempt and neither saturated nor to be avoided:
// admitted (not excluded, not draining, breaker admitting, a free slot) and
// neither Suspect nor failed earlier in this request, and whose engine does
// not report itself saturated. When no tier has such an endpoint, the lowest
// tier with an admitted endpoint not to be avoided is used (its engine
// saturated), else the lowest with any admitted endpoint; so a retry after a failure
// overflows to the next tier when its own tier has nothing else, and a lone
// failing tier can still be retried. A request that waits for room
// (Request.Wait) counts an endpoint that lacks only a free slot as
// available: it waits for its tier rather than overflowing. A session mapped to an endpoint outside
// the chosen tier counts as a miss: when the first tier recovers, sessions
// that overflowed come back to it.

// tierState is a group's split by priority, rebuilt lazily when the group's
// endpoints or their priorities change.
type tierState struct {
	priority   int      // for a tier's own group: its priority
	tiers      []*group // by ascending priority; nil while only one tier exists
	tiersDirty bool
}

// buildTiers splits g into one group per priority, each sorted by ID like
// g itself.
func buildTiers(g *group) {
	g.tiersDirty = false
	g.tiers = g.tiers[:0]
	multi := false
	for _, e := range g.eps {
		if e.priority != g.eps[0].priority {
			multi = true
			break
		}
	}
	if !multi {
		g.tiers = nil
		return
	}
	for _, e := range g.eps {
		i, found := slices.BinarySearchFunc(g.tiers, e.priority, func(t *group, p int) int { return t.priority - p })
		if !found {
			g.tiers = slices.Insert(g.tiers, i, &group{tierState: tierState{priority: e.priority}, ringDirty: true})
		}
		t := g.tiers[i]
		t.eps = append(t.eps, e)
	}
}

// tierGroup returns the group of the tier this attempt picks from, or nil
// when g has a single tier or no tier admits the attempt (the policy then
// runs over g and reports why nothing is available). It reads a.mapped, so
// the session's own endpoint counts as available up to its affinity
// capacity.
func (a *Attempt) tierGroup(g *group, now int64) *group {
	if g.tiersDirty {
		buildTiers(g)
	}
	if g.tiers == nil {
		return nil
	}
	var saturated, avoided *group
	for _, t := range g.tiers {
		for _, e := range t.eps {
			ok, avoid := a.admit(e, now, false)
			if !ok && a.wait && a.full(e, now) {
				ok, avoid = true, e.health.Suspect || slices.Contains(a.failed, e.id)
			}
			switch {
			case !ok:
			case avoid:
				if avoided == nil {
					avoided = t
				}
			case !a.s.engineSaturated(e):
				return t
			case saturated == nil:
				saturated = t
			}
		}
	}
	if saturated != nil {
		return saturated
	}
	return avoided
}

// setTierAndKeys applies ep's priority and keys to e, keeping the state of
// keys that stay. Called by Upsert with s.mu held, before e's models change.
func (s *Scheduler) setTierAndKeys(e *endpoint, ep Endpoint) {
	p := max(ep.Priority, 0)
	if p != e.priority {
		e.priority = p
		for _, m := range e.models {
			if g := s.groups[m]; g != nil {
				g.tiersDirty = true
			}
		}
	}
	e.keys = mergeKeys(e.keys, ep.Keys)
}
