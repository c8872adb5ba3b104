//go:build linux

package threadcpu

import (
	"runtime"
	"syscall"
	"testing"
	"time"
)

// Measure runs loop locked to its thread and reports the thread's CPU
// time per b.N as "thread-cpu-ns/op": on a shared machine wall time also
// counts the waits for a core, and process time other goroutines' work.
func Measure(b *testing.B, loop func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var ru0, ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_THREAD, &ru0)
	loop()
	_ = syscall.Getrusage(syscall.RUSAGE_THREAD, &ru1)
	cpu := time.Duration(ru1.Utime.Nano()-ru0.Utime.Nano()) + time.Duration(ru1.Stime.Nano()-ru0.Stime.Nano())
	b.ReportMetric(float64(cpu)/float64(b.N), "thread-cpu-ns/op")
}
