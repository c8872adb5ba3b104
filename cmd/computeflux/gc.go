package main

import (
	"runtime/debug"
)

// serverGCPercent is the GC target of the long-running relay and agent
// when GOGC is not set. Their live heap is a few MB, below the runtime's 4
// MB minimum target, so at GOGC=100 a busy relay collected every few hundred
// requests and spent about a tenth of its CPU on GC and allocation assists.
// At 400 the heap may grow to about five times the live data (tens of MB)
// and collections are a quarter as frequent. GOGC, when set, wins.
const serverGCPercent = 400

// tuneGC applies serverGCPercent unless the environment sets GOGC.
func tuneGC(lookupEnv func(string) (string, bool)) {
	if _, ok := lookupEnv("GOGC"); ok {
		return
	}
	debug.SetGCPercent(serverGCPercent)
}
