package netlab

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// netnsDir is where `ip netns add` keeps the namespace handles.
const netnsDir = "/run/netns"

// DialContext returns a dial function whose sockets live in namespace ns,
// while the calling process stays where it is: a controller on the host
// talks to the relay from the client namespace without a helper process.
//
// A socket belongs to the network namespace of the thread that created it,
// for its whole life. Each dial therefore runs on a goroutine locked to its
// OS thread, which enters ns, creates and connects the socket, and returns to
// the thread's own namespace before unlocking. The thread must not simply
// exit instead: processes started by Lab.Start get SIGKILL when the thread
// that forked them ends (Pdeathsig is per thread), and that thread may be
// this one. Only if the way back fails is the thread left locked, so that
// the runtime ends it rather than reuse it in the wrong namespace. Addresses
// must be IP literals: a name lookup could run on another thread.
func (l *Lab) DialContext(ns string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	path := filepath.Join(netnsDir, ns)
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		type result struct {
			c   net.Conn
			err error
		}
		ch := make(chan result, 1)
		go func() {
			runtime.LockOSThread()
			c, back, err := dialInNS(ctx, path, network, addr)
			if back {
				runtime.UnlockOSThread()
			}
			ch <- result{c, err}
		}()
		r := <-ch
		return r.c, r.err
	}
}

// dialInNS dials from namespace path on the current (locked) thread and
// reports whether the thread is back in its own namespace.
func dialInNS(ctx context.Context, path, network, addr string) (c net.Conn, back bool, err error) {
	self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, true, fmt.Errorf("netlab: own namespace: %w", err)
	}
	defer unix.Close(self)
	target, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, true, fmt.Errorf("netlab: open %s: %w", path, err)
	}
	defer unix.Close(target)
	if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
		return nil, true, fmt.Errorf("netlab: enter %s: %w", path, err)
	}
	var d net.Dialer
	c, err = d.DialContext(ctx, network, addr)
	if e := unix.Setns(self, unix.CLONE_NEWNET); e != nil {
		return c, false, err
	}
	return c, true, err
}

// HTTPClient returns an HTTP client whose connections start in namespace ns
// (see DialContext). Close its idle connections when done with it
// (CloseIdleConnections), so that no connection outlives the lab.
func (l *Lab) HTTPClient(ns string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:           l.DialContext(ns),
		MaxIdleConnsPerHost:   16,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: time.Minute,
	}}
}
