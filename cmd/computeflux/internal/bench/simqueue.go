package bench

import (
	"cmp"
	"errors"
	"strconv"

	"github.com/computeflux/computeflux/agent/simengine"
	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/scheduler"
)

// The relay's fair queue in the simulation, as relay/queue.go runs it.
//
// Each agent gives its engine at most its dispatch limit of requests
// (Config.DispatchLimit: by default its engine's batch, as an agent whose
// engine declares it; a measuring agent's scheduler.Limiter settles there
// too, since the simulated engine queues nothing below its batch), and
// announces it to the scheduler as its capacity. Every request asks the
// scheduler with Request.Wait: one that finds every agent full, or finds
// requests already waiting, waits in its relay's scheduler.Queue, one flow
// per client (flowOf: a session, or each request of a trace replay unless
// its clients are conversations; keys never change it), its cost its prompt and answer in tokens, all interactive and
// of weight 1. When a slot frees (an attempt is reported, an agent joins),
// the relay's dispatcher asks the scheduler to place the queue's head, in
// the same instant of model time: the queue decides when, the scheduler
// where. A request waits at most relay.DefaultQueueWait, then fails as the
// relay answers 429. The scheduler's affinity allowance
// (Config.AffinityCapacity) lets a session's agent take more than its
// limit; the agent's own gate holds those, modelled by the engine's
// first-come queue. Every policy runs with the same limits and queue, so
// that runs differ by placement only.

// evQueueWait ends a request's wait in the queue at its bound.
const evQueueWait uint8 = 201

// dispatchLimit returns the capacity each simulated agent announces: 0
// for none.
func (c *Config) dispatchLimit() int {
	switch {
	case c.Capacity > 0:
		return c.Capacity
	case c.DispatchLimit > 0:
		return c.DispatchLimit
	case c.DispatchLimit < 0:
		return 0
	}
	return orDefault(c.Engine.MaxRunning, simengine.DefaultMaxRunning)
}

// prefillLimit returns the PrefillLimit each simulated agent is given, in
// blocks: the relay's, with its queue; 0 for none.
func (c *Config) prefillLimit() int {
	if c.DispatchLimit < 0 || c.PrefillLimit < 0 {
		return 0
	}
	return relay.PrefillBlocks(cmp.Or(c.PrefillLimit, relay.DefaultPrefillLimit), scheduler.PrefixConfig{})
}

// newQueues gives every relay its queue, unless the dispatch limit is
// off.
func (r *simRun) newQueues() error {
	if r.cfg.DispatchLimit < 0 {
		return nil
	}
	for range r.everyScheduler() {
		q, err := scheduler.NewQueue[*simCall](scheduler.QueueConfig{Clock: r.clock})
		if err != nil {
			return err
		}
		r.queues = append(r.queues, q)
	}
	r.kick = make([]bool, len(r.queues))
	r.waiters = make(map[int]*simCall)
	return nil
}

// queueOf returns the queue of c's relay, nil without queues.
func (r *simRun) queueOf(c *simCall) *scheduler.Queue[*simCall] {
	if r.queues == nil {
		return nil
	}
	return r.queues[c.relay]
}

// flowOf names c's flow in the queue: its client. The relay's flow is the
// client (an API key, else an address: flowFor in relay/queue.go) and a
// session key never changes it, so neither may the simulation's: a session
// is one client, unless the workload makes each turn one
// (Workload.ClientPerTurn: a trace replay with TraceClientsRequest, keyed
// or not). Keys change where a request goes, never its place in the queue.
func (r *simRun) flowOf(c *simCall) string {
	if r.w.ClientPerTurn {
		return "r" + strconv.Itoa(c.rec)
	}
	if r.flows == nil {
		r.flows = make([]string, len(r.sess))
	}
	if r.flows[c.sess] == "" {
		r.flows[c.sess] = "s" + strconv.Itoa(c.sess)
	}
	return r.flows[c.sess]
}

// waitable reports whether a Pick error means "wait for room".
func waitable(err error) bool {
	var ue *scheduler.UnavailableError
	return errors.As(err, &ue) && ue.Full
}

// wait puts c in its relay's queue until the dispatcher places it or its
// wait bound passes.
func (r *simRun) wait(c *simCall) {
	q := r.queueOf(c)
	it, err := q.Push(r.cfg.Model, c.flow, scheduler.BandInteractive, 1, c.cost, c)
	if err != nil {
		r.fail(c, "429 queue full")
		return
	}
	c.item = it
	c.waitFrom = r.clock.t
	c.waits++
	r.waiters[c.rec] = c
	r.kickRelay(c.relay)
	r.push(r.clock.t.Add(relay.DefaultQueueWait), evQueueWait, c.rec, c.waits)
}

// kickRelay asks relay i's dispatcher to look at its queue: a slot may
// have freed.
func (r *simRun) kickRelay(i int) {
	if r.queues != nil {
		r.kick[i], r.kicked = true, true
	}
}

// finished records that an attempt of c ended (reported to the
// scheduler): its slot is free for the next request.
func (r *simRun) finished(c *simCall) {
	if q := r.queueOf(c); q != nil {
		q.Done(c.flow, c.cost)
		r.kickRelay(c.relay)
	}
}

// dispatch places waiting requests of every kicked relay, in its queue's
// order, while the scheduler finds room for them.
func (r *simRun) dispatch() {
	for r.kicked {
		r.kicked = false
		for i, q := range r.queues {
			if !r.kick[i] {
				continue
			}
			r.kick[i] = false
			for {
				it := q.Peek(r.cfg.Model)
				if it == nil {
					break
				}
				c := it.Value
				ch, err := r.choose(c)
				if err != nil && waitable(err) {
					break // no room yet
				}
				q.Pop(it) // nothing leaves a simulated queue between Peek and Pop
				r.dequeued(c)
				if err != nil {
					q.Done(c.flow, c.cost)
					r.fail(c, "no agent available")
					continue
				}
				if ok, retry := r.submit(c, ch); !ok && retry {
					r.pick(c)
				} else if !ok {
					r.fail(c, c.why)
				}
			}
		}
	}
}

// dequeued records the end of c's wait.
func (r *simRun) dequeued(c *simCall) {
	delete(r.waiters, c.rec)
	c.item = nil
	r.recs[c.rec].wait += r.clock.t.Sub(c.waitFrom)
	r.recs[c.rec].waited = true
}

// waitExpired ends the wait of the request of record rec at its bound,
// unless it was placed since (gen is its wait's number).
func (r *simRun) waitExpired(rec int, gen uint64) {
	c := r.waiters[rec]
	if c == nil || c.waits != gen {
		return
	}
	q := r.queueOf(c)
	q.Remove(c.item)
	r.dequeued(c)
	// Waited long enough: an overflow tier may take it now.
	c.att.StopWaiting()
	ch, err := r.choose(c)
	if err != nil {
		r.fail(c, "429 waited the queue bound")
		return
	}
	q.Serving(c.flow, c.cost)
	if ok, retry := r.submit(c, ch); !ok && retry {
		r.pick(c)
	} else if !ok {
		r.fail(c, c.why)
	}
}
