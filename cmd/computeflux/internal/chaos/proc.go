package chaos

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// logLine is one JSON log line of a child process, with when it was read.
type logLine struct {
	at     time.Time
	fields map[string]any
}

func (l logLine) str(k string) string {
	s, _ := l.fields[k].(string)
	return s
}

// proc is one child process of the binary, its JSON logs on stderr read
// line by line.
type proc struct {
	name string
	cmd  *exec.Cmd
	keep func(logLine) bool
	done chan struct{} // closed when the process was reaped
	// ended is set when we stop or kill the process: an exit without it
	// is the process's own doing.
	ended atomic.Bool
	err   error // Wait's error, set before done closes

	mu     sync.Mutex // guards the following fields
	lines  []logLine
	subs   []chan logLine
	raw    []string // lines that are not JSON, the last maxRaw
	panics []string // lines that report a panic, the first maxPanics
}

const (
	maxRaw    = 256
	maxPanics = 64
)

// panicMessage is the message of the log line transport.ServerLog writes
// for a panic net/http recovered.
const panicMessage = "recovered a panic serving a request"

// procOptions are start's optional settings.
type procOptions struct {
	// Echo receives the process's output lines, prefixed with its name.
	Echo io.Writer
	// Env is added to the environment.
	Env []string
	// Keep, if set, says which JSON lines to keep for logs and waitLog;
	// lines reporting a panic are noted whatever it says.
	Keep func(logLine) bool
}

// startWith runs bin with args; its stdout and stderr (JSON logs) are read
// into the proc, and copied to opts.Echo when not nil.
func startWith(name, bin string, opts procOptions, args ...string) (*proc, error) {
	echo := opts.Echo
	cmd := exec.Command(bin, args...)
	cmd.Env = append(childEnv(), opts.Env...)
	out, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = cmd.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("chaos: start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, keep: opts.Keep, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			b := sc.Bytes()
			if echo != nil {
				fmt.Fprintf(echo, "%s: %s\n", name, b)
			}
			var f map[string]any
			if json.Unmarshal(b, &f) != nil {
				p.addRaw(string(b))
				continue
			}
			p.add(logLine{at: time.Now(), fields: f})
		}
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// childEnv is our environment without COMPUTEFLUX_* variables, which would
// set the children's flags.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPUTEFLUX_") {
			env = append(env, kv)
		}
	}
	return env
}

// addRaw records a line that is not JSON: a crash's "panic: ..." and
// "fatal error: ...", or net/http's own "http: panic serving ..." from a
// server without an ErrorLog, are panics.
func (p *proc) addRaw(s string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if strings.HasPrefix(s, "panic: ") || strings.HasPrefix(s, "fatal error: ") || strings.Contains(s, ": panic serving ") {
		p.notePanicLocked(s)
	}
	if len(p.raw) == maxRaw {
		p.raw = p.raw[1:]
	}
	p.raw = append(p.raw, s)
}

func (p *proc) notePanicLocked(s string) {
	if len(p.panics) < maxPanics {
		p.panics = append(p.panics, s)
	}
}

func (p *proc) add(l logLine) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if l.str("message") == panicMessage {
		p.notePanicLocked(fmt.Sprintf("%s: %v (%v)", panicMessage, l.fields["panic"], l.fields["remote"]))
	}
	if p.keep != nil && !p.keep(l) {
		return
	}
	p.lines = append(p.lines, l)
	for _, c := range p.subs {
		select {
		case c <- l:
		default:
		}
	}
}

// waitLog waits up to d for a log line (past or future) that match
// accepts.
func (p *proc) waitLog(d time.Duration, match func(logLine) bool) (logLine, error) {
	c := make(chan logLine, 256)
	p.mu.Lock()
	for _, l := range p.lines {
		if match(l) {
			p.mu.Unlock()
			return l, nil
		}
	}
	p.subs = append(p.subs, c)
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		for i, s := range p.subs {
			if s == c {
				p.subs = append(p.subs[:i], p.subs[i+1:]...)
				break
			}
		}
		p.mu.Unlock()
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case l := <-c:
			if match(l) {
				return l, nil
			}
		case <-p.done:
			return logLine{}, fmt.Errorf("chaos: %s exited (%v) before the expected log line", p.name, p.err)
		case <-t.C:
			return logLine{}, fmt.Errorf("chaos: %s: no expected log line within %v", p.name, d)
		}
	}
}

// rawLines returns the last lines read that were not JSON.
func (p *proc) rawLines() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.raw...)
}

// panicked returns the lines read so far that report a panic.
func (p *proc) panicked() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.panics...)
}

// exitedAlone reports whether the process ended without being stopped or
// killed, and Wait's error.
func (p *proc) exitedAlone() (bool, error) {
	select {
	case <-p.done:
		return !p.ended.Load(), p.err
	default:
		return false, nil
	}
}

// logs returns the lines read so far.
func (p *proc) logs() []logLine {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]logLine(nil), p.lines...)
}

func (p *proc) signal(s syscall.Signal) error { return p.cmd.Process.Signal(s) }

// stop ends the process: SIGCONT (should it be stopped), SIGTERM, and
// SIGKILL after grace.
func (p *proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	p.ended.Store(true)
	_ = p.signal(syscall.SIGCONT)
	_ = p.signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.signal(syscall.SIGKILL)
		<-p.done
	}
}

// kill sends SIGKILL and reaps the process.
func (p *proc) kill() {
	p.ended.Store(true)
	_ = p.signal(syscall.SIGKILL)
	<-p.done
}
