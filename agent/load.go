package agent

import (
	"errors"
	"time"
)

// The engine's load figures (running and queued requests, KV-cache usage)
// are read from its /metrics every scrape interval and published in
// gossip. A read that fails keeps the last figures, but not for long: once
// the last good read is older than metricsStaleScrapes intervals, gossip
// says the load is unknown (transport.NodeMeta.LoadUnknown, figures zero)
// instead of repeating them, so that a broken exporter looks neither idle
// nor saturated for ever. The agent logs once when the figures go stale
// and once when a read brings them back.

// metricsStaleScrapes is how many scrape intervals the load figures stay
// good without a fresh read: one lost scrape (a slow engine, a timeout) is
// no reason to forget them.
const metricsStaleScrapes = 3

// errEngineDown is why no scrape was made while the engine is unavailable.
var errEngineDown = errors.New("engine unavailable")

// scrapeInterval is how often the load figures are read: every
// RefreshInterval, and every Gossip.MetricsInterval when gossip runs.
func (a *Agent) scrapeInterval() time.Duration {
	every := a.cfg.RefreshInterval
	if !a.cfg.Gossip.Disabled {
		mi := a.cfg.Gossip.MetricsInterval
		if mi <= 0 {
			mi = DefaultMetricsInterval
		}
		every = min(every, mi)
	}
	return every
}

// metricsStaleAfter is the age past which the load figures are unknown.
func (a *Agent) metricsStaleAfter() time.Duration {
	return metricsStaleScrapes * a.scrapeInterval()
}

// loadLocked returns the load figures to publish at now and whether they
// are known: read, and not older than metricsStaleAfter. Callers hold a.mu.
func (a *Agent) loadLocked(now time.Time) (EngineMetrics, bool) {
	if a.metricsAt.IsZero() || now.Sub(a.metricsAt) > a.metricsStaleAfter() {
		return EngineMetrics{}, false
	}
	return a.metrics, true
}

// noteLoadLocked records one scrape at now: met read (err nil), or a
// failure (err), or no scrape at all (met nil, err saying why). It returns
// the change of the figures' freshness to log (see logLoadChange).
// Callers hold a.mu.
func (a *Agent) noteLoadLocked(now time.Time, met *EngineMetrics, err error) loadChange {
	switch {
	case err != nil:
		a.metricsErr = err
	case met != nil:
		a.metrics = *met
		if met.Engine != "" { // an answer without known series has no figures
			a.metricsAt = now
		}
	}
	_, known := a.loadLocked(now)
	switch {
	case !known && !a.metricsAt.IsZero() && !a.loadStale:
		a.loadStale = true
		return loadChange{stale: true, age: now.Sub(a.metricsAt), err: a.metricsErr}
	case known && a.loadStale:
		a.loadStale = false
		return loadChange{back: true}
	}
	return loadChange{}
}

// loadChange is a change of the load figures' freshness.
type loadChange struct {
	stale, back bool
	age         time.Duration // since the last good read, when stale
	err         error         // the last failed read, when stale
}

// noteLoad is noteLoadLocked taking a.mu, then logging the change and
// publishing it in gossip at once.
func (a *Agent) noteLoad(now time.Time, met *EngineMetrics, err error) {
	a.mu.Lock()
	c := a.noteLoadLocked(now, met, err)
	a.mu.Unlock()
	a.logLoadChange(c)
}

// logLoadChange logs c (nothing when nothing changed) and publishes it.
func (a *Agent) logLoadChange(c loadChange) {
	switch {
	case c.stale:
		a.log.Warn().Err(c.err).Dur("age", c.age).Dur("stale_after", a.metricsStaleAfter()).
			Msg("engine load figures stale: no good /metrics read lately; reporting the load as unknown")
	case c.back:
		a.log.Info().Msg("engine load figures read again; reporting them")
	default:
		return
	}
	if g := a.Gossip(); g != nil {
		g.UpdateMeta()
	}
}
