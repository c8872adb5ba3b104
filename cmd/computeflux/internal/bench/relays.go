package bench

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/computeflux/computeflux/scheduler"
)

// Several relays in the simulation (Config.Relays > 1): one scheduler per
// relay, each request sent to a relay chosen at random, and the session
// bindings shared as the relays share them (relay/peering): every relay
// keeps a scheduler.BindingTable; a local success that is news (a new
// binding, a move, or a refresh due) reaches the other relays PeerDelay of
// model time later, where it is merged and installed with Scheduler.Bind;
// a request's binding is installed from the table before it is scheduled.
// Breakers, latency averages and in-flight counts stay per relay.

// DefaultPeerDelay is the model time a binding takes to reach the other
// relays: a 10 ms batching delay plus the trip, as measured between relays
// on loopback (p50 12 ms, p99 24 ms).
const DefaultPeerDelay = 15 * time.Millisecond

// evBind delivers a shared binding to one relay.
const evBind uint8 = 200

// simRelays is the relays beyond the first and the bindings in transit.
type simRelays struct {
	scheds  []*scheduler.Scheduler // [0] is simRun.sched
	tables  []*scheduler.BindingTable
	rng     *rand.Rand
	transit []simBind // by evBind event index; free slots reused
	free    []int
	bytes   int64 // binding bytes sent, over all relays
	updates int64
}

type simBind struct {
	to int
	b  scheduler.Binding
}

// newRelays builds the other relays' schedulers from sc.
func (r *simRun) newRelays(sc scheduler.Config) error {
	n := r.cfg.Relays
	if n <= 1 {
		return nil
	}
	sr := &simRelays{rng: rand.New(rand.NewPCG(r.cfg.Seed, 0x5e1a75))}
	for i := range n {
		s := r.sched
		if i > 0 {
			c := sc
			c.Seed = sc.Seed + int64(i)
			var err error
			if s, err = scheduler.New(c); err != nil {
				return err
			}
		}
		sr.scheds = append(sr.scheds, s)
		sr.tables = append(sr.tables, scheduler.NewBindingTable(s.Config().SessionTTL, s.Config().MaxSessions))
	}
	r.relays = sr
	return nil
}

// everyScheduler returns the schedulers of all relays.
func (r *simRun) everyScheduler() []*scheduler.Scheduler {
	if r.relays == nil {
		return []*scheduler.Scheduler{r.sched}
	}
	return r.relays.scheds
}

// begin starts a request of session key at a relay chosen at random.
func (r *simRun) begin(c *simCall, key string) {
	// The simulated relay times the first token, as of a streamed answer.
	req := scheduler.Request{Model: r.cfg.Model, SessionKey: key, Prefix: c.prefix, Streamed: true}
	sr := r.relays
	if sr == nil {
		c.att = r.sched.Begin(req)
		return
	}
	c.relay = sr.rng.IntN(len(sr.scheds))
	s := sr.scheds[c.relay]
	if key != "" {
		if b, ok := sr.tables[c.relay].Lookup(key, r.clock.t); ok {
			s.Bind(key, b.Endpoint, time.Unix(0, b.Last))
		}
	}
	c.att = s.Begin(req)
}

// shareSuccess records c's success at its relay and sends the binding to
// the others when it is news.
func (r *simRun) shareSuccess(c *simCall) {
	sr := r.relays
	key := c.att.Request().SessionKey
	if sr == nil || key == "" {
		return
	}
	b, share := sr.tables[c.relay].Local(key, c.choice.EndpointID, r.clock.t)
	if !share {
		return
	}
	// The wire size of one binding (relay/peering encodeBindings): two
	// length-prefixed strings, gen, since and last-since as varints.
	size := int64(len(b.Key) + len(b.Endpoint) + 2 + 1 + 9 + 4)
	for j := range sr.scheds {
		if j == c.relay {
			continue
		}
		sr.bytes += size
		sr.updates++
		i := len(sr.transit)
		if n := len(sr.free); n > 0 {
			i, sr.free = sr.free[n-1], sr.free[:n-1]
			sr.transit[i] = simBind{to: j, b: b}
		} else {
			sr.transit = append(sr.transit, simBind{to: j, b: b})
		}
		r.push(r.clock.t.Add(r.cfg.PeerDelay), evBind, i, 0)
	}
}

// deliver merges binding i at its relay.
func (r *simRun) deliver(i int) {
	sr := r.relays
	sb := sr.transit[i]
	sr.free = append(sr.free, i)
	if sr.tables[sb.to].Merge(sb.b, r.clock.t) {
		sr.scheds[sb.to].Bind(sb.b.Key, sb.b.Endpoint, time.Unix(0, sb.b.Last))
	}
}

// checkDrained fails when a scheduler still counts requests in flight.
func (r *simRun) checkDrained() error {
	for i, s := range r.everyScheduler() {
		for _, st := range s.Snapshot() {
			if st.InFlight != 0 {
				return fmt.Errorf("bench: simulation left %d requests in flight on %s (relay %d)", st.InFlight, st.ID, i)
			}
		}
	}
	return nil
}

// relayTraffic fills res's relay fields.
func (r *simRun) relayTraffic(res *Result, span time.Duration) {
	if r.relays == nil {
		return
	}
	res.Relays = len(r.relays.scheds)
	res.BindingUpdates = r.relays.updates
	if span > 0 {
		res.BindingBytesPerSec = float64(r.relays.bytes) / span.Seconds() / float64(res.Relays)
	}
}
