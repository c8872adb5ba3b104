package relay

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// watchdog is an attempt's one timer. Until the first response byte it
// bounds the wait with Config.TTFBTimeout; from the first byte on it bounds
// each pause between two reads with Config.IdleTimeout. A read only records
// its time (touch): when the timer fires before the pause is long enough it
// re-arms itself for the rest of it. An attempt used to take three timers
// (first byte, the check of a non-streamed answer, the stream's copy) and
// reset one on every read, a visible cost on a busy relay.
//
// Watchdogs and their timers are reused (watchdogPool): one goes back to
// its pool only when no call of fire can still come for it, that is when stop
// stopped a timer armed by this attempt alone (Stop true) and the timer
// never went off during the attempt (spent false). A fire that went off
// taints it, through Reset's result or in fire itself, both under mu.
//
// An attempt holds its watchdog through a wdRef, which stop ends: a
// stop through the ref of an earlier attempt, whose watchdog went back to
// the pool and out again to another attempt, does nothing.
type watchdog struct {
	cancel context.CancelCauseFunc
	idle   time.Duration
	start  time.Time    // base of last (monotonic)
	last   atomic.Int64 // the last read, as time since start (idle phase)
	phase  atomic.Int32 // wdFirstByte, ...: the first to move it decides

	pool  *watchdogPool
	mu    sync.Mutex // orders Reset against Stop, so that a stopped watchdog stays stopped
	t     *time.Timer
	spent bool // the timer went off during this attempt: not to be reused

	gen atomic.Uint64 // the attempts it went back to the pool after
}

// wdRef is an attempt's hold on a watchdog: the watchdog and its
// generation when the attempt took it.
type wdRef struct {
	d   *watchdog
	gen uint64
}

// firstByte is watchdog.firstByte.
func (r wdRef) firstByte() bool { return r.d.firstByte() }

// touch is watchdog.touch.
func (r wdRef) touch() { r.d.touch() }

// stop ends the attempt's watchdog; it may be called more than once, also
// after the watchdog was given to another attempt, and the attempt uses r
// no more after it.
func (r wdRef) stop() { r.d.stop(r.gen) }

// watchdogPool holds stopped watchdogs whose timer can fire no more. Each
// Relay has its own, so that timers stay with the relay that made them
// (a testing/synctest bubble's timers cannot be reset from outside it).
type watchdogPool struct{ p sync.Pool }

// Phases of a watchdog.
const (
	wdFirstByte int32 = iota // waiting for the first byte
	wdIdle                   // the first byte came: bounding pauses
	wdExpired                // fired: the attempt is cancelled
	wdStopped                // the attempt is over
)

// get arms a watchdog that cancels with ErrTTFBTimeout unless
// firstByte is called within ttfb, then with ErrIdleTimeout once touch
// was not called for idle.
func (p *watchdogPool) get(ttfb, idle time.Duration, cancel context.CancelCauseFunc) wdRef {
	d, _ := p.p.Get().(*watchdog)
	if d == nil {
		d = &watchdog{pool: p}
	}
	d.cancel, d.idle, d.start = cancel, idle, time.Now()
	d.last.Store(0)
	d.phase.Store(wdFirstByte)
	d.mu.Lock()
	d.spent = false
	if d.t == nil {
		d.t = time.AfterFunc(ttfb, d.fire)
	} else {
		d.t.Reset(ttfb) // stopped when pooled: no fire is pending
	}
	d.mu.Unlock()
	return wdRef{d, d.gen.Load()}
}

// firstByte records the first response byte and reports whether it came in
// time: false if the TTFB bound fired first (the attempt is cancelled, or
// about to be).
func (d *watchdog) firstByte() bool {
	d.touch() // before the phase moves: fire reads it in the idle phase
	if !d.phase.CompareAndSwap(wdFirstByte, wdIdle) {
		return false
	}
	d.mu.Lock()
	if d.phase.Load() == wdIdle && !d.t.Reset(d.idle) {
		// The TTFB bound went off as the byte came: its fire, lost to
		// this call, may still run.
		d.spent = true
	}
	d.mu.Unlock()
	return true
}

// touch records a read.
func (d *watchdog) touch() {
	d.last.Store(int64(time.Since(d.start)))
}

// stop ends the watchdog of the attempt that took it at generation gen.
// Once the watchdog went back to the pool, a later stop of that attempt
// (gen no longer current) leaves it to whichever attempt holds it now.
func (d *watchdog) stop(gen uint64) {
	if d.gen.Load() != gen || d.phase.Swap(wdStopped) == wdStopped {
		return
	}
	d.mu.Lock()
	reuse := d.t.Stop() && !d.spent
	d.mu.Unlock()
	if reuse {
		d.cancel = nil
		d.gen.Add(1) // before Put: this attempt's stops end here
		d.pool.p.Put(d)
	}
}

// fire runs when the timer goes off.
func (d *watchdog) fire() {
	switch d.phase.Load() {
	case wdFirstByte:
		// Lost to firstByte: it re-arms the timer for the idle bound.
		if d.phase.CompareAndSwap(wdFirstByte, wdExpired) {
			d.cancel(ErrTTFBTimeout)
		}
	case wdIdle:
		paused := time.Since(d.start) - time.Duration(d.last.Load())
		if paused < d.idle {
			d.mu.Lock()
			d.spent = true
			if d.phase.Load() == wdIdle {
				d.t.Reset(d.idle - paused)
			}
			d.mu.Unlock()
			return
		}
		if d.phase.CompareAndSwap(wdIdle, wdExpired) {
			d.cancel(ErrIdleTimeout)
		}
	}
}
