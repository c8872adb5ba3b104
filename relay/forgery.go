package relay

import (
	"errors"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
)

// ErrBanned rejects a join from a peer cut off for forged gossip.
var ErrBanned = errors.New("peer is cut off for forged gossip")

// ForgeryBan is how long a peer caught sending forged gossip may not join
// again. It holds the join secret, so it can come back under a new peer ID:
// rotating the secret is what removes it for good.
const ForgeryBan = time.Hour

// ban cuts peer p off until until: its registration ends now and its joins
// fail with ErrBanned.
func (g *Registry) ban(p peer.ID, until time.Time) {
	g.mu.Lock()
	g.banned[p] = until
	g.mu.Unlock()
	g.Left(p)
}

// isBanned reports whether p is cut off at now (g.mu held).
func (g *Registry) isBannedLocked(p peer.ID, now time.Time) bool {
	until, ok := g.banned[p]
	if ok && !now.Before(until) {
		delete(g.banned, p)
		return false
	}
	return ok
}

// forged cuts off a joined peer that gossip caught forging: it is logged,
// its registration ends, its connections close, and it may not join again
// for ForgeryBan. Called from the gossip transport: the disconnect runs in
// the background.
func (r *Relay) forged(p peer.ID, reason string) {
	name, _ := r.reg.Name(p)
	r.log.Warn().Stringer("peer", p).Str("agent", name).Str("reason", reason).
		Dur("ban", ForgeryBan).Msg("agent sent forged gossip; cut off")
	r.reg.ban(p, time.Now().Add(ForgeryBan))
	r.metrics.forged.Inc()
	if r.host != nil {
		go func() { _ = r.host.Network().ClosePeer(p) }()
	}
}
