package simengine

import (
	"cmp"
	"container/heap"
	"errors"
	"fmt"
	"math"
	"time"
)

// Defaults for the zero values of EngineConfig. Together they make a cold
// 131,072-token (128K) prompt take 5.2 s of prefill (131072 / 25000) and a
// fully cached one a few milliseconds (only the last partial block and the
// new message are computed), the 3 to 8 s versus "almost none" of a KV-cache
// miss and hit on a large model.
const (
	DefaultBlockSize           = 16      // tokens per KV-cache block, as vLLM
	DefaultCacheBlocks         = 16384   // 262,144 tokens: two 128K prompts, or eight 32K chats
	DefaultPrefillTokensPerSec = 25000.0 // prompt tokens computed per second, shared by all sequences
	DefaultDecodeTimePerToken  = 10 * time.Millisecond
	DefaultDecodeTimePerSeq    = 500 * time.Microsecond // each extra running sequence slows every step
	DefaultMaxRunning          = 32                     // sequences in the batch at once
	DefaultMaxQueue            = 1024                   // waiting requests before Submit refuses more
	DefaultMaxModelLen         = 262144                 // prompt plus completion tokens
)

// EngineConfig configures an Engine. The zero value of every field means its
// default (the Default* constants).
type EngineConfig struct {
	// BlockSize is the number of tokens in one KV-cache block. Zero means 16.
	BlockSize int
	// CacheBlocks is the capacity of the prefix cache, in blocks. Zero means
	// 16,384 (262,144 tokens), enough for a handful of long conversations, so
	// eviction matters when one engine's sessions spread over many engines'
	// worth of context.
	CacheBlocks int
	// PrefillTokensPerSec is the engine's prompt throughput. Prefill is one
	// resource served first come, first served: a long cold prompt delays the
	// first token of every request admitted after it. Zero means 25,000.
	PrefillTokensPerSec float64
	// DecodeTimePerToken is the time of one decode step with one running
	// sequence. Zero means 10 ms (100 tokens/s).
	DecodeTimePerToken time.Duration
	// DecodeTimePerSeq is added to every decode step for each running
	// sequence beyond the first (continuous batching: 32 sequences step every
	// 25.5 ms with the defaults). Zero means 0.5 ms; negative means 0.
	DecodeTimePerSeq time.Duration
	// MaxRunning bounds the sequences in the batch (prefilling or decoding);
	// later requests wait in a FIFO queue. Zero means 32.
	MaxRunning int
	// MaxQueue bounds the waiting requests; Submit fails with ErrQueueFull
	// beyond it. Zero means 1,024; negative means unbounded.
	MaxQueue int
	// MaxModelLen bounds prompt plus completion tokens; Submit fails with
	// ErrContextLength beyond it. Zero means 262,144.
	MaxModelLen int
	// Seed selects the generated answers. Any value, zero included, is a
	// seed: the same seed, prompt and length always give the same answer.
	Seed uint64
}

func (c *EngineConfig) populate() {
	c.BlockSize = cmp.Or(c.BlockSize, DefaultBlockSize)
	c.CacheBlocks = cmp.Or(c.CacheBlocks, DefaultCacheBlocks)
	c.PrefillTokensPerSec = cmp.Or(c.PrefillTokensPerSec, DefaultPrefillTokensPerSec)
	c.DecodeTimePerToken = cmp.Or(c.DecodeTimePerToken, DefaultDecodeTimePerToken)
	c.DecodeTimePerSeq = max(cmp.Or(c.DecodeTimePerSeq, DefaultDecodeTimePerSeq), 0) // negative: none
	c.MaxRunning = cmp.Or(c.MaxRunning, DefaultMaxRunning)
	c.MaxQueue = cmp.Or(c.MaxQueue, DefaultMaxQueue)
	c.MaxModelLen = cmp.Or(c.MaxModelLen, DefaultMaxModelLen)
}

func (c *EngineConfig) validate() error {
	switch {
	case c.BlockSize < 1:
		return fmt.Errorf("block size %d: must be positive", c.BlockSize)
	case c.CacheBlocks < 1 || c.CacheBlocks > math.MaxInt32:
		return fmt.Errorf("cache blocks %d: must be in 1..%d", c.CacheBlocks, math.MaxInt32)
	case !(c.PrefillTokensPerSec > 0) || math.IsInf(c.PrefillTokensPerSec, 0):
		return fmt.Errorf("prefill rate %v tokens/s: must be positive and finite", c.PrefillTokensPerSec)
	case c.DecodeTimePerToken < 0:
		return fmt.Errorf("decode time per token %v: must be positive", c.DecodeTimePerToken)
	case c.MaxRunning < 1:
		return fmt.Errorf("max running %d: must be positive", c.MaxRunning)
	case c.MaxModelLen < 2:
		return fmt.Errorf("max model length %d: must be at least 2", c.MaxModelLen)
	}
	return nil
}

// Errors returned by Engine.Submit.
var (
	// ErrQueueFull means the engine already holds MaxQueue waiting requests.
	ErrQueueFull = errors.New("simengine: request queue is full")
	// ErrContextLength means prompt plus completion exceed MaxModelLen.
	ErrContextLength = errors.New("simengine: prompt and completion exceed the maximum context length")
	// ErrBadRequest means the request itself is unusable (empty prompt, no
	// tokens to generate, an ID already in the engine).
	ErrBadRequest = errors.New("simengine: bad request")
)

// Request is one generation submitted to an Engine. The engine keeps the
// pointer until the request finishes or is cancelled; callers must not
// change it meanwhile.
type Request struct {
	// ID names the request in events; unique among the engine's live requests.
	ID uint64
	// Tokens is the prompt; at least one token.
	Tokens []Token
	// Hashes optionally holds BlockHashes(nil, Tokens, BlockSize), computed
	// by the caller (for example extended turn by turn). Nil means the engine
	// hashes the prompt itself. The engine never writes into it.
	Hashes []BlockHash
	// MaxTokens is the number of tokens to generate: the simulated model
	// never stops early. At least one.
	MaxTokens int
	// Draw selects a sampled answer (a seed's, or a random draw); 0 means
	// greedy decoding: the prompt's own answer.
	Draw uint64
}

// Usage counts a request's tokens, as in OpenAI's usage object.
type Usage struct {
	PromptTokens     int
	CachedTokens     int // leading prompt tokens found in the prefix cache
	CompletionTokens int
}

// EventKind says what an Event reports.
type EventKind uint8

// Event kinds, in the order a request produces them.
const (
	// EventFirstToken: prefill finished and the first token is out. Usage
	// has CompletionTokens 1.
	EventFirstToken EventKind = iota + 1
	// EventDone: the last token is out and the request left the engine.
	EventDone
)

// String returns "first-token" or "done".
func (k EventKind) String() string {
	switch k {
	case EventFirstToken:
		return "first-token"
	case EventDone:
		return "done"
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// Event reports a step of one request at a model time.
type Event struct {
	Kind  EventKind
	At    time.Time
	ID    uint64
	Usage Usage
	// Output holds the generated tokens on EventDone (nil otherwise): a
	// client continuing the conversation appends them to its prompt.
	Output []Token
}

// Stats is a snapshot of an engine, in vLLM's terms.
type Stats struct {
	Running int // sequences in the batch (prefilling or decoding)
	Waiting int // requests in the queue
	// KVCacheUsage is the fraction of CacheBlocks that the running sequences
	// hold, clamped to 1, as vLLM's kv_cache_usage_perc: cached blocks that
	// no running sequence holds count as free.
	KVCacheUsage float64
	CachedBlocks int // blocks in the prefix cache
	CacheBlocks  int // its capacity
	// PrefixQueries and PrefixHits count prompt tokens looked up and found
	// in the prefix cache (vLLM's prefix_cache_queries and _hits).
	PrefixQueries, PrefixHits      uint64
	PromptTokens, GenerationTokens uint64
	Finished, Cancelled, Rejected  uint64
	Slowdown                       float64
}

type seqState uint8

const (
	stateWaiting seqState = iota
	statePrefill
	stateDecode
	stateGone
)

type seq struct {
	req       *Request
	hashes    []BlockHash // full blocks of the prompt
	at        []int32     // cache node of each block when last seen, or -1
	state     seqState
	cached    int
	remaining float64 // prefill tokens still to compute (statePrefill)
	startD    float64 // decode counter at the first token (stateDecode)
	target    float64 // decode counter at the last token (stateDecode)
	heapIdx   int
}

// Engine is the pure model of one inference engine: a prefix cache and a
// continuous-batching scheduler in model time. It never reads a clock or
// sleeps; every method that changes state takes the current model time, and
// time must not go backwards (an earlier time is treated as the engine's
// current time). An Engine is not safe for concurrent use.
//
// Timing. A request waits in a FIFO queue until fewer than MaxRunning
// sequences run. On admission it looks up its prompt in the prefix cache
// (at most prompt-1 tokens can hit, as in vLLM, so the last token is always
// computed) and joins the prefill FIFO, which computes uncached tokens at
// PrefillTokensPerSec, one request at a time. When its prefill ends its
// first token is out (EventFirstToken) and its prompt's full blocks enter the
// cache. Every decoding sequence then gains one token per step of
// (DecodeTimePerToken + DecodeTimePerSeq*(running-1)) * slowdown; decoding
// overlaps prefill, as with chunked prefill. After MaxTokens tokens it leaves
// (EventDone) and the full blocks of prompt plus answer enter the cache, so
// a follow-up turn that re-sends both hits them. Between two events every
// rate is constant, so the engine jumps from event to event: its cost
// depends on the number of requests, not on the number of tokens generated.
//
// Driving it. A discrete-event simulation calls Submit and Cancel at their
// model times, asks Next for the time of the engine's next event, and calls
// Advance at that time to collect the events; a server does the same against
// a scaled real clock.
type Engine struct {
	cfg      EngineConfig
	cache    *blockCache
	now      time.Time
	started  bool
	slowdown float64

	seqs     map[uint64]*seq
	waiting  []*seq // FIFO; cancelled entries stay with stateGone until popped
	nWaiting int
	prefill  []*seq // FIFO; the head is being computed
	decoding decodeHeap
	running  int
	decoded  float64 // tokens each decoding sequence has gained since start

	pending []Event
	stats   Stats

	// Scratch reused across requests so that the hot path does not
	// allocate: hint slices of finished requests, and the chain of a
	// prompt followed by its answer.
	atFree  [][]int32
	hashBuf []BlockHash
	tokBuf  []Token
}

// NewEngine returns an engine with the given configuration, its zero fields
// set to their defaults.
func NewEngine(cfg EngineConfig) (*Engine, error) {
	cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("simengine: %w", err)
	}
	return &Engine{
		cfg:      cfg,
		cache:    newBlockCache(cfg.CacheBlocks),
		slowdown: 1,
		seqs:     make(map[uint64]*seq),
	}, nil
}

// Config returns the engine's configuration with defaults filled in.
func (e *Engine) Config() EngineConfig { return e.cfg }

// Now returns the model time the engine has reached.
func (e *Engine) Now() time.Time { return e.now }

// Submit queues r at model time now. It fails with ErrQueueFull,
// ErrContextLength or ErrBadRequest (all wrapped); events it causes are
// returned by the next Advance.
func (e *Engine) Submit(now time.Time, r *Request) error {
	switch {
	case len(r.Tokens) == 0:
		return fmt.Errorf("%w: empty prompt", ErrBadRequest)
	case r.MaxTokens < 1:
		return fmt.Errorf("%w: max tokens %d: must be at least 1", ErrBadRequest, r.MaxTokens)
	case len(r.Tokens)+r.MaxTokens > e.cfg.MaxModelLen:
		return fmt.Errorf("%w: %d prompt + %d completion tokens, maximum %d",
			ErrContextLength, len(r.Tokens), r.MaxTokens, e.cfg.MaxModelLen)
	case r.Hashes != nil && len(r.Hashes) != len(r.Tokens)/e.cfg.BlockSize:
		return fmt.Errorf("%w: %d block hashes for %d tokens", ErrBadRequest, len(r.Hashes), len(r.Tokens))
	}
	if _, dup := e.seqs[r.ID]; dup {
		return fmt.Errorf("%w: request %d is already in the engine", ErrBadRequest, r.ID)
	}
	e.advanceTo(now)
	full := e.running >= e.cfg.MaxRunning || e.nWaiting > 0
	if full && e.cfg.MaxQueue >= 0 && e.nWaiting >= e.cfg.MaxQueue {
		e.stats.Rejected++
		return ErrQueueFull
	}
	s := &seq{req: r, hashes: r.Hashes, heapIdx: -1}
	if s.hashes == nil {
		s.hashes = BlockHashes(nil, r.Tokens, e.cfg.BlockSize)
	}
	e.seqs[r.ID] = s
	if full {
		e.waiting = append(e.waiting, s)
		e.nWaiting++
		return nil
	}
	e.admit(s)
	return nil
}

// Cancel removes request id at model time now, as when its client goes
// away, and frees its place in the batch or queue. Blocks it had already
// computed stay in the cache. It reports whether the request was live.
func (e *Engine) Cancel(now time.Time, id uint64) bool {
	s, ok := e.seqs[id]
	if !ok {
		return false
	}
	e.advanceTo(now)
	if s.state == stateGone { // finished while advancing
		return false
	}
	bs := e.cfg.BlockSize
	switch s.state {
	case stateWaiting:
		e.nWaiting--
	case statePrefill:
		for i, p := range e.prefill {
			if p == s {
				e.prefill = append(e.prefill[:i], e.prefill[i+1:]...)
				break
			}
		}
		done := len(s.req.Tokens) - int(math.Ceil(s.remaining))
		e.cache.touchAt(s.hashes[:done/bs], s.at[:done/bs])
		e.freeHints(s)
		e.running--
	case stateDecode:
		heap.Remove(&e.decoding, s.heapIdx)
		g := e.generated(s)
		out := answerTokens(answerWords(e.cfg.Seed, e.answerKey(s), s.req.MaxTokens))[:g]
		e.touchAnswer(s, out)
		e.stats.GenerationTokens += uint64(g)
		e.running--
	}
	s.state = stateGone
	delete(e.seqs, id)
	e.stats.Cancelled++
	e.fill()
	return true
}

// Advance moves the engine to model time now and appends to dst, in time
// order, every event up to now, including those caused by Submit, Cancel
// and SetSlowdown since the last call.
func (e *Engine) Advance(now time.Time, dst []Event) []Event {
	e.advanceTo(now)
	dst = append(dst, e.pending...)
	clear(e.pending)
	e.pending = e.pending[:0]
	return dst
}

// Next returns the model time of the engine's next event, and false when
// nothing will happen until the next Submit. A time not after Now means
// events are pending: call Advance.
func (e *Engine) Next() (time.Time, bool) {
	if len(e.pending) > 0 {
		return e.pending[0].At, true
	}
	at, _, ok := e.nextInternal()
	return at, ok
}

// SetSlowdown makes the engine factor times slower from model time now on:
// prefill and decode steps take factor times as long. 1 is normal speed;
// factors above 1e6 are refused.
func (e *Engine) SetSlowdown(now time.Time, factor float64) error {
	if !(factor > 0) || factor > maxSlowdown {
		return fmt.Errorf("simengine: slowdown %v: must be in (0, %g]", factor, float64(maxSlowdown))
	}
	e.advanceTo(now)
	e.slowdown = factor
	return nil
}

// maxSlowdown keeps event times far from time.Duration's range.
const maxSlowdown = 1e6

// Slowdown returns the current slowdown factor.
func (e *Engine) Slowdown() float64 { return e.slowdown }

// Generated returns how many tokens request id has produced by the engine's
// current time, and false when the engine no longer holds it.
func (e *Engine) Generated(id uint64) (int, bool) {
	s, ok := e.seqs[id]
	if !ok {
		return 0, false
	}
	return e.generated(s), true
}

// Lookup returns how many leading tokens of a prompt with these block
// hashes the cache holds now, without touching it (and without the
// prompt-1 limit that admission applies).
func (e *Engine) Lookup(hashes []BlockHash) int {
	return e.cache.lookup(hashes) * e.cfg.BlockSize
}

// Answer returns the tokens the engine generates for r: a deterministic
// function of the seed, the prompt and MaxTokens. Its text is AnswerText.
func (e *Engine) Answer(r *Request) []Token {
	return answerTokens(answerWords(e.cfg.Seed, e.requestKey(r, r.Hashes)^r.Draw, r.MaxTokens))
}

// AnswerText returns the text of each token of Answer(r); joined, they are
// the answer's text, which tokenizes back to Answer(r).
func (e *Engine) AnswerText(r *Request) []string {
	return answerPieces(answerWords(e.cfg.Seed, e.requestKey(r, r.Hashes)^r.Draw, r.MaxTokens))
}

// Stats returns a snapshot at the engine's current time.
func (e *Engine) Stats() Stats {
	st := e.stats
	st.Running = e.running
	st.Waiting = e.nWaiting
	st.CachedBlocks = e.cache.len()
	st.CacheBlocks = e.cfg.CacheBlocks
	st.Slowdown = e.slowdown
	bs := e.cfg.BlockSize
	held := 0
	for _, s := range e.prefill {
		held += (len(s.req.Tokens) + bs - 1) / bs
	}
	for _, s := range e.decoding {
		held += (len(s.req.Tokens) + e.generated(s) + bs - 1) / bs
	}
	st.KVCacheUsage = min(1, float64(held)/float64(e.cfg.CacheBlocks))
	return st
}

// admit moves s into the batch: cache lookup, then the prefill FIFO.
func (e *Engine) admit(s *seq) {
	n := len(s.req.Tokens)
	maxHit := (n - 1) / e.cfg.BlockSize
	s.at = e.newHints(len(s.hashes))
	hit := e.cache.lookupInto(s.hashes[:min(maxHit, len(s.hashes))], s.at)
	e.cache.touchAt(s.hashes[:hit], s.at[:hit])
	s.cached = hit * e.cfg.BlockSize
	s.remaining = float64(n - s.cached)
	s.state = statePrefill
	e.prefill = append(e.prefill, s)
	e.running++
	e.stats.PrefixQueries += uint64(n)
	e.stats.PrefixHits += uint64(s.cached)
	e.stats.PromptTokens += uint64(n)
}

// fill admits waiting requests while the batch has room.
func (e *Engine) fill() {
	for e.running < e.cfg.MaxRunning && len(e.waiting) > 0 {
		s := e.waiting[0]
		e.waiting[0] = nil
		e.waiting = e.waiting[1:]
		if s.state == stateGone {
			continue
		}
		e.nWaiting--
		e.admit(s)
	}
	if len(e.waiting) == 0 {
		e.waiting = e.waiting[:0:0] // let the backing array go
	}
}

const (
	nextNone = iota
	nextPrefill
	nextDecode
)

// stepSeconds is the current decode step time.
func (e *Engine) stepSeconds() float64 {
	n := max(e.running, 1)
	d := e.cfg.DecodeTimePerToken + time.Duration(n-1)*e.cfg.DecodeTimePerSeq
	return d.Seconds() * e.slowdown
}

func (e *Engine) prefillRate() float64 { return e.cfg.PrefillTokensPerSec / e.slowdown }

// ceilDuration converts seconds to a duration, rounding up so that an event
// is never processed before its work is done.
func ceilDuration(sec float64) time.Duration {
	if sec <= 0 {
		return 0
	}
	ns := math.Ceil(sec * 1e9)
	if ns >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(ns)
}

// nextInternal returns the time and kind of the next prefill or decode event.
func (e *Engine) nextInternal() (time.Time, int, bool) {
	var at time.Time
	kind := nextNone
	if len(e.prefill) > 0 {
		at = e.now.Add(ceilDuration(e.prefill[0].remaining / e.prefillRate()))
		kind = nextPrefill
	}
	if len(e.decoding) > 0 {
		t := e.now.Add(ceilDuration((e.decoding[0].target - e.decoded) * e.stepSeconds()))
		if kind == nextNone || t.Before(at) {
			at, kind = t, nextDecode
		}
	}
	return at, kind, kind != nextNone
}

// advanceTo processes every internal event up to now, then moves to now.
func (e *Engine) advanceTo(now time.Time) {
	if !e.started {
		e.now, e.started = now, true
	}
	for {
		at, kind, ok := e.nextInternal()
		if !ok || at.After(now) {
			break
		}
		e.progress(at)
		switch kind {
		case nextPrefill:
			e.finishPrefill(e.prefill[0])
		case nextDecode:
			e.finish(e.decoding[0])
		}
	}
	e.progress(now)
}

// progress moves model time to t at the current rates.
func (e *Engine) progress(t time.Time) {
	dt := t.Sub(e.now).Seconds()
	if dt <= 0 {
		return
	}
	if len(e.prefill) > 0 {
		e.prefill[0].remaining = max(0, e.prefill[0].remaining-dt*e.prefillRate())
	}
	if len(e.decoding) > 0 {
		e.decoded += dt / e.stepSeconds()
	}
	e.now = t
}

func (e *Engine) finishPrefill(s *seq) {
	e.prefill[0] = nil
	e.prefill = e.prefill[1:]
	if len(e.prefill) == 0 {
		e.prefill = nil
	}
	e.cache.touchAt(s.hashes, s.at)
	n := len(s.req.Tokens)
	e.pending = append(e.pending, Event{
		Kind: EventFirstToken, At: e.now, ID: s.req.ID,
		Usage: Usage{PromptTokens: n, CachedTokens: s.cached, CompletionTokens: 1},
	})
	s.state = stateDecode
	s.startD = e.decoded
	s.target = e.decoded + float64(s.req.MaxTokens-1)
	heap.Push(&e.decoding, s)
	if s.req.MaxTokens == 1 {
		e.finish(s)
	}
}

func (e *Engine) finish(s *seq) {
	heap.Remove(&e.decoding, s.heapIdx)
	e.running--
	out := answerTokens(answerWords(e.cfg.Seed, e.answerKey(s), s.req.MaxTokens))
	e.touchAnswer(s, out)
	n := len(s.req.Tokens)
	e.pending = append(e.pending, Event{
		Kind: EventDone, At: e.now, ID: s.req.ID,
		Usage:  Usage{PromptTokens: n, CachedTokens: s.cached, CompletionTokens: len(out)},
		Output: out,
	})
	e.stats.GenerationTokens += uint64(len(out))
	e.stats.Finished++
	s.state = stateGone
	delete(e.seqs, s.req.ID)
	e.fill()
}

// touchAnswer caches the full blocks of s's prompt followed by out, and
// gives s's hints back for reuse.
func (e *Engine) touchAnswer(s *seq, out []Token) {
	e.hashBuf = e.extendHashes(e.hashBuf[:0], s, out)
	at := s.at[:len(s.hashes)]
	for range e.hashBuf {
		at = append(at, -1)
	}
	s.at = at
	e.cache.touchChain(s.hashes, e.hashBuf, at)
	e.freeHints(s)
}

// maxFreeHints bounds the hint slices an engine keeps for reuse.
const maxFreeHints = 64

// newHints returns a slice of n hints, all -1 (no node known).
func (e *Engine) newHints(n int) []int32 {
	var at []int32
	if k := len(e.atFree); k > 0 {
		at = e.atFree[k-1]
		e.atFree[k-1] = nil
		e.atFree = e.atFree[:k-1]
	}
	if cap(at) < n {
		// Room for the answer's blocks too, and for a longer prompt
		// next time (a conversation grows turn by turn).
		at = make([]int32, n, n+n/2+16)
	}
	at = at[:n]
	for i := range at {
		at[i] = -1
	}
	return at
}

// freeHints takes s's hint slice back for reuse.
func (e *Engine) freeHints(s *seq) {
	if s.at != nil && len(e.atFree) < maxFreeHints {
		e.atFree = append(e.atFree, s.at[:0])
	}
	s.at = nil
}

// generated returns the tokens s has produced so far.
func (e *Engine) generated(s *seq) int {
	if s.state != stateDecode {
		return 0
	}
	g := 1 + int(math.Floor(e.decoded-s.startD+1e-9))
	return min(g, s.req.MaxTokens)
}

// answerKey identifies s's prompt for answer generation.
func (e *Engine) answerKey(s *seq) uint64 { return e.requestKey(s.req, s.hashes) ^ s.req.Draw }

func (e *Engine) requestKey(r *Request, hashes []BlockHash) uint64 {
	if hashes == nil {
		hashes = BlockHashes(nil, r.Tokens, e.cfg.BlockSize)
	}
	parent := rootHash
	if len(hashes) > 0 {
		parent = hashes[len(hashes)-1]
	}
	tail := r.Tokens[len(hashes)*e.cfg.BlockSize:]
	return uint64(chainHash(parent, tail)) ^ uint64(len(r.Tokens))
}

// extendHashes appends to dst the hashes of the full blocks that out adds
// to s's prompt, without copying the prompt or writing into s.hashes.
func (e *Engine) extendHashes(dst []BlockHash, s *seq, out []Token) []BlockHash {
	bs := e.cfg.BlockSize
	tail := s.req.Tokens[len(s.hashes)*bs:]
	if len(tail)+len(out) < bs {
		return dst
	}
	buf := append(append(e.tokBuf[:0], tail...), out...)
	e.tokBuf = buf
	parent := rootHash
	if len(s.hashes) > 0 {
		parent = s.hashes[len(s.hashes)-1]
	}
	for i := 0; i+bs <= len(buf); i += bs {
		parent = chainHash(parent, buf[i:i+bs])
		dst = append(dst, parent)
	}
	return dst
}

// decodeHeap orders decoding sequences by the decode counter at which they
// finish.
type decodeHeap []*seq

func (h decodeHeap) Len() int           { return len(h) }
func (h decodeHeap) Less(i, j int) bool { return h[i].target < h[j].target }
func (h decodeHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx, h[j].heapIdx = i, j
}
func (h *decodeHeap) Push(x any) {
	s := x.(*seq)
	s.heapIdx = len(*h)
	*h = append(*h, s)
}
func (h *decodeHeap) Pop() any {
	old := *h
	s := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	s.heapIdx = -1
	return s
}
