package relay_test

import (
	"context"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/transport"
)

// itAgent is an agent for the integration tests, built from the transport
// primitives: a host that joins the relay (and joins again whenever the
// registration ends) and serves inference streams from the relay only,
// proxied to its engine.
type itAgent struct {
	h     host.Host
	srv   interface{ Close() error }
	stopc chan struct{}
	wg    sync.WaitGroup

	mu sync.Mutex // guards m
	m  *transport.Membership
}

func startAgent(t testing.TB, rl *relaytest.Relay, name string, e *relaytest.FakeEngine) *itAgent {
	t.Helper()
	h := newHost(t)
	u, _ := url.Parse(e.URL())
	proxy := httputil.NewSingleHostReverseProxy(u)
	proxy.FlushInterval = -1
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	proxy.Transport = tr
	relayInfo := rl.Info()
	srv, err := transport.ServeHTTP(h, proxy, func(p peer.ID) bool { return p == relayInfo.ID })
	if err != nil {
		t.Fatal(err)
	}
	a := &itAgent{h: h, srv: srv, stopc: make(chan struct{})}
	info := transport.JoinInfo{Name: name, Models: e.Models}
	if err := a.join(relayInfo, info); err != nil {
		t.Fatal(err)
	}
	a.wg.Add(1)
	go a.keepJoined(relayInfo, info)
	t.Cleanup(func() {
		a.stop()
		_ = srv.Close()
		tr.CloseIdleConnections()
	})
	return a
}

func (a *itAgent) join(relay peer.AddrInfo, info transport.JoinInfo) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.h.Connect(ctx, relay); err != nil {
		return err
	}
	m, err := transport.Join(ctx, a.h, relay.ID, []byte(itToken), info)
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.m = m
	a.mu.Unlock()
	return nil
}

// keepJoined joins again, with a short capped backoff, whenever the
// registration ends, until stop.
func (a *itAgent) keepJoined(relay peer.AddrInfo, info transport.JoinInfo) {
	defer a.wg.Done()
	for {
		a.mu.Lock()
		m := a.m
		a.mu.Unlock()
		select {
		case <-a.stopc:
			return
		case <-m.Done():
		}
		backoff := 20 * time.Millisecond
		for a.join(relay, info) != nil {
			select {
			case <-a.stopc:
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, time.Second)
		}
	}
}

func (a *itAgent) stop() {
	select {
	case <-a.stopc:
		return
	default:
	}
	close(a.stopc)
	a.wg.Wait()
	a.mu.Lock()
	_ = a.m.Close()
	a.mu.Unlock()
}

// kill closes the agent's host without leaving first.
func (a *itAgent) kill() {
	a.stop()
	_ = a.srv.Close()
	_ = a.h.Close()
}

// update sends new info over the agent's registration.
func (a *itAgent) update(info transport.JoinInfo) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.m.Update(info)
}
