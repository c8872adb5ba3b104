// Package poll is the tests' one way to wait for a condition that other
// goroutines or processes bring about: it depends on nothing but the
// standard library, so the tests of every package, the agent's and the
// scheduler's included, may use it without an import cycle.
package poll

import (
	"context"
	"testing"
	"time"
)

// Timeout is how long Eventually waits: long enough for a slow, loaded
// machine, short enough that a hung test fails well inside the test
// binary's timeout. It only guards against a hang; a test that claims a
// time bound measures it itself.
const Timeout = 30 * time.Second

// Interval is how often Eventually checks.
const Interval = 5 * time.Millisecond

// Eventually checks cond every Interval until it holds, and fails t with
// "timed out waiting for what" when it still does not after Timeout.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	Within(t, Timeout, what, cond)
}

// Within is Eventually with a limit of the caller's, for waits that take
// longer than Timeout by design (gossip's failure detection at a
// preset's timings); it returns how long cond took to hold.
func Within(t testing.TB, limit time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > limit {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(Interval)
	}
	return time.Since(start)
}

// Until checks cond every Interval until it holds (nil) or ctx ends (its
// error): the same wait for code that has a context and no test, such as a
// benchmark's cluster.
func Until(ctx context.Context, cond func() bool) error {
	tick := time.NewTicker(Interval)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
	return nil
}
