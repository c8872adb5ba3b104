package relay

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(memberlistWaiter{m})
}

// memberlistWaiter runs the tests, then waits (up to 30 s) until no
// memberlist goroutine is left: memberlist's Shutdown does not wait for a
// probe in progress, and tests that run in parallel cannot each wait for
// the whole process's memberlists to stop, so goleak checks once, after
// this.
type memberlistWaiter struct{ m *testing.M }

func (w memberlistWaiter) Run() int {
	code := w.m.Run()
	buf := make([]byte, 4<<20)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		n := runtime.Stack(buf, true)
		if !bytes.Contains(buf[:n], []byte("hashicorp/memberlist.(*Memberlist)")) {
			return code
		}
		if time.Now().After(deadline) {
			fmt.Fprintln(os.Stderr, "memberlist goroutines still running 30 s after the tests ended")
			return 1
		}
	}
}
