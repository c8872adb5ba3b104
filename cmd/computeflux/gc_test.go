package main

import (
	"runtime/debug"
	"testing"
)

func TestTuneGCKeepsGOGC(t *testing.T) {
	old := debug.SetGCPercent(100)
	defer debug.SetGCPercent(old)
	tuneGC(func(k string) (string, bool) { return "50", k == "GOGC" })
	if got := debug.SetGCPercent(100); got != 100 {
		t.Fatalf("GOGC set: percent %d, want it left at 100", got)
	}
	tuneGC(func(string) (string, bool) { return "", false })
	if got := debug.SetGCPercent(100); got != serverGCPercent {
		t.Fatalf("GOGC unset: percent %d, want %d", got, serverGCPercent)
	}
}
