package transport

import (
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"
	manet "github.com/multiformats/go-multiaddr/net"
)

// Join back-off: a peer (or an address) whose handshakes keep failing is
// answered with a refusal, without a challenge, until its back-off ends.
const (
	// joinFreeFailures failed handshakes of one peer are answered at once.
	joinFreeFailures = 5
	// joinAddrFreeFailures failed handshakes from one IP address are
	// answered at once: a few peers behind one NAT may share it.
	joinAddrFreeFailures = 20
	// joinBackoffBase is the first back-off after the free failures; each
	// further failure doubles it, up to joinBackoffMax.
	joinBackoffBase = 500 * time.Millisecond
	joinBackoffMax  = 5 * time.Second
	// joinForgetAfter is how long a failure history is kept without news.
	joinForgetAfter = 10 * time.Minute
	// joinMaxTracked bounds each table; past it, stale entries are swept
	// and, if still full, the oldest news is dropped.
	joinMaxTracked = 1 << 16
)

// joinFailures is one peer's or address's failure history.
type joinFailures struct {
	n     int       // failures since the last success
	until time.Time // refused before this
	last  time.Time // last failure
}

// joinLimiter tracks failed join handshakes per peer and per address. Safe
// for concurrent use; every method takes the time as an argument.
type joinLimiter struct {
	mu    sync.Mutex // guards the following fields
	peers map[peer.ID]*joinFailures
	addrs map[netip.Addr]*joinFailures
}

func newJoinLimiter() *joinLimiter {
	return &joinLimiter{
		peers: make(map[peer.ID]*joinFailures),
		addrs: make(map[netip.Addr]*joinFailures),
	}
}

// remoteIP returns the IP address of a multiaddr; the zero (invalid) Addr
// when it has none, which the limiter then tracks by peer only.
// RemoteIP returns the IP address of a connection's remote multiaddr, or
// the zero Addr when it has none (a circuit's).
func RemoteIP(a ma.Multiaddr) netip.Addr {
	if a == nil {
		return netip.Addr{}
	}
	ip, err := manet.ToIP(a)
	if err != nil {
		return netip.Addr{}
	}
	addr, _ := netip.AddrFromSlice(ip)
	return addr.Unmap()
}

// allow reports whether a handshake from p at ip may run now; when not, it
// returns how long until it may.
func (l *joinLimiter) allow(p peer.ID, ip netip.Addr, now time.Time) (bool, time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var wait time.Duration
	if f := l.peers[p]; f != nil && now.Before(f.until) {
		wait = f.until.Sub(now)
	}
	if ip.IsValid() {
		if f := l.addrs[ip]; f != nil && now.Before(f.until) {
			wait = max(wait, f.until.Sub(now))
		}
	}
	return wait == 0, wait
}

// failed records a failed handshake of p at ip.
func (l *joinLimiter) failed(p peer.ID, ip netip.Addr, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	pf := l.peers[p]
	if pf == nil {
		sweep(l.peers, now)
		pf = &joinFailures{}
		l.peers[p] = pf
	}
	// A peer's failures past its free ones count once for its address: a
	// peer in back-off is paced by its own back-off already.
	countAddr := pf.n < joinFreeFailures
	pf.fail(joinFreeFailures, now)
	if ip.IsValid() && countAddr {
		af := l.addrs[ip]
		if af == nil {
			sweep(l.addrs, now)
			af = &joinFailures{}
			l.addrs[ip] = af
		}
		af.fail(joinAddrFreeFailures, now)
	}
}

// succeeded clears the history of p and of its address.
func (l *joinLimiter) succeeded(p peer.ID, ip netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.peers, p)
	if ip.IsValid() {
		delete(l.addrs, ip)
	}
}

func (f *joinFailures) fail(free int, now time.Time) {
	if !f.last.IsZero() && now.Sub(f.last) > joinForgetAfter {
		f.n = 0
	}
	f.n++
	f.last = now
	if f.n > free {
		f.until = now.Add(joinBackoff(f.n - free))
	}
}

// joinBackoff is the back-off after the k-th failure beyond the free ones.
func joinBackoff(k int) time.Duration {
	d := joinBackoffBase
	for i := 1; i < k && d < joinBackoffMax; i++ {
		d *= 2
	}
	return min(d, joinBackoffMax)
}

// sweep makes room in a full table: it drops the stale entries and, when
// fresh ones still fill more than 15/16 of it, the oldest news down to
// that. A table flooded with fresh entries (a peer cycling through IDs) is
// thus walked once per max/16 insertions, not at each one: amortized, a
// failed handshake costs a few dozen steps here however full the table.
func sweep[K comparable](m map[K]*joinFailures, now time.Time) {
	sweepTo(m, now, joinMaxTracked)
}

func sweepTo[K comparable](m map[K]*joinFailures, now time.Time, max int) {
	if len(m) < max {
		return
	}
	for k, f := range m {
		if now.Sub(f.last) > joinForgetAfter && !now.Before(f.until) {
			delete(m, k)
		}
	}
	keep := max - max/16
	if len(m) <= keep {
		return
	}
	type entry struct {
		k    K
		last time.Time
	}
	all := make([]entry, 0, len(m))
	for k, f := range m {
		all = append(all, entry{k, f.last})
	}
	slices.SortFunc(all, func(a, b entry) int { return a.last.Compare(b.last) })
	for _, e := range all[:len(all)-keep] {
		delete(m, e.k)
	}
}

// backoffReason is the refusal sent to a peer in back-off.
func backoffReason(wait time.Duration) string {
	return fmt.Sprintf("too many failed joins; retry in %v", wait.Round(100*time.Millisecond))
}
