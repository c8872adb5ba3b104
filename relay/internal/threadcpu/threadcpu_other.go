//go:build !linux

package threadcpu

import "testing"

// Measure runs loop; the thread's CPU time is measured on Linux only.
func Measure(_ *testing.B, loop func()) { loop() }
