// Package liveness checks a relay's agents on the request path. Gossip
// finds a silent agent in seconds; a request must not wait that long. Two
// checks run on the connection a request travels on, independent of the
// engine's speed:
//
//   - The acknowledgement: the agent answers every request with
//     transport.AckStatus transport.AckDelay after its header, or with the
//     response head if that comes first. No ack within ackTimeout (a few
//     round trip times) of the request's sending (not of the attempt's
//     start: a request may wait for a stream to the agent, see
//     transport.NewRoundTripper) is a connection failure: the
//     attempt, not yet committed, is retried on another agent, and the
//     agent is suspect at once (avoided by the scheduler).
//   - The probe: a ping runs on every joined agent's connection, from its
//     join on: every IdleProbeInterval, and every ProbeInterval while
//     requests are in flight to it (and for a short linger after). An agent
//     that echoes nothing and sends no byte of any answer for SilentAfter
//     (IdleSilentAfter when idle) is silent: it turns suspect and every
//     request in flight to it is cancelled with ErrAgentSilent, so that an
//     uncommitted attempt is retried elsewhere and a stream already going
//     out ends with an error event. Silent for DeadAfter, it is taken out
//     of routing as gossip takes a dead member. The first echo after that
//     clears both: a frozen agent that wakes up is routable again once it
//     answers.
//
// The probe also keeps the agent's smoothed RTT in the peerstore (libp2p's
// LatencyEWMA), which sets the ack bound.
package liveness

import (
	"context"
	"crypto/rand"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/p2p/protocol/ping"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/transport"
)

// Liveness causes of a cancelled attempt.
var (
	// ErrNoAck is the cause when an agent did not acknowledge a request
	// within a few round trip times (see transport.AckStatus).
	ErrNoAck = errors.New("agent did not acknowledge the request")
	// ErrAgentSilent is the cause when an agent stopped answering probes
	// while the request was in flight.
	ErrAgentSilent = errors.New("agent stopped answering")
)

// Liveness timings. A ping is 32 bytes and its echo 32, each in a QUIC
// packet of about 80 bytes with its ACK: an idle agent costs about 160
// bytes/s each way (IdleProbeInterval), one with requests in flight about
// 640 bytes/s each way (ProbeInterval).
const (
	// IdleProbeInterval is the gap between two probes of an agent with no
	// request in flight.
	IdleProbeInterval = time.Second
	// IdleSilentAfter is the silence bound of an idle agent: a few probes,
	// so that one lost packet is no death.
	IdleSilentAfter = 3 * time.Second
	// MinAckTimeout is the floor of the ack bound: scheduling delays on a
	// loaded agent host are not a death.
	MinAckTimeout = 250 * time.Millisecond
	// ackRTTs is the ack bound in smoothed round trip times.
	ackRTTs = 4
	// ProbeInterval is the gap between two probes of a busy agent.
	ProbeInterval = 250 * time.Millisecond
	// SilentAfter is how long an agent may echo nothing before it is
	// declared silent.
	SilentAfter = 1500 * time.Millisecond
	// probeLinger keeps probing an agent that has no request in flight any
	// more, so that a steady trickle of requests does not start and stop a
	// prober every time.
	probeLinger = 5 * time.Second
	// DeadAfter is how long an agent may stay silent before the relay
	// takes it out of routing altogether (its sessions' affinity
	// dropped), as gossip does for a dead member: it covers agents gossip
	// does not know yet, and does not wait for QUIC's idle timeout.
	DeadAfter = 10 * time.Second
	// watchEvery is how often joined agents without a prober get one.
	watchEvery = 250 * time.Millisecond
)

// ackTimeout is the bound on a request's acknowledgement given the smoothed
// RTT to the agent (0 when not measured yet).
func ackTimeout(rtt time.Duration) time.Duration {
	return max(ackRTTs*rtt, MinAckTimeout)
}

// Registry is what the checker needs of the relay's table of joined
// agents. Its methods are called without the checker's lock held.
type Registry interface {
	// Registered returns the joined agents.
	Registered() []Agent
	// Holds reports whether agent name is registered to peer p.
	Holds(name string, p peer.ID) bool
	// SetUnresponsive marks agent name at p suspect (on) or clears the mark.
	SetUnresponsive(name string, p peer.ID, on bool)
	// SetDead takes agent name out of routing (dead) or puts it back.
	SetDead(name string, dead bool)
}

// Agent is a joined agent: its name at its peer.
type Agent struct {
	Name string
	Peer peer.ID
}

// Config is what a Checker is built from.
type Config struct {
	Host     host.Host // the relay's host: pings go on its connections
	Registry Registry
	Log      zerolog.Logger
	// Ctx is the relay's background context: its end stops every prober.
	Ctx context.Context
	// WG counts the relay's background goroutines; the probers are added.
	WG *sync.WaitGroup
}

// Checker watches the agents that have requests in flight. Its methods
// are safe for concurrent use.
type Checker struct {
	h   host.Host
	reg Registry
	log zerolog.Logger
	ctx context.Context
	wg  *sync.WaitGroup

	mu    sync.Mutex // guards watch and pings
	watch map[peer.ID]*watch
	// pings are the pingNow calls under way, by agent: requests whose ack
	// bounds pass together share one (a ping stream each would soon meet
	// the ping protocol's stream limit, and fail for that alone).
	pings map[peer.ID]*pingCall

	ackTimers sync.Pool // of *ackTimer that can fire no more

	stall stallClock // the relay's own stalls (stall.go), ticked by Run
}

// watch is the liveness state of one agent. Guarded by Checker.mu.
type watch struct {
	name    string
	flights map[*Flight]struct{}
	suspect bool      // we marked it unresponsive
	idleAt  time.Time // when the last flight ended
	echoAt  time.Time // the prober's last echo
	probing bool      // a prober goroutine runs
	// readAt is when bytes of an answer last came from the agent, in Unix
	// nanoseconds; atomic, as every read of every answer stores it.
	readAt atomic.Int64
}

// read records that bytes of an answer came from the agent.
func (w *watch) read() { w.readAt.Store(time.Now().UnixNano()) }

// Flight is one attempt in flight to an agent: registered with the agent's
// watch, so that a silent agent cancels it, and bounded by its
// acknowledgement timer. One allocation holds what a registration, the ack
// state and their closures took separately.
type Flight struct {
	l      *Checker
	p      peer.ID
	name   string
	w      *watch
	cancel context.CancelCauseFunc
	bound  time.Duration            // the ack bound
	timer  atomic.Pointer[ackTimer] // fires at the ack bound; set when the request is sent
	// stallAt is the relay's stall clock when the ack bound was armed:
	// a bound that passed while the relay itself stood still is re-armed.
	stallAt atomic.Int64
	// ack is 0 while waiting, 1 once acknowledged, 2 once timed out. The
	// first to move it decides, as for the time to first byte.
	ack atomic.Int32
}

// ackTimer is a flight's ack bound. Most requests are acknowledged (or
// answered) well within it, so the timer and its callback are reused, as
// an attempt's watchdog is (watchdog.go): one goes back to the pool only
// when acked stopped it before it ever went off, so that no call of fire
// can still come for it.
type ackTimer struct {
	f *Flight // the flight it bounds

	mu    sync.Mutex // guards spent, and orders it against Stop
	t     *time.Timer
	spent bool // went off during this flight: not to be reused
}

func (a *ackTimer) fire() {
	a.mu.Lock()
	a.spent = true
	a.mu.Unlock()
	a.f.ackExpired(a)
}

// New returns a checker of cfg.Registry's agents; Run starts its probers.
func New(cfg Config) *Checker {
	return &Checker{h: cfg.Host, reg: cfg.Registry, log: cfg.Log, ctx: cfg.Ctx, wg: cfg.WG, watch: make(map[peer.ID]*watch), pings: make(map[peer.ID]*pingCall)}
}

// ackTimeout returns the ack bound for agent p.
func (l *Checker) ackTimeout(p peer.ID) time.Duration {
	return ackTimeout(l.h.Peerstore().LatencyEWMA(p))
}

// Begin registers an attempt in flight to agent name at peer p, whose
// context cancel ends. It returns the flight and the request context to
// use, on which the request's sending arms its acknowledgement bound: the
// agent must acknowledge the request within it (Flight.ackExpired). The
// caller calls f.Acked once the response's header arrived and f.End when
// the attempt is over.
func (l *Checker) Begin(ctx context.Context, cancel context.CancelCauseFunc, p peer.ID, name string) (*Flight, context.Context) {
	f := &Flight{l: l, p: p, name: name, cancel: cancel}
	l.mu.Lock()
	f.w = l.watchLocked(p, name)
	f.w.flights[f] = struct{}{}
	l.startLocked(p, f.w)
	l.mu.Unlock()
	return f, transport.WithReadProgress(transport.WithAck(ctx, f.sent, f.Acked), f.w.read)
}

// sent arms f's acknowledgement bound, the request written.
func (f *Flight) sent() {
	if f.ack.Load() != 0 || f.timer.Load() != nil {
		return // over already, or a second request written (a retry on a fresh stream)
	}
	l := f.l
	f.bound = l.ackTimeout(f.p)
	f.stallAt.Store(int64(l.stall.total()))
	a, _ := l.ackTimers.Get().(*ackTimer)
	if a == nil {
		a = &ackTimer{}
	}
	a.f = f
	a.mu.Lock()
	a.spent = false
	if a.t == nil {
		a.t = time.AfterFunc(f.bound, a.fire)
	} else {
		a.t.Reset(f.bound) // stopped when pooled: no fire is pending
	}
	a.mu.Unlock()
	// Armed before it is seen: an acked that misses it leaves it to go off
	// for nothing (ackExpired sees the ack), and never reused.
	f.timer.Store(a)
}

// End unregisters f and disarms its ack bound as an acknowledgement does:
// an attempt over before its ack (its round trip failed, its client left)
// waits for none, and a bound left armed would go off after it, ping the
// agent and, the agent answering, re-arm itself for as long as the relay
// runs.
func (f *Flight) End() {
	f.Acked()
	l := f.l
	l.mu.Lock()
	delete(f.w.flights, f)
	if len(f.w.flights) == 0 {
		f.w.idleAt = time.Now()
	}
	l.mu.Unlock()
}

// Acked records the request's acknowledgement (or its response header,
// which is one too).
func (f *Flight) Acked() {
	if f.ack.CompareAndSwap(0, 1) {
		a := f.timer.Load()
		if a == nil {
			return // never sent: no bound armed
		}
		a.mu.Lock()
		reuse := a.t.Stop() && !a.spent
		a.mu.Unlock()
		if reuse {
			a.f = nil
			f.l.ackTimers.Put(a)
		}
	}
}

// ackExpired runs when the ack bound a passed.
func (f *Flight) ackExpired(a *ackTimer) {
	if f.ack.Load() != 0 {
		return
	}
	// The relay stood still meanwhile (stall.go): the ack may be waiting
	// unread. The bound starts again.
	if st := int64(f.l.stall.total()); st > f.stallAt.Load() {
		f.stallAt.Store(st)
		a.t.Reset(f.bound) // spent already: never reused
		return
	}
	// A late ack alone is no death: a loaded agent host (or relay) delays
	// it. Before the attempt is given up the connection itself is asked:
	// the prober's last echo, if recent, else a ping of its own. A dead or
	// frozen agent answers none, a slow one does, and its attempt keeps
	// waiting (the prober's silence bound still ends it if the agent goes
	// quiet). The prober's echo comes first because a ping of our own needs
	// a new stream, which a connection busy with as many requests as the
	// agent accepts streams may hold back until one ends.
	if f.l.echoedWithin(f.w, 2*f.bound) || f.l.pingNow(f.p, 2*f.bound) {
		if f.ack.Load() == 0 {
			a.t.Reset(f.bound) // spent already: never reused
		}
		return
	}
	if f.ack.CompareAndSwap(0, 2) {
		f.cancel(ErrNoAck)
		f.l.noAck(f.p, f.name)
	}
}

// noAck records that agent name at p left a request unacknowledged: it is
// suspect until it answers a probe.
func (l *Checker) noAck(p peer.ID, name string) {
	l.mu.Lock()
	w := l.watchLocked(p, name)
	mark := !w.suspect
	w.suspect = true
	l.startLocked(p, w)
	l.mu.Unlock()
	if mark {
		l.log.Warn().Str("agent", name).Msg("agent left a request unacknowledged: suspect")
		l.reg.SetUnresponsive(name, p, true)
	}
}

func (l *Checker) watchLocked(p peer.ID, name string) *watch {
	w := l.watch[p]
	if w == nil {
		w = &watch{name: name, flights: make(map[*Flight]struct{})}
		l.watch[p] = w
	}
	return w
}

// startLocked starts w's prober unless it runs or the relay is closing.
func (l *Checker) startLocked(p peer.ID, w *watch) {
	if w.probing || l.ctx.Err() != nil {
		return
	}
	w.probing = true
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		l.probe(p, w)
	}()
}

// probe pings agent p until its registration ends or the relay closes.
func (l *Checker) probe(p peer.ID, w *watch) {
	var s network.Stream
	defer func() {
		if s != nil {
			_ = s.Reset()
		}
	}()
	lastAlive := time.Now()
	aliveStall := l.stall.total() // the relay's stalls until lastAlive
	markedDead := false
	buf := make([]byte, 2*ping.PingSize)
	tick := time.NewTimer(0)
	defer tick.Stop()
	for {
		select {
		case <-l.ctx.Done():
			l.stop(p, w)
			return
		case <-tick.C:
		}
		if !l.reg.Holds(w.name, p) {
			l.stop(p, w)
			return
		}
		interval, bound := IdleProbeInterval, IdleSilentAfter
		if l.busy(w) {
			interval, bound = ProbeInterval, SilentAfter
		}
		// Bytes of an answer are a sign of life as good as an echo: the
		// agent's ping service resets each ping stream after 30 s, and the
		// new one may wait for the connection's stream credit while the
		// agent streams answers at full speed.
		if at := time.Unix(0, w.readAt.Load()); at.After(lastAlive) {
			lastAlive, aliveStall = at, l.stall.total()
		}
		start := time.Now()
		// Until the silence bound from the last echo, counting only the
		// time the relay ran; once silent, each probe gets the whole bound
		// to show the agent is back.
		deadline := lastAlive.Add(bound + l.stall.total() - aliveStall)
		if !deadline.After(start) {
			// Silent already (a stall of the relay's own during the last
			// probe put it off by a hair): no need of one more probe to say
			// so.
			if awake(lastAlive, start, l.stall.total()-aliveStall) >= bound {
				l.silent(p, w)
			}
			deadline = start.Add(bound)
		}
		var err error
		if s == nil {
			s, err = l.openPing(p, deadline)
		}
		if err == nil {
			err = pingOnce(s, buf, deadline)
		}
		now := time.Now()
		if err == nil {
			l.h.Peerstore().RecordLatency(p, now.Sub(start))
			lastAlive, aliveStall = now, l.stall.total()
			if markedDead {
				markedDead = false
				l.reg.SetDead(w.name, false)
			}
			l.alive(p, w)
			tick.Reset(interval)
			continue
		}
		if s != nil {
			_ = s.Reset()
			s = nil
		}
		if at := time.Unix(0, w.readAt.Load()); at.After(lastAlive) {
			lastAlive, aliveStall = at, l.stall.total()
		}
		quiet := awake(lastAlive, now, l.stall.total()-aliveStall)
		if quiet >= bound {
			l.silent(p, w)
		}
		if !markedDead && quiet >= DeadAfter && l.reg.Holds(w.name, p) {
			markedDead = true
			l.log.Warn().Str("agent", w.name).Dur("silent", quiet).Msg("agent silent too long: out of routing")
			l.reg.SetDead(w.name, true)
		}
		// A failure before the silence bound (a stream reset): retry soon.
		tick.Reset(ProbeInterval)
	}
}

// busy reports whether w has requests in flight, or had in the last
// probeLinger.
func (l *Checker) busy(w *watch) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(w.flights) > 0 || w.suspect || time.Since(w.idleAt) < probeLinger
}

// Run gives every joined agent a prober, from its join on, until the
// relay's background context ends.
func (l *Checker) Run() {
	stallDone := make(chan struct{})
	var stallWG sync.WaitGroup
	stallWG.Go(func() { l.stall.run(stallDone) })
	defer stallWG.Wait()
	defer close(stallDone)
	t := time.NewTicker(watchEvery)
	defer t.Stop()
	for {
		select {
		case <-l.ctx.Done():
			return
		case <-t.C:
		}
		for _, a := range l.reg.Registered() {
			l.mu.Lock()
			l.startLocked(a.Peer, l.watchLocked(a.Peer, a.Name))
			l.mu.Unlock()
		}
	}
}

// stop ends w's prober; a watch with nothing left goes.
func (l *Checker) stop(p peer.ID, w *watch) {
	l.mu.Lock()
	w.probing = false
	if len(w.flights) == 0 && l.watch[p] == w {
		delete(l.watch, p)
	}
	suspect := w.suspect
	l.mu.Unlock()
	if suspect {
		// Gossip and the join stream decide from here on.
		l.reg.SetUnresponsive(w.name, p, false)
	}
}

// echoedWithin reports whether w's prober had an echo within the last d.
func (l *Checker) echoedWithin(w *watch, d time.Duration) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return time.Since(w.echoAt) < d
}

// alive clears w's suspicion after an echo.
func (l *Checker) alive(p peer.ID, w *watch) {
	l.mu.Lock()
	was := w.suspect
	w.suspect = false
	w.echoAt = time.Now()
	l.mu.Unlock()
	if was {
		l.log.Info().Str("agent", w.name).Msg("agent answers again")
		l.reg.SetUnresponsive(w.name, p, false)
	}
}

// silent marks w suspect and cancels its requests in flight.
func (l *Checker) silent(p peer.ID, w *watch) {
	l.mu.Lock()
	was := w.suspect
	w.suspect = true
	flights := make([]*Flight, 0, len(w.flights))
	for f := range w.flights {
		flights = append(flights, f)
	}
	l.mu.Unlock()
	if !was {
		l.log.Warn().Str("agent", w.name).Int("in_flight", len(flights)).Msg("agent silent: suspect, its requests end")
		l.reg.SetUnresponsive(w.name, p, true)
	}
	for _, f := range flights {
		f.cancel(ErrAgentSilent)
	}
}

// openPing opens a ping stream to p on an existing connection.
func (l *Checker) openPing(p peer.ID, deadline time.Time) (network.Stream, error) {
	ctx, cancel := context.WithDeadline(l.ctx, deadline)
	defer cancel()
	// Never dial: a probe checks the connection the requests use.
	ctx = network.WithNoDial(ctx, "liveness probe")
	return l.h.NewStream(ctx, p, ping.ID)
}

// pingOnce sends one ping on s and waits for its echo until deadline. buf
// holds 2*ping.PingSize bytes.
func pingOnce(s network.Stream, buf []byte, deadline time.Time) error {
	out, in := buf[:ping.PingSize], buf[ping.PingSize:]
	if _, err := rand.Read(out); err != nil {
		return err
	}
	if err := s.SetDeadline(deadline); err != nil {
		return err
	}
	if _, err := s.Write(out); err != nil {
		return err
	}
	if _, err := io.ReadFull(s, in); err != nil {
		return err
	}
	if string(in) != string(out) {
		return errors.New("ping echo does not match")
	}
	return nil
}

// pingCall is a pingNow under way: ok is set before done closes.
type pingCall struct {
	done chan struct{}
	ok   bool
}

// pingNow pings agent p once on its existing connection and reports whether
// the echo came within d. Calls for p while one is under way wait for its
// answer (at most d) instead of sending their own.
func (l *Checker) pingNow(p peer.ID, d time.Duration) bool {
	l.mu.Lock()
	if c := l.pings[p]; c != nil {
		l.mu.Unlock()
		select {
		case <-c.done:
			return c.ok
		case <-time.After(d):
			return false
		}
	}
	c := &pingCall{done: make(chan struct{})}
	l.pings[p] = c
	l.mu.Unlock()
	c.ok = l.pingFresh(p, d)
	l.mu.Lock()
	delete(l.pings, p)
	l.mu.Unlock()
	close(c.done)
	return c.ok
}

// pingFresh is pingNow's ping, on a stream of its own.
func (l *Checker) pingFresh(p peer.ID, d time.Duration) bool {
	start := time.Now()
	deadline := start.Add(d)
	s, err := l.openPing(p, deadline)
	if err != nil {
		return false
	}
	defer func() { _ = s.Reset() }()
	if pingOnce(s, make([]byte, 2*ping.PingSize), deadline) != nil {
		return false
	}
	l.h.Peerstore().RecordLatency(p, time.Since(start))
	return true
}
