package relay

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// TestWatchdog checks each bound of an attempt's one timer in fake time.
func TestWatchdog(t *testing.T) {
	const ttfb, idle = 10 * time.Second, 3 * time.Second
	// run starts a watchdog, lets steps run against it and returns the
	// cause the attempt was cancelled with (nil if none) and when.
	run := func(t *testing.T, steps func(d wdRef)) (after time.Duration, cause error) {
		var got error
		var at time.Duration
		synctest.Test(t, func(t *testing.T) {
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			start := time.Now()
			stop := context.AfterFunc(ctx, func() { at = time.Since(start) })
			defer stop()
			var pool watchdogPool // of this bubble
			d := pool.get(ttfb, idle, cancel)
			steps(d)
			time.Sleep(time.Minute) // whatever is armed fires
			synctest.Wait()
			got = context.Cause(ctx)
			d.stop()
		})
		return at, got
	}
	t.Run("no first byte", func(t *testing.T) {
		at, cause := run(t, func(wdRef) {})
		if cause != ErrTTFBTimeout || at != ttfb {
			t.Fatalf("cause %v after %v, want %v after %v", cause, at, ErrTTFBTimeout, ttfb)
		}
	})
	t.Run("first byte late", func(t *testing.T) {
		_, cause := run(t, func(d wdRef) {
			time.Sleep(ttfb + time.Second)
			if d.firstByte() {
				t.Error("firstByte after the bound reported in time")
			}
		})
		if cause != ErrTTFBTimeout {
			t.Fatalf("cause %v, want %v", cause, ErrTTFBTimeout)
		}
	})
	t.Run("reads keep it alive, then a pause", func(t *testing.T) {
		at, cause := run(t, func(d wdRef) {
			time.Sleep(ttfb - time.Second)
			if !d.firstByte() {
				t.Error("firstByte in time reported late")
			}
			for range 10 { // 10 reads 2s apart: each pause under the bound
				time.Sleep(2 * time.Second)
				d.touch()
			}
		})
		if want := ttfb - time.Second + 20*time.Second + idle; cause != ErrIdleTimeout || at != want {
			t.Fatalf("cause %v after %v, want %v after %v", cause, at, ErrIdleTimeout, want)
		}
	})
	t.Run("pause right after the first byte", func(t *testing.T) {
		at, cause := run(t, func(d wdRef) {
			time.Sleep(time.Second)
			d.firstByte()
		})
		if cause != ErrIdleTimeout || at != time.Second+idle {
			t.Fatalf("cause %v after %v, want %v after %v", cause, at, ErrIdleTimeout, time.Second+idle)
		}
	})
	t.Run("stopped", func(t *testing.T) {
		for _, first := range []bool{false, true} {
			_, cause := run(t, func(d wdRef) {
				if first {
					d.firstByte()
					time.Sleep(2 * time.Second)
					d.touch()
				}
				d.stop()
				d.stop()
			})
			if cause != nil {
				t.Fatalf("first byte %v: cancelled with %v after stop", first, cause)
			}
		}
	})
}

// TestWatchdogStaleStop stops a watchdog twice as an attempt does (once
// its body is read, again on return) with another attempt taking a
// watchdog from the pool in between: the second stop must leave the other
// attempt's bounds alone.
func TestWatchdogStaleStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const bound = time.Second
		var pool watchdogPool // of this bubble
		reused := 0           // rounds where b was given a's watchdog
		for i := range 20 {
			ctxA, cancelA := context.WithCancelCause(context.Background())
			a := pool.get(bound, bound, cancelA)
			a.firstByte()
			a.stop() // the body is read
			ctxB, cancelB := context.WithCancelCause(context.Background())
			b := pool.get(bound, bound, cancelB) // most often given a's watchdog
			if b.d == a.d {
				reused++
			}
			a.stop() // a's deferred stop
			if !b.firstByte() {
				t.Fatalf("round %d: a first byte in time reported late after another attempt's second stop", i)
			}
			time.Sleep(2 * bound)
			synctest.Wait()
			if cause := context.Cause(ctxB); cause != ErrIdleTimeout {
				t.Fatalf("round %d: paused attempt cancelled with %v, want %v", i, cause, ErrIdleTimeout)
			}
			if cause := context.Cause(ctxA); cause != nil {
				t.Fatalf("round %d: stopped attempt cancelled with %v", i, cause)
			}
			b.stop()
			cancelA(nil)
			cancelB(nil)
		}
		if reused == 0 {
			t.Fatal("no round reused the stopped watchdog: the stale stop was never tried")
		}
	})
}

// TestWatchdogReuse races first bytes against short TTFB bounds on reused
// watchdogs: a fire left over from one attempt must never reach another,
// so no attempt times out before its bound, and none in time is cancelled.
func TestWatchdogReuse(t *testing.T) {
	var (
		wg   sync.WaitGroup
		pool watchdogPool
	)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(g), 1))
			for range 3000 {
				ctx, cancel := context.WithCancelCause(context.Background())
				ttfb := time.Duration(rnd.IntN(60)) * time.Microsecond
				start := time.Now()
				d := pool.get(ttfb, time.Hour, cancel)
				if n := rnd.IntN(80); n > 0 {
					time.Sleep(time.Duration(n) * time.Microsecond)
				}
				ok := d.firstByte()
				elapsed := time.Since(start)
				if !ok && elapsed < ttfb {
					t.Errorf("timed out after %v, bound %v", elapsed, ttfb)
				}
				if rnd.IntN(4) == 0 {
					d.touch()
				}
				time.Sleep(time.Duration(rnd.IntN(20)) * time.Microsecond)
				cause := context.Cause(ctx)
				d.stop()
				if ok && cause != nil {
					t.Errorf("attempt in time cancelled with %v", cause)
				}
				if !ok {
					<-ctx.Done() // the fire that won may still be on its way to cancel
					cause = context.Cause(ctx)
				}
				if !ok && cause != ErrTTFBTimeout {
					t.Errorf("late attempt cancelled with %v", cause)
				}
				cancel(nil)
			}
		}()
	}
	wg.Wait()
}

func BenchmarkWatchdog(b *testing.B) {
	_, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	var pool watchdogPool
	b.ReportAllocs()
	for b.Loop() {
		d := pool.get(time.Minute, time.Minute, cancel)
		d.firstByte()
		d.touch()
		d.touch()
		d.stop()
	}
}
