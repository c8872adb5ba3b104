package liveness

import (
	"testing"
	"time"
)

// TestStallClock: ticks on time add nothing; a tick late by more than the
// slack adds its lateness; awake takes the stalls out of a silence.
func TestStallClock(t *testing.T) {
	var c stallClock
	t0 := time.Unix(1000, 0)
	now := t0
	for range 10 {
		now = now.Add(stallTick + stallSlack/2) // late, within the slack
		c.tick(now)
	}
	if got := c.total(); got != 0 {
		t.Fatalf("ticks within the slack counted %v stalled", got)
	}
	now = now.Add(stallTick + 2*time.Second) // the process did not run for 2 s
	c.tick(now)
	if got := c.total(); got != 2*time.Second {
		t.Fatalf("a 2 s stall counted %v", got)
	}
	// An agent last heard 2.5 s ago, 2 s of which the relay was stalled,
	// has been quiet for 0.5 s of the relay's time.
	if got := awake(now.Add(-2500*time.Millisecond), now, c.total()); got != 500*time.Millisecond {
		t.Fatalf("awake %v, want 500ms", got)
	}
	if got := awake(now, now, time.Second); got != 0 {
		t.Fatalf("awake %v, want 0 (never negative)", got)
	}
}
