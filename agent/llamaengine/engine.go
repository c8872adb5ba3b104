package llamaengine

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// NodeDir returns the directory of the engine's Node script and its npm
// packages in this source tree (agent/llamaengine/node), where
// `npm install` puts node_modules. It is found from this file's path at
// build time, so it is right for tests and for a binary built from the
// tree on the same machine.
func NodeDir() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "node"
	}
	return filepath.Join(filepath.Dir(file), "node")
}

// InstallHint is the command that installs the engine's npm packages.
const InstallHint = "npm install --prefix agent/llamaengine/node --omit=optional --ignore-scripts --no-package-lock"

// Available reports why engines cannot start from dir (empty: NodeDir()):
// node is not on PATH, or the npm packages are not installed there. nil
// means Start can run.
func Available(dir string) error {
	if dir == "" {
		dir = NodeDir()
	}
	if _, err := exec.LookPath("node"); err != nil {
		return fmt.Errorf("llamaengine: node is not installed (%w)", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "server.mjs")); err != nil {
		return fmt.Errorf("llamaengine: no server.mjs in %s", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "node-llama-cpp", "package.json")); err != nil {
		return fmt.Errorf("llamaengine: node-llama-cpp is not installed in %s (run %q)", dir, InstallHint)
	}
	return nil
}

// Config configures Start. The zero value of each field but Model means
// the default named after it.
type Config struct {
	// Model is the GGUF file to serve. Required.
	Model string
	// Name is the model name the engine serves and answers with. If
	// empty, the file's base name.
	Name string
	// Dir holds server.mjs and node_modules. If empty, NodeDir().
	Dir string
	// Parallel is the number of requests decoded together; more wait.
	// If zero, DefaultParallel.
	Parallel int
	// Context is each request's context in tokens. If zero,
	// DefaultRequestContext.
	Context int
	// Port to listen on at 127.0.0.1. If zero, any free port.
	Port int
	// Stderr receives the engine's own log. If nil, it is discarded.
	Stderr io.Writer
	// NoPromptCache evaluates every prompt whole. By default the engine
	// keeps a prompt cache as llama.cpp's server does: a request reuses
	// the longest prefix of its prompt a free sequence still holds, and
	// reports it as cached tokens.
	NoPromptCache bool
}

// Defaults for the zero values of Config.
const (
	DefaultParallel       = 2
	DefaultRequestContext = 2048
)

// Engine is a running llama.cpp engine process.
type Engine struct {
	// URL is the engine's base URL, http://127.0.0.1:PORT.
	URL string
	// Addr is its HOST:PORT.
	Addr string

	cmd  *exec.Cmd
	done chan struct{} // closed when the process was reaped
	once sync.Once
}

// Start starts an engine serving cfg.Model and returns once it listens.
// ctx bounds the start only (loading node-llama-cpp takes a few seconds);
// the engine runs until Close.
func Start(ctx context.Context, cfg Config) (*Engine, error) {
	if cfg.Model == "" {
		return nil, errors.New("llamaengine: Config.Model is required")
	}
	if cfg.Dir == "" {
		cfg.Dir = NodeDir()
	}
	if err := Available(cfg.Dir); err != nil {
		return nil, err
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = DefaultParallel
	}
	if cfg.Context <= 0 {
		cfg.Context = DefaultRequestContext
	}
	model, err := filepath.Abs(cfg.Model)
	if err != nil {
		return nil, err
	}
	args := []string{filepath.Join(cfg.Dir, "server.mjs"), "--model", model,
		"--port", strconv.Itoa(cfg.Port), "--parallel", strconv.Itoa(cfg.Parallel), "--ctx", strconv.Itoa(cfg.Context)}
	if cfg.Name != "" {
		args = append(args, "--name", cfg.Name)
	}
	if cfg.NoPromptCache {
		args = append(args, "--no-prompt-cache")
	}
	cmd := exec.Command("node", args...)
	cmd.Dir = cfg.Dir
	cmd.Stderr = cfg.Stderr
	// Its own process group, so that Close also ends anything it spawned.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("llamaengine: start node: %w", err)
	}
	e := &Engine{cmd: cmd, done: make(chan struct{})}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var l struct{ Listening string }
			if json.Unmarshal(sc.Bytes(), &l) == nil && l.Listening != "" {
				select {
				case ready <- l.Listening:
				default:
				}
			}
		}
		cmd.Wait()
		close(e.done)
	}()
	select {
	case addr := <-ready:
		e.Addr, e.URL = addr, "http://"+addr
		return e, nil
	case <-e.done:
		return nil, fmt.Errorf("llamaengine: engine exited before listening: %v", cmd.ProcessState)
	case <-ctx.Done():
		e.Close()
		return nil, fmt.Errorf("llamaengine: engine did not listen: %w", ctx.Err())
	}
}

// Close stops the engine (SIGTERM, then SIGKILL after 5 s) and waits for
// it to exit. It is safe to call more than once.
func (e *Engine) Close() error {
	e.once.Do(func() {
		pgid := -e.cmd.Process.Pid
		syscall.Kill(pgid, syscall.SIGTERM)
		select {
		case <-e.done:
		case <-time.After(5 * time.Second):
			syscall.Kill(pgid, syscall.SIGKILL)
			<-e.done
		}
	})
	return nil
}

// Kill ends the engine at once (SIGKILL), as a crash would, and waits for
// it to exit.
func (e *Engine) Kill() {
	e.once.Do(func() {
		syscall.Kill(-e.cmd.Process.Pid, syscall.SIGKILL)
		<-e.done
	})
}

// Done is closed when the engine's process has exited.
func (e *Engine) Done() <-chan struct{} { return e.done }
