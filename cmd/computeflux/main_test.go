package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestMain points the user's directories at a temporary one, so that no
// test writes the files a relay or an agent keeps by default (identities,
// the usage ledger) into the home of whoever runs the tests, and fails the
// run if goroutines are left. The demo's agents run
// memberlist, whose Shutdown does not wait for a probe already under way:
// that goroutine ends by itself within a probe interval, so the check
// allows a few seconds before it calls anything a leak.
func TestMain(m *testing.M) {
	home, err := os.MkdirTemp("", "computeflux-cmd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Setenv("XDG_CONFIG_HOME", filepath.Join(home, "config"))
	os.Unsetenv("STATE_DIRECTORY")
	code := m.Run()
	os.RemoveAll(home)
	if code == 0 {
		deadline := time.Now().Add(5 * time.Second)
		for {
			err := goleak.Find()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				fmt.Fprintf(os.Stderr, "goleak: goroutines left after the tests: %v\n", err)
				code = 1
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	os.Exit(code)
}
