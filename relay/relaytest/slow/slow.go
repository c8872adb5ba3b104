// Package slow gates the test suites that take minutes: real processes,
// headless browsers, Node clients, network namespaces, load that runs for
// its duration. `go test ./...` leaves them out so that a developer's run
// ends in a few minutes; COMPUTEFLUX_SLOW_TESTS=1 lets them in, and CI
// (.ci/run) always sets it, so every test still runs there.
package slow

import (
	"os"
	"testing"
)

// Env is the environment variable that lets the slow tests run.
const Env = "COMPUTEFLUX_SLOW_TESTS"

// Enabled reports whether the slow tests run: Env is 1 and -short is off.
func Enabled() bool {
	return os.Getenv(Env) == "1" && !testing.Short()
}

// Gate skips t unless the slow tests run, naming what it would have run.
func Gate(t testing.TB, what string) {
	t.Helper()
	if !Enabled() {
		t.Skipf("slow test (%s): set %s=1 to run it, as CI does", what, Env)
	}
}
