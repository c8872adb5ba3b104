//go:build !linux

package ledger

import "testing"

// threadCPU runs loop; the thread's CPU time is measured on Linux only.
func threadCPU(_ *testing.B, loop func()) { loop() }
