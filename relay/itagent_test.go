package relay_test

import (
	"context"
	"net/http"
	"net/http/httputil"
	"net/url"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/multiformats/go-multiaddr"

	"github.com/computeflux/computeflux/transport"
)

// itAgent is an agent for the integration tests, built from the transport
// primitives: a host that joins the relay and serves inference streams from
// the relay only, proxied to its engine.
type itAgent struct {
	h    host.Host
	m    *transport.Membership
	srv  interface{ Close() error }
	dead bool
}

func startAgent(t testing.TB, rl *itRelay, name string, e *itEngine) *itAgent {
	t.Helper()
	h := newHost(t)
	u, _ := url.Parse(e.srv.URL)
	proxy := httputil.NewSingleHostReverseProxy(u)
	proxy.FlushInterval = -1
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	proxy.Transport = tr
	relayID := rl.r.Host().ID()
	srv, err := transport.ServeHTTP(h, proxy, func(p peer.ID) bool { return p == relayID })
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Connect(context.Background(), rl.info()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, err := transport.Join(ctx, h, relayID, []byte(itToken), transport.JoinInfo{Name: name, Models: e.models})
	if err != nil {
		t.Fatal(err)
	}
	a := &itAgent{h: h, m: m, srv: srv}
	t.Cleanup(func() {
		_ = m.Close()
		_ = srv.Close()
		tr.CloseIdleConnections()
	})
	return a
}

func (a *itAgent) id() peer.ID                   { return a.h.ID() }
func (a *itAgent) addrs() []multiaddr.Multiaddr { return a.h.Addrs() }

// kill closes the agent's host without leaving first.
func (a *itAgent) kill() {
	_ = a.srv.Close()
	_ = a.h.Close()
}
