package relay

// The relay's side of peer relays (package peering shares the bindings
// and the spending): what the peering manager needs of the relay, and the
// hooks the request path calls.

import (
	"context"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/relay/peering"
)

// Defaults for the zero values of PeersConfig; see package peering.
const (
	DefaultPeerFlushInterval = peering.DefaultFlushInterval // batching delay of binding updates
	DefaultPeerMaxPending    = peering.DefaultMaxPending    // updates queued per peer before a resync
	DefaultPeerForget        = peering.DefaultForget        // a learned peer unreachable this long is dropped
	DefaultPeerSpentInterval = peering.DefaultSpentInterval // how often budgeted clients' spending is sent
)

// PeersConfig configures how the relay shares session bindings with peer
// relays; see peering.Settings. The zero value shares them with the peers
// learned from agents.
type PeersConfig = peering.Settings

// PeerStats counts the relay's binding traffic with peer relays; see
// peering.Stats.
type PeerStats = peering.Stats

// newPeers builds the peering manager from what it needs of r (its host
// set). Gossip starts after it: the join hook reads r.gossip when called.
func newPeers(r *Relay) *peering.Manager {
	sc := r.sched.Config()
	cfg := peering.Config{
		Settings:    r.cfg.Peers,
		Host:        r.host,
		Secret:      r.cfg.Token,
		Clock:       r.cfg.Clock,
		Logger:      r.log,
		Ledger:      r.cfg.Ledger,
		SessionTTL:  sc.SessionTTL,
		MaxSessions: sc.MaxSessions,
		Bind:        r.sched.Bind,
		Budgeted: func(client string) bool {
			c := r.clients.byName(client)
			return c != nil && !c.Budget.Unlimited()
		},
		Synced:      func() { r.queue.wake() },
		AwaitWindow: restartWindow,
		SyncWait:    r.cfg.peerSyncWait,
	}
	if !r.cfg.Gossip.Disabled {
		cfg.JoinGossip = func(p peer.ID) error {
			rg := r.gossip
			if rg == nil {
				return nil
			}
			_, err := rg.g.Join(p)
			return err
		}
	}
	return peering.New(cfg)
}

// PeerStats returns the binding traffic with peer relays (zero when
// sharing is off).
func (r *Relay) PeerStats() PeerStats {
	if r.peers == nil {
		return PeerStats{}
	}
	return r.peers.Stats()
}

// PeerRelays returns the peer relays with an authenticated stream out.
func (r *Relay) PeerRelays() []peer.ID {
	if r.peers == nil {
		return nil
	}
	return r.peers.Up()
}

// peerAdmitted reports whether p is a peer relay admitted to gossip.
func (r *Relay) peerAdmitted(p peer.ID) bool { return r.peers != nil && r.peers.Admitted(p) }

// peerKnown reports whether p is a peer relay the relay knows.
func (r *Relay) peerKnown(p peer.ID) bool { return r.peers != nil && r.peers.Known(p) }

// installBinding brings the session's binding agreed with the peer relays
// into the scheduler before the request is scheduled (a no-op without
// peers or a session key).
func (r *Relay) installBinding(ctx context.Context, session string) {
	if r.peers != nil {
		r.peers.Install(ctx, session)
	}
}

// bindingPending reports whether a request of session, which has no
// binding yet, should wait for a peer relay's table (a relay that has
// just started; see peering.Manager.Install).
func (r *Relay) bindingPending(session string) bool {
	return r.peers != nil && r.peers.Pending(session)
}

// shareBinding records a success of session on agent ep for the peer
// relays.
func (r *Relay) shareBinding(session, ep string) {
	if r.peers != nil && session != "" {
		r.peers.Share(session, ep)
	}
}

// warmUpQuiet is how long without a new agent join ends the warm-up.
const warmUpQuiet = 250 * time.Millisecond

// warmUp waits (up to cfg.WarmUp, or until ctx ends) until agents have
// rejoined: one routable, and none joining for warmUpQuiet.
func (r *Relay) warmUp(ctx context.Context) {
	if r.cfg.WarmUp <= 0 {
		return
	}
	start := time.Now()
	deadline := start.Add(r.cfg.WarmUp)
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	last, lastChange := -1, start
	for time.Now().Before(deadline) {
		n := r.reg.routable()
		if n != last {
			last, lastChange = n, time.Now()
		}
		if n > 0 && time.Since(lastChange) >= warmUpQuiet {
			break
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
	r.log.Info().Int("agents", last).Dur("took", time.Since(start)).Msg("warm-up over; accepting clients")
}
