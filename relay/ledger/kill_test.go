package ledger

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The SIGKILL test runs the test binary again as a child that records and
// flushes through a real ledger file until it is killed.

const (
	childEnv      = "LEDGER_KILL_CHILD" // the file the child records into
	killInterval  = 200 * time.Millisecond
	killPace      = time.Millisecond // one request per pace
	childMaxAlive = 30 * time.Second // a child the test forgot dies by itself
)

// runChild records request i with i prompt tokens, one per killPace, and
// prints "R <recorded> <unix ns>" every 10 ms and "F <flushed> <unix ns>"
// after every flush.
func runChild() int {
	l, err := Open(Config{Path: os.Getenv(childEnv), FlushInterval: killInterval})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if h := l.Health(); !h.OK {
		fmt.Fprintln(os.Stderr, h.Error)
		return 1
	}
	out := bufio.NewWriter(os.Stdout)
	start := time.Now()
	var flushed uint64
	lastR := start
	for i := int64(1); time.Since(start) < childMaxAlive; i++ {
		if d := time.Until(start.Add(time.Duration(i) * killPace)); d > 0 {
			time.Sleep(d) // pacing the load, not waiting for a condition
		}
		l.Record(Entry{Time: time.Now(), Client: "c", Model: "m", Agent: "a", PromptTokens: i})
		now := time.Now()
		if f := l.Health().FlushedRequests; f != flushed {
			flushed = f
			fmt.Fprintf(out, "F %d %d\n", f, now.UnixNano())
		}
		if now.Sub(lastR) >= 10*time.Millisecond {
			lastR = now
			fmt.Fprintf(out, "R %d %d\n", i, now.UnixNano())
		}
		_ = out.Flush()
	}
	return 0
}

type childLine struct {
	kind string
	n    int64
	at   time.Time
}

// A SIGKILL at a random moment: the file holds exactly the first T
// requests (no batch twice, none in part), at least every request the
// child saw flushed, and loses at most about one flush interval of
// requests (one interval plus the commit in flight); a restart continues
// the totals.
func TestSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("runs child processes for a few seconds")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	for round := range 3 {
		path := filepath.Join(t.TempDir(), "ledger.db")
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"="+path)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		lines := make(chan childLine, 1024)
		go func() {
			defer close(lines)
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				if len(f) != 3 {
					continue
				}
				n, _ := strconv.ParseInt(f[1], 10, 64)
				ns, _ := strconv.ParseInt(f[2], 10, 64)
				lines <- childLine{f[0], n, time.Unix(0, ns)}
			}
		}()
		// Kill it at a random moment between 1 s after its first report
		// and one flush interval later: a moment that owes nothing to its
		// flushes.
		var lastF, lastR childLine
		flushes := 0
		deadline := time.After(10 * time.Second)
		var killAt <-chan time.Time
		var killed time.Time
		armed := false
	wait:
		for {
			select {
			case ln, ok := <-lines:
				if !ok {
					break wait
				}
				switch ln.kind {
				case "F":
					lastF = ln
					flushes++
				case "R":
					lastR = ln
					if !armed {
						armed = true
						killAt = time.After(time.Second + time.Duration(rng.Int64N(int64(killInterval))))
					}
				}
			case <-killAt:
				killed = time.Now()
				_ = cmd.Process.Signal(syscall.SIGKILL)
				killAt = nil
			case <-deadline:
				_ = cmd.Process.Kill()
				t.Fatalf("round %d: the child flushed %d times in 10 s (interval %v)", round, flushes, killInterval)
			}
		}
		_ = cmd.Wait()
		if killed.IsZero() {
			t.Fatalf("round %d: the child ended by itself", round)
		}
		if flushes < 3 {
			t.Fatalf("round %d: %d flushes reported in over 1 s at an interval of %v", round, flushes, killInterval)
		}
		// What the file holds.
		bs, err := OpenBolt(path, 100, 0)
		if err != nil {
			t.Fatal(err)
		}
		var reqs, prompt int64
		if err := bs.Scan(Hourly, 0, 1<<32, func(r Row) {
			if r.Kind == KindClient {
				reqs += r.Requests
				prompt += r.PromptTokens
			}
		}); err != nil {
			t.Fatal(err)
		}
		_ = bs.Close()
		// Recorded at the kill: the last report plus the pace since.
		recordedAtKill := lastR.n + int64(killed.Sub(lastR.at)/killPace)
		lost := recordedAtKill - reqs
		t.Logf("round %d: killed %v after the last flush; file holds %d requests, child reported %d flushed, ~%d recorded at the kill: lost %d (%v of requests; interval %v)",
			round, killed.Sub(lastF.at).Round(time.Millisecond), reqs, lastF.n, recordedAtKill, lost, time.Duration(lost)*killPace, killInterval)
		if prompt != reqs*(reqs+1)/2 {
			t.Fatalf("round %d: %d requests with %d prompt tokens: not exactly requests 1..%d (a batch twice or in part)", round, reqs, prompt, reqs)
		}
		if reqs < lastF.n {
			t.Fatalf("round %d: the file holds %d requests, the child saw %d flushed", round, reqs, lastF.n)
		}
		// What a kill can lose: the requests since the last flush took its
		// deltas, one interval plus the commit in flight (an fsync, slow on
		// a busy disk). Bounded at two intervals: room for a busy
		// machine, not 10x.
		if bound := int64(2 * killInterval / killPace); lost > bound {
			t.Fatalf("round %d: lost %d requests, more than 2 flush intervals (%d)", round, lost, bound)
		}
		// A restart continues the totals.
		c := newClock(time.Now().UTC().Format(time.RFC3339Nano))
		l := open(t, Config{Path: path}, c)
		l.Record(Entry{Time: c.Now(), Client: "c", Model: "m", PromptTokens: 1})
		r := mustUsage(t, l, c.Now().Add(-time.Hour), ByClient)
		if r.Total.Requests != reqs+1 {
			t.Fatalf("round %d: after the restart %d requests, want %d", round, r.Total.Requests, reqs+1)
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
