//go:build unix

package scheduler

import (
	"syscall"
	"time"
)

// cpuTime is the process's CPU time. Benchmarks report it per operation as
// cpu-ns/op next to wall time, because on a shared, loaded machine wall time
// also counts the time the benchmark waited for a core.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
