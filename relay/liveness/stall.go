package liveness

import (
	"sync/atomic"
	"time"
)

// The relay's own stalls. A probe's echo that arrives while the relay's
// process does not run (starved of CPU on a loaded host, or paused) is
// read late, and the agent would look silent for a silence the relay made
// itself; every agent at once, and every answer in flight cut. So the
// relay measures how long it went without running, and the liveness
// bounds (liveness.go) count only the time it was awake.

// stallTick is the stall clock's period; a tick later than stallSlack
// beyond it counts the lateness as stalled.
const (
	stallTick  = 50 * time.Millisecond
	stallSlack = 50 * time.Millisecond
)

// stallClock adds up the time the process did not run. Safe for
// concurrent use.
type stallClock struct {
	stalled atomic.Int64 // nanoseconds
	last    time.Time    // the last tick seen; owned by the ticking goroutine
}

// tick records a tick seen at now.
func (c *stallClock) tick(now time.Time) {
	if !c.last.IsZero() {
		if late := now.Sub(c.last) - stallTick; late > stallSlack {
			c.stalled.Add(int64(late))
		}
	}
	c.last = now
}

// total returns the time stalled so far.
func (c *stallClock) total() time.Duration { return time.Duration(c.stalled.Load()) }

// run ticks until done closes.
func (c *stallClock) run(done <-chan struct{}) {
	t := time.NewTicker(stallTick)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			c.tick(time.Now())
		}
	}
}

// awake returns how much of the time from since to now the relay ran:
// now-since less what it stalled meanwhile (stalledSince).
func awake(since, now time.Time, stalledSince time.Duration) time.Duration {
	return max(now.Sub(since)-stalledSince, 0)
}
