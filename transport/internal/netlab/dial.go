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
// for its whole life. Each dial therefore runs on a fresh goroutine locked to
// its OS thread, which enters ns, creates and connects the socket, and exits
// still locked, so that the runtime ends the thread instead of reusing it in
// the wrong namespace. Addresses must be IP literals: a name lookup could
// run on another thread.
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
			// No UnlockOSThread: the thread must die with this goroutine.
			fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				ch <- result{err: fmt.Errorf("netlab: open %s: %w", path, err)}
				return
			}
			err = unix.Setns(fd, unix.CLONE_NEWNET)
			_ = unix.Close(fd)
			if err != nil {
				ch <- result{err: fmt.Errorf("netlab: enter %s: %w", ns, err)}
				return
			}
			var d net.Dialer
			c, err := d.DialContext(ctx, network, addr)
			ch <- result{c, err}
		}()
		r := <-ch
		return r.c, r.err
	}
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
