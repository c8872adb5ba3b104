package ledger

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// Defaults for the zero values of Config.
const (
	DefaultFlushInterval    = 2 * time.Second
	DefaultHourlyRetention  = 90 * 24 * time.Hour  // then daily rows only
	DefaultDailyRetention   = 730 * 24 * time.Hour // two years of daily rows
	DefaultMaxModelsPerHour = 1000                 // distinct model names per hour; more fold into Other
	DefaultMaxRowsPerHour   = 20_000               // rows per kind and hour in memory; more fold into Other
	DefaultMaxPendingRows   = 200_000              // rows waiting for a flush (~40 MB); past it counts are dropped
	DefaultMaxNames         = 100_000              // distinct names the file keeps; more are stored as Other
	DefaultMaxFileBytes     = 1 << 30              // the file stops growing here (writes fail, loudly)
)

// Config configures a Ledger. The zero value of every field but Path (or
// Store) means its default.
type Config struct {
	// Path is the ledger's bbolt file, created if missing. Required unless
	// Store is set.
	Path string
	// Store, if set, keeps the rows instead of a bbolt file at Path; the
	// Ledger closes it. Nil means OpenBolt(Path, MaxNames, MaxFileBytes).
	Store Store
	// FlushInterval is how often pending counts are written: what a
	// SIGKILL may lose. Zero means 2 s.
	FlushInterval time.Duration
	// HourlyRetention is how long hourly rows are kept; daily rows cover
	// older times. Zero means 90 days.
	HourlyRetention time.Duration
	// DailyRetention is how long daily rows are kept. Zero means 2 years.
	DailyRetention time.Duration
	// MaxModelsPerHour caps the distinct model names counted in one hour.
	// Zero means 1,000.
	MaxModelsPerHour int
	// MaxRowsPerHour caps the rows of one kind for one hour in memory.
	// Zero means 20,000.
	MaxRowsPerHour int
	// MaxPendingRows caps the rows waiting for a flush (while the file
	// cannot be written they pile up); past it, counts are dropped and
	// Health says how many. Zero means 200,000.
	MaxPendingRows int
	// MaxNames caps the distinct names the file keeps. Zero means 100,000.
	MaxNames int
	// MaxFileBytes caps the file's size. Zero means 1 GiB.
	MaxFileBytes int
	// FailClosed refuses the requests of clients with a budget while the
	// ledger cannot count (Health not OK). False, the default, serves them
	// on what the ledger counted in memory.
	FailClosed bool
	// Now is the clock. Nil means time.Now.
	Now func() time.Time
	// Logger receives the ledger's lifecycle and fault lines. The zero
	// value discards them.
	Logger zerolog.Logger
}

func (c Config) populate() Config {
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	defInt := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.FlushInterval, DefaultFlushInterval)
	def(&c.HourlyRetention, DefaultHourlyRetention)
	def(&c.DailyRetention, DefaultDailyRetention)
	defInt(&c.MaxModelsPerHour, DefaultMaxModelsPerHour)
	defInt(&c.MaxRowsPerHour, DefaultMaxRowsPerHour)
	defInt(&c.MaxPendingRows, DefaultMaxPendingRows)
	defInt(&c.MaxNames, DefaultMaxNames)
	defInt(&c.MaxFileBytes, DefaultMaxFileBytes)
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

func (c Config) validate() error {
	var errs []error
	if c.Path == "" && c.Store == nil {
		errs = append(errs, errors.New("no Path for the ledger file"))
	}
	if c.FlushInterval < 0 || c.HourlyRetention < time.Hour || c.DailyRetention < c.HourlyRetention {
		errs = append(errs, errors.New("FlushInterval must not be negative, HourlyRetention at least 1h, DailyRetention at least HourlyRetention"))
	}
	if c.MaxModelsPerHour < 1 || c.MaxRowsPerHour < 1 || c.MaxPendingRows < 1 || c.MaxNames < 2 || c.MaxFileBytes < 0 {
		errs = append(errs, errors.New("caps must be positive (MaxNames at least 2)"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("ledger config: %w", err)
	}
	return nil
}

// Health is the ledger's state, to log, count and show.
type Health struct {
	// OK is false while the file cannot be read or written; then counts
	// wait in memory and budgets fail open or closed (FailClosed).
	OK bool `json:"ok"`
	// Error is the last failure while not OK.
	Error string `json:"error,omitempty"`
	// Since is when the trouble began, while not OK.
	Since *time.Time `json:"since,omitempty"`
	// FailClosed is the operator's choice for budgets while not OK.
	FailClosed bool `json:"fail_closed"`
	// LastFlush is the last successful flush.
	LastFlush *time.Time `json:"last_flush,omitempty"`
	// FailedFlushes counts flushes that failed since the start.
	FailedFlushes uint64 `json:"failed_flushes"`
	// Recorded counts the requests recorded since the start, and
	// FlushedRequests those of them now in the file.
	Recorded        uint64 `json:"recorded"`
	FlushedRequests uint64 `json:"flushed_requests"`
	// PendingRows are the rows in memory.
	PendingRows int64 `json:"pending_rows"`
	// Folded counts requests counted under Other by a cap; Dropped row
	// updates lost because MaxPendingRows was reached.
	Folded  uint64 `json:"folded"`
	Dropped uint64 `json:"dropped"`
}

// Ledger records usage and answers for it. Its methods are safe for
// concurrent use.
type Ledger struct {
	cfg    Config
	log    zerolog.Logger
	acc    *accumulator
	store  Store
	prices atomic.Pointer[map[string]Prices]
	ok     atomic.Bool // Health.OK, for the request path

	// viewMu orders flushes and queries: a flush holds it for writing
	// from taking the deltas to their commit, so a query never sees them
	// in both places or in neither.
	viewMu    sync.RWMutex
	ready     bool    // the file's totals are loaded (viewMu)
	seq       uint64  // the last batch number used (viewMu)
	carry     *batch  // a batch whose commit failed, to retry first (viewMu)
	buf       []Delta // reused between flushes (viewMu)
	sealedAt  int64   // the hour of the last seal and prune (viewMu)
	healthMu  sync.Mutex
	health    Health // guarded by healthMu
	peersMu   sync.RWMutex
	peers     map[string]map[string]Spent // guarded by peersMu
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
	closeErr  error
}

type batch struct {
	seq    uint64
	deltas []Delta
}

// Open starts a ledger: it opens the file, loads the totals of the current
// day and month for budgets, and starts the flusher. It fails only for a
// bad Config: a file that cannot be opened leaves a Ledger that counts in
// memory and retries the file every flush interval, with Health saying
// why (and a log line at error level).
func Open(cfg Config) (*Ledger, error) {
	cfg = cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	l := &Ledger{
		cfg:   cfg,
		log:   cfg.Logger.With().Str("component", "ledger").Logger(),
		acc:   newAccumulator(cfg.MaxModelsPerHour, cfg.MaxRowsPerHour, cfg.MaxPendingRows),
		store: cfg.Store,
		peers: map[string]map[string]Spent{},
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
	}
	l.prices.Store(&map[string]Prices{})
	l.health.FailClosed = cfg.FailClosed
	l.acc.curHour.Store(hourOf(cfg.Now()))
	if l.store == nil {
		// An error leaves the store to open again at the next flush.
		l.store, _ = OpenBolt(cfg.Path, cfg.MaxNames, cfg.MaxFileBytes)
	}
	_ = l.Flush()
	go l.run()
	return l, nil
}

func (l *Ledger) run() {
	defer close(l.done)
	t := time.NewTicker(l.cfg.FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-t.C:
			_ = l.Flush()
		}
	}
}

// Close stops the flusher, flushes what is pending and closes the store.
// It is safe to call more than once. Records after Close are not written.
func (l *Ledger) Close() error {
	l.closeOnce.Do(func() {
		close(l.stop)
		<-l.done
		err := l.Flush()
		l.closeErr = errors.Join(err, l.store.Close())
	})
	return l.closeErr
}

// Record adds one answered request. It takes well under a microsecond and
// allocates nothing once the rows of its client, agent or provider and
// model exist in the current hour. An Entry's Time more than a day away
// from the ledger's clock (or zero) counts at the clock's time.
func (l *Ledger) Record(e Entry) {
	e.PromptTokens = max(e.PromptTokens, 0)
	e.CompletionTokens = max(e.CompletionTokens, 0)
	e.CachedTokens = min(max(e.CachedTokens, 0), e.PromptTokens)
	e.Serving = max(e.Serving, 0)
	// The flusher keeps curHour within a flush interval of the clock; an
	// Entry far from it is not the answer's time (and must not open caps
	// for hours long gone or to come).
	if cur, h := l.acc.curHour.Load(), hourOf(e.Time); h < cur-hoursPerDay || h > cur+hoursPerDay {
		e.Time = l.cfg.Now()
	}
	var cost, saved Money
	if e.Provider != "" {
		if p, ok := (*l.prices.Load())[e.Provider]; ok {
			cost, saved = p.Cost(e.PromptTokens, e.CachedTokens, e.CompletionTokens)
		}
	}
	l.acc.record(&e, cost, saved)
}

// SetPrices sets the prices per provider endpoint name, for the requests
// recorded from now on (an endpoints file reload calls it again).
func (l *Ledger) SetPrices(p map[string]Prices) {
	m := make(map[string]Prices, len(p))
	for k, v := range p {
		m[k] = v
	}
	l.prices.Store(&m)
}

// Spent returns what client used in now's UTC day and month through this
// relay, flushed or not (peers' use is not in it).
func (l *Ledger) Spent(client string, now time.Time) Spent { return l.acc.spentOf(client, now) }

// AppendSpent appends every client's Spent at now with anything spent in
// now's month: what a relay tells its peers.
func (l *Ledger) AppendSpent(dst []ClientSpent, now time.Time) []ClientSpent {
	return l.acc.appendSpent(dst, now)
}

// SetPeer replaces what peer relay peer reported as its clients' use;
// Check adds it to the relay's own.
func (l *Ledger) SetPeer(peer string, spent []ClientSpent) {
	m := make(map[string]Spent, len(spent))
	for _, s := range spent {
		m[s.Client] = s.Spent
	}
	l.peersMu.Lock()
	l.peers[peer] = m
	l.peersMu.Unlock()
}

// ClaimAgent records owner (an agent's peer ID) as the identity of the
// agent name, unless another identity served under the name first, and
// returns the name's owner: only the owner may read the name's history
// (the relay's `computeflux agent usage`). The claim lasts as long as the
// file. The file holds at most Config.MaxNames claims; past that a new
// name stays unclaimed and the owner returned is "" (nobody's).
func (l *Ledger) ClaimAgent(agent, owner string) (string, error) {
	return l.store.Claim(agent, owner)
}

// MergePeer updates what peer relay peer reported, client by client: a
// report too large for one message comes in parts. A peer's report holds
// at most MaxPeerClients clients; further new ones are dropped.
func (l *Ledger) MergePeer(peer string, spent []ClientSpent) {
	l.peersMu.Lock()
	defer l.peersMu.Unlock()
	m := l.peers[peer]
	if m == nil {
		m = make(map[string]Spent, len(spent))
		l.peers[peer] = m
	}
	for _, s := range spent {
		if _, ok := m[s.Client]; ok || len(m) < MaxPeerClients {
			m[s.Client] = s.Spent
		}
	}
}

// MaxPeerClients bounds the clients a peer relay's report holds.
const MaxPeerClients = 100_000

// ForgetPeer drops a peer relay's report.
func (l *Ledger) ForgetPeer(peer string) {
	l.peersMu.Lock()
	delete(l.peers, peer)
	l.peersMu.Unlock()
}

// Check says whether client, with budget b, may start a request at now:
// its own use (Spent) plus its peers' (SetPeer) against b. While the
// ledger cannot count (Health not OK) and Config.FailClosed is set, every
// client with a budget is refused with LimitUnavailable. It allocates
// nothing.
func (l *Ledger) Check(client string, b Budget, now time.Time) Verdict {
	if b.Unlimited() {
		return Verdict{}
	}
	if l.cfg.FailClosed && !l.ok.Load() {
		return Verdict{Over: true, Limit: LimitUnavailable, Reset: now.Add(unavailableRetry)}
	}
	d, m := dayOf(now), monthOf(now)
	used := l.acc.spentRaw(client).in(d, m)
	l.peersMu.RLock()
	for _, p := range l.peers {
		if s, ok := p[client]; ok {
			used = used.plus(s, d, m)
		}
	}
	l.peersMu.RUnlock()
	return check(b, used)
}

// Health returns the ledger's state.
func (l *Ledger) Health() Health {
	l.healthMu.Lock()
	h := l.health
	l.healthMu.Unlock()
	h.Recorded = l.acc.recorded.Load()
	h.PendingRows = l.acc.rows.Load()
	h.Folded = l.acc.folded.Load()
	h.Dropped = l.acc.dropped.Load()
	return h
}

// Flush writes the pending counts now, as the flusher does every
// FlushInterval, and seals and prunes old rows once an hour.
func (l *Ledger) Flush() error {
	l.viewMu.Lock()
	defer l.viewMu.Unlock()
	now := l.cfg.Now()
	cur := hourOf(now)
	l.acc.curHour.Store(cur)
	err := l.flush(now, cur)
	if err == nil && l.sealedAt != cur {
		// Once an hour: pack the hours (and days) gone by, and drop the
		// rows past their retention.
		err = l.store.Seal(cur)
		if err == nil {
			err = l.store.Prune(cur-int64(l.cfg.HourlyRetention/time.Hour), dayOf(now)-int64(l.cfg.DailyRetention/(24*time.Hour)))
		}
		if err == nil {
			l.sealedAt = cur
		}
	}
	l.report(now, err)
	return err
}

// flush loads the file's totals if not done yet, retries a failed batch,
// then commits the pending deltas. l.viewMu is held.
func (l *Ledger) flush(now time.Time, cur int64) error {
	if !l.ready {
		if err := l.load(now); err != nil {
			return err
		}
	}
	if b := l.carry; b != nil {
		if _, err := l.store.Apply(b.seq, b.deltas); err != nil {
			return err
		}
		// Applied now or by a commit that reported failure: in the file
		// either way, once.
		l.carry = nil
		l.flushed(now, b.deltas)
	}
	deltas := l.acc.take(l.buf[:0], cur)
	if len(deltas) == 0 {
		l.flushed(now, nil)
		return nil
	}
	l.seq++
	if _, err := l.store.Apply(l.seq, deltas); err != nil {
		l.carry, l.buf = &batch{seq: l.seq, deltas: deltas}, nil
		return err
	}
	l.buf = deltas[:0]
	l.flushed(now, deltas)
	return nil
}

// load reads the last batch number and the current day's and month's
// totals per client from the file. l.viewMu is held.
func (l *Ledger) load(now time.Time) error {
	seq, err := l.store.Seq()
	if err != nil {
		return err
	}
	today, month := dayOf(now), monthOf(now)
	first := dayOf(monthTime(month))
	base := map[string]*Spent{}
	err = l.store.Scan(Daily, first, today+1, func(r Row) {
		if r.Kind != KindClient {
			return
		}
		s := base[r.Name]
		if s == nil {
			s = &Spent{Day: today, Month: month}
			base[r.Name] = s
		}
		if r.Period == today {
			s.DayTokens += r.Tokens()
		}
		s.MonthTokens += r.Tokens()
		s.MonthCost += r.Cost
	})
	if err != nil {
		return err
	}
	for name, s := range base {
		l.acc.addBase(name, *s)
	}
	l.seq, l.ready = seq, true
	return nil
}

func (l *Ledger) flushed(now time.Time, deltas []Delta) {
	var n int64
	for i := range deltas {
		if deltas[i].Kind == KindClient {
			n += deltas[i].Requests
		}
	}
	l.healthMu.Lock()
	t := now
	l.health.LastFlush = &t
	l.health.FlushedRequests += uint64(n)
	l.healthMu.Unlock()
}

// report updates Health after a flush and logs the changes of state.
func (l *Ledger) report(now time.Time, err error) {
	l.healthMu.Lock()
	defer l.healthMu.Unlock()
	h := &l.health
	if err == nil {
		if !h.OK && h.Since != nil {
			l.log.Warn().Time("since", *h.Since).Msg("usage ledger file works again; counts kept in memory are written")
		}
		h.OK, h.Error, h.Since = true, "", nil
		l.ok.Store(true)
		return
	}
	h.FailedFlushes++
	h.Error = err.Error()
	if h.OK || h.Since == nil {
		t := now
		h.Since = &t
		budgets := "budgets fail open: clients are served on what this relay counted in memory"
		if l.cfg.FailClosed {
			budgets = "budgets fail closed: clients with a budget are refused"
		}
		l.log.Error().Err(err).Msg("usage ledger cannot write its file; counts wait in memory and are retried every flush; " + budgets)
	}
	h.OK = false
	l.ok.Store(false)
}
