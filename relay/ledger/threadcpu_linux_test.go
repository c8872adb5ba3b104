//go:build linux

package ledger

import (
	"runtime"
	"syscall"
	"testing"
	"time"
)

// threadCPU measures the CPU time of the calling goroutine's loop, locked
// to its thread: on a shared machine wall time also counts the waits for a
// core, and process time the flusher's work.
func threadCPU(b *testing.B, loop func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var ru0, ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_THREAD, &ru0)
	loop()
	_ = syscall.Getrusage(syscall.RUSAGE_THREAD, &ru1)
	cpu := time.Duration(ru1.Utime.Nano()-ru0.Utime.Nano()) + time.Duration(ru1.Stime.Nano()-ru0.Stime.Nano())
	b.ReportMetric(float64(cpu)/float64(b.N), "thread-cpu-ns/op")
}
