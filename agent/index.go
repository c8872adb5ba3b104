package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// Defaults for the zero values of IndexConfig.
const (
	// DefaultKVCapacityTokens sizes the index when the engine publishes no
	// capacity and none is configured: the simulated engine's default
	// cache (16,384 blocks of 16 tokens).
	DefaultKVCapacityTokens = 262144
	// DefaultPublishInterval is how often index changes are sent.
	DefaultPublishInterval = 100 * time.Millisecond
	// DefaultPublishHashes sends changes early once this many are pending.
	DefaultPublishHashes = 2048
	// DefaultIndexQueueBytes bounds the frames queued for one relay; beyond
	// it the queue is dropped and a snapshot follows.
	DefaultIndexQueueBytes = 4 << 20
)

// IndexConfig configures the agent's prefix index: which prompt blocks its
// engine likely holds, published to every relay it joined so that keyless
// requests sharing a prefix are routed to it. The zero value publishes it,
// with the defaults below.
type IndexConfig struct {
	// Disabled turns the index off: the agent publishes nothing.
	Disabled bool
	// Prefix is how prompts are cut into blocks; it must equal the
	// relays' (they refuse a publisher whose configuration differs). The
	// zero value is scheduler's default, as the relay's.
	Prefix scheduler.PrefixConfig
	// KVCapacityTokens is the engine's KV-cache capacity in tokens. Zero
	// means the engine's own figure (Agent.KVCapacityTokens) when it
	// reports one, else DefaultKVCapacityTokens.
	KVCapacityTokens int
	// PublishInterval is how often changes are sent. Zero means
	// DefaultPublishInterval.
	PublishInterval time.Duration
	// PublishHashes sends changes before the interval once this many are
	// pending. Zero means DefaultPublishHashes.
	PublishHashes int
	// QueueBytes bounds the frames waiting for one relay. Zero means
	// DefaultIndexQueueBytes.
	QueueBytes int
}

func (c *IndexConfig) fill() {
	if c.PublishInterval <= 0 {
		c.PublishInterval = DefaultPublishInterval
	}
	if c.PublishHashes <= 0 {
		c.PublishHashes = DefaultPublishHashes
	}
	if c.QueueBytes <= 0 {
		c.QueueBytes = DefaultIndexQueueBytes
	}
}

// IndexStats describes the agent's prefix index and what it published.
type IndexStats struct {
	// Blocks is the number of blocks held; Capacity the index's size in
	// blocks (corrections move it).
	Blocks, Capacity int
	// CapacityTokens is the engine capacity the index was sized from.
	CapacityTokens int
	// Corrections counts answers whose cached_tokens showed fewer cached
	// blocks than the index held.
	Corrections uint64
	// Frames and Bytes count what was written to relays (all of them).
	Frames, Bytes uint64
	// Snapshots counts snapshots sent (each may take several frames).
	Snapshots uint64
	// Relays is the number of relays being published to.
	Relays int
}

// errIndexRejected ends publishing to a relay that refused it, until the
// next registration.
var errIndexRejected = errors.New("the relay refused our prefix index")

// prefixIndex is the agent's index and its publication to relays.
type prefixIndex struct {
	cfg  IndexConfig
	log  zerolog.Logger
	kick chan struct{} // capacity 1: flush now

	frames, bytes, snapshots, corrections atomic.Uint64

	mu       sync.Mutex // guards the following fields
	lru      *scheduler.BlockLRU
	capTok   int                 // capacity in tokens the LRU was sized from
	pending  map[uint64]struct{} // hashes changed since the last flush
	streams  map[*indexStream]struct{}
	scratchA []uint64
	scratchE []uint64
	snapBuf  []uint64
	// The first answers measure the prompts' bytes per engine token, to
	// size the index in blocks from a capacity in tokens.
	samples, sampleBytes, sampleTokens int
	bytesPerToken                      float64 // 0 until measured
}

func newPrefixIndex(cfg IndexConfig, log zerolog.Logger) *prefixIndex {
	cfg.fill()
	x := &prefixIndex{
		cfg:     cfg,
		log:     log,
		kick:    make(chan struct{}, 1),
		pending: make(map[uint64]struct{}),
		streams: make(map[*indexStream]struct{}),
	}
	tokens := cfg.KVCapacityTokens
	if tokens <= 0 {
		tokens = DefaultKVCapacityTokens
	}
	x.lru = scheduler.NewBlockLRU(x.blocksFor(tokens))
	x.capTok = tokens
	return x
}

// calibrationAnswers is how many answers measure bytes per token.
const calibrationAnswers = 32

// blocksFor converts a capacity in tokens to index blocks, within what a
// relay keeps of one agent: tokens of the block size, or, once measured,
// the bytes those tokens take in prompts over the block's bytes (the
// engine's tokenizer need not give the block size's bytes per token).
func (x *prefixIndex) blocksFor(tokens int) int {
	n := tokens / x.blockTokens()
	if x.bytesPerToken > 0 {
		n = int(float64(tokens) * x.bytesPerToken / float64(x.cfg.Prefix.BlockBytes()))
	}
	return min(max(n, 1), scheduler.MaxEndpointBlocks)
}

func (x *prefixIndex) blockTokens() int {
	if bt := x.cfg.Prefix.BlockTokens; bt > 0 {
		return bt
	}
	return scheduler.DefaultBlockTokens
}

// calibrateLocked adds an answer's prompt to the bytes-per-token measure
// and resizes the index once it is complete.
func (x *prefixIndex) calibrateLocked(chainLen, promptTokens int) {
	maxBlocks := x.cfg.Prefix.MaxBlocks
	if maxBlocks <= 0 {
		maxBlocks = scheduler.DefaultMaxBlocks
	}
	if x.samples >= calibrationAnswers || chainLen == 0 || chainLen >= maxBlocks || promptTokens <= 0 {
		return // a capped chain does not measure its prompt
	}
	x.samples++
	// A chain of n full blocks stands for about n+½ blocks of prompt.
	x.sampleBytes += (2*chainLen + 1) * x.cfg.Prefix.BlockBytes() / 2
	x.sampleTokens += promptTokens
	if x.samples < calibrationAnswers {
		return
	}
	x.bytesPerToken = float64(x.sampleBytes) / float64(x.sampleTokens)
	x.scratchE = x.lru.SetCapacity(x.blocksFor(x.capTok), x.scratchE[:0])
	x.touchLocked(x.scratchE)
	x.log.Info().Float64("bytes_per_token", x.bytesPerToken).Int("blocks", x.lru.Capacity()).Msg("prefix index resized from measured prompts")
}

// setCapacity resizes the index for an engine capacity of tokens.
func (x *prefixIndex) setCapacity(tokens int) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if tokens <= 0 || tokens == x.capTok {
		return
	}
	x.capTok = tokens
	x.scratchE = x.lru.SetCapacity(x.blocksFor(tokens), x.scratchE[:0])
	x.touchLocked(x.scratchE)
	x.log.Info().Int("kv_capacity_tokens", tokens).Int("blocks", x.lru.Capacity()).Msg("prefix index sized from the engine")
}

// touchLocked records hashes whose presence changed.
func (x *prefixIndex) touchLocked(hs []uint64) {
	for _, h := range hs {
		x.pending[h] = struct{}{}
	}
	if len(x.pending) >= x.cfg.PublishHashes {
		x.kickFlush()
	}
}

func (x *prefixIndex) kickFlush() {
	select {
	case x.kick <- struct{}{}:
	default:
	}
}

// served records that the engine took a request of chain (it holds the
// prompt's blocks now). It returns the index's prediction for the request,
// to be handed to answered.
func (x *prefixIndex) served(chain []uint64) (predicted int) {
	if len(chain) == 0 {
		return scheduler.NoPrediction
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	predicted, x.scratchA, x.scratchE = x.lru.Insert(chain, x.scratchA[:0], x.scratchE[:0])
	x.touchLocked(x.scratchA)
	x.touchLocked(x.scratchE)
	return predicted
}

// answered corrects the index from the engine's usage for a request of
// chain: promptTokens of which cachedTokens were cached. predicted is what
// served returned for the request.
func (x *prefixIndex) answered(chain []uint64, predicted, promptTokens, cachedTokens int) {
	if len(chain) == 0 || promptTokens <= 0 {
		return
	}
	cached := scheduler.CachedBlocks(len(chain), promptTokens, cachedTokens)
	x.mu.Lock()
	defer x.mu.Unlock()
	x.calibrateLocked(len(chain), promptTokens)
	before := x.lru.Capacity()
	x.scratchE = x.lru.Correct(chain, predicted, cached, x.scratchE[:0])
	if len(x.scratchE) > 0 || x.lru.Capacity() != before {
		x.corrections.Add(1)
	}
	x.touchLocked(x.scratchE)
}

// stats returns the index's figures.
func (x *prefixIndex) stats() IndexStats {
	x.mu.Lock()
	st := IndexStats{Blocks: x.lru.Len(), Capacity: x.lru.Capacity(), CapacityTokens: x.capTok, Relays: len(x.streams)}
	x.mu.Unlock()
	st.Corrections, st.Frames, st.Bytes, st.Snapshots = x.corrections.Load(), x.frames.Load(), x.bytes.Load(), x.snapshots.Load()
	return st
}

// flushLoop publishes pending changes every PublishInterval, or sooner when
// kicked, until ctx ends.
func (x *prefixIndex) flushLoop(ctx context.Context) {
	t := time.NewTicker(x.cfg.PublishInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-x.kick:
		}
		x.flush()
	}
}

// flush turns the pending changes into one delta per relay (a snapshot for
// a relay that needs one) and queues it.
func (x *prefixIndex) flush() {
	x.mu.Lock()
	defer x.mu.Unlock()
	added, evicted := x.scratchA[:0], x.scratchE[:0]
	// Only the final state of a hash matters: relays apply idempotent
	// adds and removes, and the LRU knows which it is now.
	for h := range x.pending {
		if x.lru.Contains(h) {
			added = append(added, h)
		} else {
			evicted = append(evicted, h)
		}
	}
	clear(x.pending)
	x.scratchA, x.scratchE = added, evicted
	for st := range x.streams {
		st.mu.Lock()
		if st.snap {
			st.snap = false
			st.queue, st.queued = st.queue[:0], 0
			x.snapBuf = x.lru.Snapshot(x.snapBuf[:0])
			st.enqueueSnapshot(x.snapBuf)
			x.snapshots.Add(1)
		} else if len(added)+len(evicted) > 0 {
			st.enqueueDelta(added, evicted)
		}
		if st.queued > x.cfg.QueueBytes {
			// The relay does not keep up: what is queued is obsolete once
			// a snapshot replaces it.
			st.queue, st.queued = st.queue[:0], 0
			st.snap = true
			x.kickFlush()
		}
		st.mu.Unlock()
		st.wakeWriter()
	}
}

// indexStream is the publication to one relay.
type indexStream struct {
	relay peer.ID
	s     network.Stream
	wake  chan struct{} // capacity 1

	mu     sync.Mutex // guards the following fields
	queue  [][]byte   // frames to write
	queued int        // their bytes
	snap   bool       // the next flush sends a snapshot
	seq    uint64     // the last seq queued
}

func (st *indexStream) wakeWriter() {
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// enqueueSnapshot queues hs as snapshot parts. Called with st.mu held.
func (st *indexStream) enqueueSnapshot(hs []uint64) {
	first := true
	for {
		n := min(len(hs), transport.PrefixMaxHashes)
		st.seq++
		m := transport.PrefixMsg{Type: transport.PrefixSnapshot, Seq: st.seq, First: first, Last: n == len(hs), Added: hs[:n]}
		st.push(&m)
		hs, first = hs[n:], false
		if len(hs) == 0 {
			return
		}
	}
}

// enqueueDelta queues added and evicted as deltas. Called with st.mu held.
func (st *indexStream) enqueueDelta(added, evicted []uint64) {
	for len(added)+len(evicted) > 0 {
		ne := min(len(evicted), transport.PrefixMaxHashes)
		na := min(len(added), transport.PrefixMaxHashes-ne)
		st.seq++
		m := transport.PrefixMsg{Type: transport.PrefixDelta, Seq: st.seq, Evicted: evicted[:ne], Added: added[:na]}
		st.push(&m)
		added, evicted = added[na:], evicted[ne:]
	}
}

func (st *indexStream) push(m *transport.PrefixMsg) {
	b, err := transport.AppendPrefixFrame(nil, m)
	if err != nil {
		// Cannot happen for messages built above; a gap makes the relay
		// resynchronise rather than trust a partial picture.
		st.snap = true
		return
	}
	st.queue = append(st.queue, b)
	st.queued += len(b)
}

// indexWriteTimeout bounds one write to a relay.
const indexWriteTimeout = 10 * time.Second

// publishIndex publishes the index to relay while ctx lasts (the agent's
// registration with it), reopening the stream after failures. A relay that
// refuses the publisher is left alone until ctx ends.
func (a *Agent) publishIndex(ctx context.Context, h host.Host, relay peer.ID) {
	backoff := a.cfg.MinBackoff
	for ctx.Err() == nil {
		start := time.Now()
		err := a.index.publish(ctx, h, relay)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errIndexRejected) {
			a.log.Warn().Err(err).Str("relay", relay.String()).Msg("prefix index not published to this relay until the next join")
			return
		}
		if time.Since(start) > a.cfg.MaxBackoff {
			backoff = a.cfg.MinBackoff
		}
		a.log.Debug().Err(err).Str("relay", relay.String()).Dur("retry_in", backoff).Msg("prefix index stream ended")
		select {
		case <-ctx.Done():
			return
		case <-time.After(jitter(backoff)):
		}
		backoff = min(2*backoff, a.cfg.MaxBackoff)
	}
}

// publish runs one stream to relay: hello, snapshot, then deltas, until
// the stream fails or ctx ends.
func (x *prefixIndex) publish(ctx context.Context, h host.Host, relay peer.ID) error {
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	s, err := h.NewStream(sctx, relay, transport.PrefixProtocol)
	cancel()
	if err != nil {
		return fmt.Errorf("open prefix index stream: %w", err)
	}
	x.mu.Lock()
	hello := transport.PrefixMsg{
		Type: transport.PrefixHello, BlockTokens: x.cfg.Prefix.BlockTokens, BytesPerToken: x.cfg.Prefix.BytesPerToken,
		MaxBlocks: x.cfg.Prefix.MaxBlocks, CapacityBlocks: x.lru.Capacity(),
	}
	x.mu.Unlock()
	b, err := transport.AppendPrefixFrame(nil, &hello)
	if err == nil {
		// The hello goes first, before the stream can get a snapshot.
		_ = s.SetWriteDeadline(time.Now().Add(indexWriteTimeout))
		_, err = s.Write(b)
	}
	if err != nil {
		_ = s.Reset()
		return fmt.Errorf("prefix index hello: %w", err)
	}
	x.frames.Add(1)
	x.bytes.Add(uint64(len(b)))
	st := &indexStream{relay: relay, s: s, wake: make(chan struct{}, 1), snap: true}
	x.mu.Lock()
	x.streams[st] = struct{}{}
	x.mu.Unlock()
	defer func() {
		x.mu.Lock()
		delete(x.streams, st)
		x.mu.Unlock()
	}()
	x.kickFlush()

	var rerr error
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		rerr = x.readRelay(st)
	}()
	werr := x.writeLoop(ctx, st, readDone)
	// Whatever ended it, nothing more is sent: a relay that stays keeps the
	// entries only while the stream lives.
	_ = s.Reset()
	<-readDone
	if werr == nil || errors.Is(werr, errReaderEnded) {
		werr = rerr
	}
	return werr
}

// errReaderEnded is writeLoop's answer when the reading side ended first.
var errReaderEnded = errors.New("relay closed the prefix index stream")

// writeLoop writes st's queued frames until ctx ends, a write fails or the
// reading side ends.
func (x *prefixIndex) writeLoop(ctx context.Context, st *indexStream, readDone <-chan struct{}) error {
	var out []byte
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-readDone:
			return errReaderEnded
		case <-st.wake:
		}
		st.mu.Lock()
		out = out[:0]
		for _, f := range st.queue {
			out = append(out, f...)
		}
		n := len(st.queue)
		st.queue, st.queued = st.queue[:0], 0
		st.mu.Unlock()
		if len(out) == 0 {
			continue
		}
		_ = st.s.SetWriteDeadline(time.Now().Add(indexWriteTimeout))
		if _, err := st.s.Write(out); err != nil {
			return fmt.Errorf("write prefix index: %w", err)
		}
		x.frames.Add(uint64(n))
		x.bytes.Add(uint64(len(out)))
	}
}

// readRelay reads the relay's messages: a resync asks for a snapshot; a
// reject ends publishing.
func (x *prefixIndex) readRelay(st *indexStream) error {
	pr := transport.NewPrefixReader(st.s)
	var m transport.PrefixMsg
	for {
		if _, err := pr.Next(&m); err != nil {
			return err
		}
		switch m.Type {
		case transport.PrefixResync:
			st.mu.Lock()
			st.snap = true
			st.mu.Unlock()
			x.kickFlush()
		case transport.PrefixReject:
			return fmt.Errorf("%w: %s", errIndexRejected, m.Reason)
		default:
			return fmt.Errorf("%w: unexpected %s from the relay", transport.ErrPrefixMalformed, m.Type)
		}
	}
}

// IndexStats returns the prefix index's figures; zero when it is disabled.
func (a *Agent) IndexStats() IndexStats {
	if a.index == nil {
		return IndexStats{}
	}
	return a.index.stats()
}

// startPublishing publishes the index to relay until the returned function
// is called (it waits for the publisher to stop).
func (a *Agent) startPublishing(ctx context.Context, h host.Host, relay peer.ID) (stop func()) {
	if a.index == nil {
		return func() {}
	}
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.publishIndex(pctx, h, relay)
	}()
	return func() {
		cancel()
		<-done
	}
}

// refreshKVCapacity sizes the index from the engine's KV capacity (what its
// identification and load figures found, KVCapacityTokens), unless it is
// configured; an unknown capacity leaves the index its size
// (DefaultKVCapacityTokens at first). Called by refresh only.
func (a *Agent) refreshKVCapacity() {
	if a.index == nil || a.cfg.Index.KVCapacityTokens > 0 {
		return
	}
	a.index.setCapacity(a.KVCapacityTokens())
}
