package poll

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

func TestEventuallyWaitsForTheCondition(t *testing.T) {
	var n atomic.Int32
	go func() {
		time.Sleep(20 * time.Millisecond)
		n.Store(1)
	}()
	checks := 0
	Eventually(t, "the flag", func() bool { checks++; return n.Load() == 1 })
	if checks < 2 {
		t.Fatalf("the condition held after %d checks, before it was set", checks)
	}
}

// fakeTB records a failure instead of ending the test.
type fakeTB struct {
	testing.TB
	failed string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.failed = format
	panic(f)
}

func TestWithinFailsAfterItsLimit(t *testing.T) {
	f := &fakeTB{TB: t}
	start := time.Now()
	func() {
		defer func() {
			if r := recover(); r != f {
				t.Fatalf("recovered %v", r)
			}
		}()
		Within(f, 50*time.Millisecond, "nothing", func() bool { return false })
	}()
	if f.failed != "timed out after %v waiting for %s" || time.Since(start) < 50*time.Millisecond {
		t.Fatalf("failed %q after %v", f.failed, time.Since(start))
	}
}

func TestUntilEndsWithTheConditionOrTheContext(t *testing.T) {
	checks := 0
	if err := Until(context.Background(), func() bool { checks++; return checks == 3 }); err != nil || checks != 3 {
		t.Fatalf("Until returned %v after %d checks, want nil after 3", err, checks)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := Until(ctx, func() bool { return false }); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Until on a condition that never holds returned %v", err)
	}
}
