package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/computeflux/computeflux/agent"
	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/scheduler"
)

// liveRelays is the live cluster of Config.Relays: that many real relays
// over QUIC on loopback, each engine's agent (package agent) joined to
// every relay; the relays find each other through the agents and share
// session bindings. Gossip is off, as in the one-relay cluster.
type liveRelays struct {
	dir     string
	relays  []*relay.Relay
	urls    []string
	stopRel []context.CancelFunc
	relDone []chan error
	stopEng []context.CancelFunc
	engDone []chan error
	stopAg  []context.CancelFunc
	agDone  []chan error
	started time.Time
}

const liveRelaysKey = "sk-cf-bench-relays"

func startLiveRelays(ctx context.Context, cfg *Config, p scheduler.Policy) (lr *liveRelays, err error) {
	dir, err := os.MkdirTemp("", "computeflux-bench-relays-")
	if err != nil {
		return nil, err
	}
	lr = &liveRelays{dir: dir}
	defer func() {
		if err != nil {
			lr.Close()
		}
	}()
	token := []byte(fmt.Sprintf("bench-%016x", rand.Uint64()))
	var addrs []string
	for i := range cfg.Relays {
		r, err := relay.New(relay.Config{
			P2PListen:       []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
			IdentityFile:    filepath.Join(dir, fmt.Sprintf("relay-%d.key", i)),
			Token:           token,
			APIKeys:         []string{liveRelaysKey},
			Policy:          p,
			Scheduler:       cfg.Scheduler,
			MaxAttempts:     cfg.MaxAttempts,
			ShutdownTimeout: time.Second,
			Gossip:          relay.GossipConfig{Disabled: true},
		})
		if err != nil {
			return nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			_ = r.Close()
			return nil, err
		}
		rctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Serve(rctx, ln) }()
		lr.relays = append(lr.relays, r)
		lr.urls = append(lr.urls, "http://"+ln.Addr().String())
		lr.stopRel, lr.relDone = append(lr.stopRel, cancel), append(lr.relDone, done)
		addrs = append(addrs, r.Addrs()[0].String())
	}
	ec := cfg.Engine
	ec.Seed = cfg.Seed
	for i := range cfg.Engines {
		srv, err := simengine.New(simengine.Config{Listen: "127.0.0.1:0", Models: []string{cfg.Model}, TimeScale: cfg.TimeScale, Engine: ec})
		if err != nil {
			return nil, err
		}
		if _, err := srv.Listen(); err != nil {
			return nil, err
		}
		ectx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- srv.Run(ectx) }()
		lr.stopEng, lr.engDone = append(lr.stopEng, cancel), append(lr.engDone, done)
		a, err := agent.New(agent.Config{
			Relays:         addrs,
			Token:          string(token),
			Upstream:       srv.URL(),
			Name:           fmt.Sprintf("agent-%d", i),
			MaxConcurrency: cfg.Capacity,
			IdentityFile:   filepath.Join(dir, fmt.Sprintf("agent-%d.key", i)),
			ListenAddrs:    []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
			MinBackoff:     50 * time.Millisecond,
			MaxBackoff:     time.Second,
			DrainTimeout:   time.Second,
			Gossip:         agent.GossipConfig{Disabled: true},
		})
		if err != nil {
			return nil, err
		}
		actx, acancel := context.WithCancel(context.Background())
		adone := make(chan error, 1)
		go func() { adone <- a.Run(actx) }()
		lr.stopAg, lr.agDone = append(lr.stopAg, acancel), append(lr.agDone, adone)
	}
	// Every relay routes to every agent and shares with every other relay.
	for {
		ready := true
		for _, r := range lr.relays {
			n := 0
			for _, ai := range r.Registry().Agents() {
				if len(ai.Models) > 0 && !ai.Dead {
					n++
				}
			}
			if n < cfg.Engines || len(r.PeerRelays()) < cfg.Relays-1 {
				ready = false
			}
		}
		if ready {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("bench: relays not ready: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	lr.started = time.Now()
	return lr, nil
}

// url returns a relay's URL at random.
func (lr *liveRelays) url() string { return lr.urls[rand.IntN(len(lr.urls))] }

// bindingBytesPerSec is the sessions protocol bytes each relay sent per
// second of real time since the cluster was ready.
func (lr *liveRelays) traffic(res *Result) {
	var bytes uint64
	var updates uint64
	for _, r := range lr.relays {
		st := r.PeerStats()
		bytes += st.BytesSent
		updates += st.BindingsSent
	}
	res.Relays = len(lr.relays)
	res.BindingUpdates = int64(updates)
	if d := time.Since(lr.started); d > 0 {
		res.BindingBytesPerSec = float64(bytes) / d.Seconds() / float64(len(lr.relays))
	}
}

// Close stops agents, engines and relays, and removes the identities.
func (lr *liveRelays) Close() {
	for i, c := range lr.stopAg {
		c()
		<-lr.agDone[i]
	}
	for i, c := range lr.stopEng {
		c()
		<-lr.engDone[i]
	}
	for i, c := range lr.stopRel {
		c()
		<-lr.relDone[i]
	}
	_ = os.RemoveAll(lr.dir)
}

var errRelaysScenario = errors.New("several live relays run the steady scenario only")
