package relay

import (
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// DefaultIndexCutoff is how long an agent that broke the prefix index
// protocol may not publish again (Config.IndexCutoff).
const DefaultIndexCutoff = time.Minute

// blockPool holds the request path's block-chain buffers: hashing a prompt
// allocates nothing once the pool is warm.
var blockPool = sync.Pool{New: func() any { b := make([]uint64, 0, 1024); return &b }}

// promptBlocks returns the block chain of a request body in a pooled
// buffer; give it back with releaseBlocks once the request is done.
func (r *Relay) promptBlocks(body []byte) *[]uint64 {
	bp := blockPool.Get().(*[]uint64)
	*bp = scheduler.PromptBlocks((*bp)[:0], body, r.cfg.Prefix)
	return bp
}

func releaseBlocks(bp *[]uint64) {
	if cap(*bp) > 1<<16 {
		return // an outsized chain: do not keep it
	}
	*bp = (*bp)[:0]
	blockPool.Put(bp)
}

// indexService accepts the agents' prefix index streams
// (transport.PrefixProtocol) and merges them into the scheduler's index.
// Only joined agents may publish; one that breaks the protocol (a malformed,
// oversized or out-of-order message) loses its entries and may not publish
// for Config.IndexCutoff. An agent's entries go when its stream ends, when
// it leaves, and while gossip holds it dead.
type indexService struct {
	h      host.Host
	reg    *Registry
	sched  *scheduler.Scheduler
	prefix scheduler.PrefixConfig
	cutoff time.Duration
	log    zerolog.Logger
	m      *indexMetrics

	mu      sync.Mutex // guards the following fields
	conns   map[peer.ID]*indexConn
	banned  map[peer.ID]time.Time // cut off until
	traffic map[string]uint64     // bytes received, by agent name
	closed  bool
	wg      sync.WaitGroup
}

// indexConn is one agent's open index stream.
type indexConn struct {
	s   network.Stream
	wmu sync.Mutex // serialises writes (resync requests, reject)
}

func newIndexService(r *Relay) *indexService {
	x := &indexService{
		h:       r.host,
		reg:     r.reg,
		sched:   r.sched,
		prefix:  r.cfg.Prefix,
		cutoff:  r.cfg.IndexCutoff,
		log:     r.log.With().Str("part", "prefix-index").Logger(),
		m:       r.metrics.index,
		conns:   make(map[peer.ID]*indexConn),
		banned:  make(map[peer.ID]time.Time),
		traffic: make(map[string]uint64),
	}
	return x
}

// listen takes prefix index streams on the relay's host.
func (x *indexService) listen() { x.h.SetStreamHandler(transport.PrefixProtocol, x.handle) }

// close stops accepting index streams, resets the open ones and waits for
// their handlers.
func (x *indexService) close() {
	x.h.RemoveStreamHandler(transport.PrefixProtocol)
	x.mu.Lock()
	x.closed = true
	for _, c := range x.conns {
		_ = c.s.Reset()
	}
	x.mu.Unlock()
	x.wg.Wait()
}

// left ends peer p's index stream (its registration ended; Remove has
// dropped its entries).
func (x *indexService) left(p peer.ID) {
	x.mu.Lock()
	c := x.conns[p]
	x.mu.Unlock()
	if c != nil {
		_ = c.s.Reset()
	}
}

// resync asks peer p for a snapshot (its entries were dropped while it
// stayed joined, e.g. gossip held it dead for a while).
func (x *indexService) resync(p peer.ID) {
	x.mu.Lock()
	c := x.conns[p]
	x.mu.Unlock()
	if c == nil {
		return
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	b, _ := transport.AppendPrefixFrame(nil, &transport.PrefixMsg{Type: transport.PrefixResync})
	_ = c.s.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.s.Write(b); err != nil {
		_ = c.s.Reset()
	}
}

// violation is a protocol breach by a publisher.
type violation struct {
	kind string // metric label: malformed, oversized, order, config
	msg  string
}

func (v *violation) Error() string { return v.msg }

func breach(kind, format string, args ...any) *violation {
	return &violation{kind: kind, msg: fmt.Sprintf(format, args...)}
}

func (x *indexService) handle(s network.Stream) {
	p := s.Conn().RemotePeer()
	x.mu.Lock()
	if x.closed {
		x.mu.Unlock()
		_ = s.Reset()
		return
	}
	if until, ok := x.banned[p]; ok && time.Now().Before(until) {
		x.mu.Unlock()
		x.m.refused.WithLabelValues("cut_off").Inc()
		x.reject(&indexConn{s: s}, "cut off from publishing after a protocol violation")
		return
	}
	delete(x.banned, p)
	name, ok := x.reg.Name(p)
	if !ok {
		x.mu.Unlock()
		x.m.refused.WithLabelValues("not_joined").Inc()
		_ = s.Reset()
		return
	}
	c := &indexConn{s: s}
	old := x.conns[p]
	x.conns[p] = c
	x.wg.Add(1)
	x.mu.Unlock()
	defer x.wg.Done()
	if old != nil {
		_ = old.s.Reset()
	}
	defer func() {
		x.mu.Lock()
		if x.conns[p] == c {
			delete(x.conns, p)
		}
		x.mu.Unlock()
	}()

	err := x.serve(c, p, name)
	var v *violation
	switch {
	case errors.As(err, &v):
		x.reg.withIndex(p, func(id string) { x.sched.IndexDrop(id) })
		x.m.cutoffs.WithLabelValues(v.kind).Inc()
		if v.kind != "config" {
			x.mu.Lock()
			x.banned[p] = time.Now().Add(x.cutoff)
			x.mu.Unlock()
		}
		x.log.Warn().Str("agent", name).Stringer("peer", p).Str("reason", v.msg).Dur("cutoff", x.cutoff).
			Msg("prefix index publisher cut off; its entries are dropped")
		x.reject(c, v.msg)
	default:
		// The stream ended (agent stopped publishing, left or was
		// replaced): what it published is no longer kept up to date.
		x.reg.withIndex(p, func(id string) { x.sched.IndexDrop(id) })
		x.log.Debug().Err(err).Str("agent", name).Msg("prefix index stream ended")
		_ = s.Reset()
	}
}

// reject tells the agent why and closes the stream.
func (x *indexService) reject(c *indexConn, reason string) {
	if len(reason) > 512 {
		reason = reason[:512]
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	b, err := transport.AppendPrefixFrame(nil, &transport.PrefixMsg{Type: transport.PrefixReject, Reason: reason})
	if err == nil {
		_ = c.s.SetWriteDeadline(time.Now().Add(5 * time.Second))
		_, _ = c.s.Write(b)
	}
	// Close, not Reset: the reason must arrive.
	_ = c.s.Close()
}

// serve reads c until it ends; a *violation error is a breach.
func (x *indexService) serve(c *indexConn, p peer.ID, name string) error {
	pr := transport.NewPrefixReader(c.s)
	x.mu.Lock()
	x.traffic[name] += 0 // the agent has index series: see names
	x.mu.Unlock()
	var (
		m                        transport.PrefixMsg
		hello, synced, inSnap    bool
		haveSeq                  bool
		lastSeq                  uint64
		snap                     []uint64
		bytesC                   = x.m.bytes.WithLabelValues(name)
		helloC, snapC, deltaC    = x.m.frames.WithLabelValues(name, indexFrameTypes[0]), x.m.frames.WithLabelValues(name, indexFrameTypes[1]), x.m.frames.WithLabelValues(name, indexFrameTypes[2])
		addedC, evictedC, resetC = x.m.hashes.WithLabelValues(name, indexHashKinds[0]), x.m.hashes.WithLabelValues(name, indexHashKinds[1]), x.m.hashes.WithLabelValues(name, indexHashKinds[2])
	)
	for {
		n, err := pr.Next(&m)
		if n > 0 {
			bytesC.Add(float64(n))
			x.mu.Lock()
			x.traffic[name] += uint64(n)
			x.mu.Unlock()
		}
		switch {
		case err == nil:
		case errors.Is(err, transport.ErrPrefixTooLarge):
			return breach("oversized", "%v", err)
		case errors.Is(err, transport.ErrPrefixMalformed):
			return breach("malformed", "%v", err)
		case errors.Is(err, io.EOF):
			return nil
		default:
			return err
		}
		switch m.Type {
		case transport.PrefixHello:
			helloC.Inc()
			if hello {
				return breach("order", "a second hello")
			}
			hello = true
			got := scheduler.PrefixConfig{BlockTokens: m.BlockTokens, BytesPerToken: m.BytesPerToken, MaxBlocks: m.MaxBlocks}
			if !samePrefixConfig(got, x.prefix) {
				return breach("config", "hashing configuration %+v differs from the relay's %+v", got, x.prefix)
			}
		case transport.PrefixSnapshot:
			snapC.Inc()
			switch {
			case !hello:
				return breach("order", "snapshot before hello")
			case m.First && haveSeq && m.Seq <= lastSeq:
				return breach("order", "snapshot seq %d after %d", m.Seq, lastSeq)
			case !m.First && (!inSnap || m.Seq != lastSeq+1):
				return breach("order", "snapshot part seq %d after %d", m.Seq, lastSeq)
			}
			if m.First {
				snap, inSnap = snap[:0], true
			}
			if len(snap)+len(m.Added) > scheduler.MaxEndpointBlocks {
				return breach("oversized", "snapshot of more than %d blocks", scheduler.MaxEndpointBlocks)
			}
			snap = append(snap, m.Added...)
			lastSeq, haveSeq = m.Seq, true
			if m.Last {
				resetC.Add(float64(len(snap)))
				x.reg.withIndex(p, func(id string) { x.sched.IndexReset(id, snap) })
				inSnap, synced = false, true
				if cap(snap) > 1<<16 {
					snap = nil // a large snapshot's buffer is not kept for deltas
				}
			}
		case transport.PrefixDelta:
			deltaC.Inc()
			switch {
			case !synced || inSnap:
				return breach("order", "delta seq %d before a complete snapshot", m.Seq)
			case m.Seq != lastSeq+1:
				return breach("order", "delta seq %d after %d", m.Seq, lastSeq)
			}
			lastSeq = m.Seq
			addedC.Add(float64(len(m.Added)))
			evictedC.Add(float64(len(m.Evicted)))
			x.reg.withIndex(p, func(id string) { x.sched.IndexApply(id, m.Added, m.Evicted) })
		default:
			return breach("malformed", "%s is not an agent's message", m.Type)
		}
	}
}

// samePrefixConfig compares two hashing configurations, defaults filled.
func samePrefixConfig(a, b scheduler.PrefixConfig) bool {
	norm := func(c scheduler.PrefixConfig) scheduler.PrefixConfig {
		if c.BlockTokens <= 0 {
			c.BlockTokens = scheduler.DefaultBlockTokens
		}
		if c.BytesPerToken <= 0 {
			c.BytesPerToken = scheduler.DefaultBytesPerToken
		}
		if c.MaxBlocks <= 0 {
			c.MaxBlocks = scheduler.DefaultMaxBlocks
		}
		return c
	}
	return norm(a) == norm(b)
}

// indexMetrics count the prefix index traffic.
type indexMetrics struct {
	bytes   *prometheus.CounterVec // by agent
	frames  *prometheus.CounterVec // by agent and type
	hashes  *prometheus.CounterVec // by agent and kind
	cutoffs *prometheus.CounterVec // by reason
	refused *prometheus.CounterVec // streams refused, by reason
	routed  prometheus.Counter
	cached  prometheus.Counter
}

func newIndexMetrics() *indexMetrics {
	return &indexMetrics{
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_prefix_update_bytes_total",
			Help: "Bytes of prefix index updates received, by agent.",
		}, []string{"agent"}),
		frames: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_prefix_updates_total",
			Help: "Prefix index messages received, by agent and type (hello, snapshot, delta).",
		}, []string{"agent", "type"}),
		hashes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_prefix_update_hashes_total",
			Help: "Block hashes received in prefix index updates, by agent and kind (added, evicted, snapshot).",
		}, []string{"agent", "kind"}),
		cutoffs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_prefix_publishers_cut_off_total",
			Help: "Agents cut off from publishing their prefix index, by reason (malformed, oversized, order, config).",
		}, []string{"reason"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_prefix_streams_refused_total",
			Help: "Prefix index streams refused, by reason (not_joined, cut_off).",
		}, []string{"reason"}),
		routed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_prefix_blocks_routed_total",
			Help: "Prompt blocks of routed requests (first attempts).",
		}),
		cached: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_prefix_blocks_cached_total",
			Help: "Prompt blocks of routed requests that the chosen agent was believed to hold (first attempts).",
		}),
	}
}

func (m *indexMetrics) collectors(s *scheduler.Scheduler) []prometheus.Collector {
	return []prometheus.Collector{m.bytes, m.frames, m.hashes, m.cutoffs, m.refused, m.routed, m.cached, indexCollector{s: s}}
}

// indexCollector exports the merged index's size at scrape time.
type indexCollector struct{ s *scheduler.Scheduler }

var (
	descIndexEntries = prometheus.NewDesc("computeflux_prefix_index_entries",
		"(block, agent) pairs in the merged prefix index.", nil, nil)
	descIndexBlocks = prometheus.NewDesc("computeflux_prefix_index_blocks",
		"Distinct blocks in the merged prefix index.", nil, nil)
	descIndexAgents = prometheus.NewDesc("computeflux_prefix_index_agents",
		"Agents with entries in the merged prefix index.", nil, nil)
	descIndexBytes = prometheus.NewDesc("computeflux_prefix_index_bytes",
		"Estimated memory of the merged prefix index.", nil, nil)
)

// Describe implements prometheus.Collector.
func (c indexCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descIndexEntries
	ch <- descIndexBlocks
	ch <- descIndexAgents
	ch <- descIndexBytes
}

// Collect implements prometheus.Collector.
func (c indexCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.IndexStats()
	ch <- prometheus.MustNewConstMetric(descIndexEntries, prometheus.GaugeValue, float64(st.Entries))
	ch <- prometheus.MustNewConstMetric(descIndexBlocks, prometheus.GaugeValue, float64(st.Blocks))
	ch <- prometheus.MustNewConstMetric(descIndexAgents, prometheus.GaugeValue, float64(st.Endpoints))
	ch <- prometheus.MustNewConstMetric(descIndexBytes, prometheus.GaugeValue, float64(st.Bytes))
}

// Label values of the per-agent index series.
var (
	indexFrameTypes = []string{"hello", "snapshot", "delta"}
	indexHashKinds  = []string{"added", "evicted", "snapshot"}
)

// forgetAgent removes agent's index series.
func (m *indexMetrics) forgetAgent(agent string) {
	m.bytes.DeleteLabelValues(agent)
	for _, t := range indexFrameTypes {
		m.frames.DeleteLabelValues(agent, t)
	}
	for _, k := range indexHashKinds {
		m.hashes.DeleteLabelValues(agent, k)
	}
}

// forget drops agent's traffic count (its registration ended).
func (x *indexService) forget(agent string) {
	x.mu.Lock()
	delete(x.traffic, agent)
	x.mu.Unlock()
}

// names returns the agents with a traffic count.
func (x *indexService) names() []string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return slices.Collect(maps.Keys(x.traffic))
}

// sweep forgets cut-offs that ended.
func (x *indexService) sweep(now time.Time) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for p, until := range x.banned {
		if !now.Before(until) {
			delete(x.banned, p)
		}
	}
}

// observePick counts a first attempt's prompt blocks and those the chosen
// agent was believed to hold.
func (m *indexMetrics) observePick(blocks, cached int) {
	if blocks > 0 {
		m.routed.Add(float64(blocks))
		m.cached.Add(float64(cached))
	}
}

// PrefixTraffic returns the bytes of prefix index updates received from
// each joined agent (by name) since it joined; nil with NoP2P.
func (r *Relay) PrefixTraffic() map[string]uint64 {
	if r.index == nil {
		return nil
	}
	r.index.mu.Lock()
	defer r.index.mu.Unlock()
	return maps.Clone(r.index.traffic)
}
