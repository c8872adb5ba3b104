package ledger

import (
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Kind is what a row counts: a client's use, an agent's or a provider
// endpoint's service.
type Kind uint8

// The kinds of rows.
const (
	KindClient Kind = iota + 1
	KindAgent
	KindProvider
)

// String returns the kind's name.
func (k Kind) String() string {
	switch k {
	case KindClient:
		return "client"
	case KindAgent:
		return "agent"
	case KindProvider:
		return "provider"
	}
	return "unknown"
}

// Other is the name and model of the rows that fold what the caps keep
// out (see the package doc).
const Other = "other"

// maxNameLen bounds a name or model; a longer one is counted as Other.
const maxNameLen = 256

// Entry is one answered request, as the request path records it.
type Entry struct {
	// Time is when the answer ended; its UTC hour is the row's.
	Time time.Time
	// Client is the client's name (never a key).
	Client string
	// Model is the model the request named.
	Model string
	// Agent is the agent that served it, or empty.
	Agent string
	// Provider is the provider endpoint that served it, or empty; its
	// prices (SetPrices) give the request's cost.
	Provider string
	// PromptTokens counts the prompt, CachedTokens the part of it the
	// engine had cached, CompletionTokens the answer. Negative counts are
	// taken as 0, and CachedTokens as at most PromptTokens.
	PromptTokens, CachedTokens, CompletionTokens int64
	// Error marks a request that failed.
	Error bool
	// Estimated marks token counts the relay estimated because the engine
	// gave no usage.
	Estimated bool
	// Serving is how long the agent or provider took to answer.
	Serving time.Duration
}

// Counts are one row's sums. The zero value counts nothing.
type Counts struct {
	Requests         int64 `json:"requests"`
	PromptTokens     int64 `json:"prompt_tokens"`
	CachedTokens     int64 `json:"cached_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	// Errors counts the requests that failed.
	Errors int64 `json:"errors"`
	// Estimated counts the requests whose tokens were estimated.
	Estimated int64 `json:"estimated"`
	// Serving is the time spent answering, summed over the requests.
	Serving time.Duration `json:"serving_ns"`
	// Cost is what priced provider endpoints charged for the requests;
	// Saved what their caches saved against no cache.
	Cost  Money `json:"cost"`
	Saved Money `json:"saved"`
}

// Tokens returns prompt plus completion tokens: what budgets count.
func (c Counts) Tokens() int64 { return c.PromptTokens + c.CompletionTokens }

// Add adds o to c.
func (c *Counts) Add(o Counts) {
	c.Requests += o.Requests
	c.PromptTokens += o.PromptTokens
	c.CachedTokens += o.CachedTokens
	c.CompletionTokens += o.CompletionTokens
	c.Errors += o.Errors
	c.Estimated += o.Estimated
	c.Serving += o.Serving
	c.Cost += o.Cost
	c.Saved += o.Saved
}

func (c *Counts) addEntry(e *Entry, cost, saved Money) {
	c.Requests++
	c.PromptTokens += e.PromptTokens
	c.CachedTokens += e.CachedTokens
	c.CompletionTokens += e.CompletionTokens
	if e.Error {
		c.Errors++
	}
	if e.Estimated {
		c.Estimated++
	}
	c.Serving += e.Serving
	c.Cost += cost
	c.Saved += saved
}

// Key names a row: a kind, an entity's name, a model and a UTC hour.
type Key struct {
	Hour  int64
	Kind  Kind
	Name  string
	Model string
}

// Delta is what a flush adds to a row.
type Delta struct {
	Key
	Counts
}

// numShards stripes the accumulator: requests of different clients rarely
// wait for each other.
const numShards = 32

// accumulator holds what is recorded and not flushed yet, and each
// client's spending in its current day and month. It does no I/O.
type accumulator struct {
	seed     maphash.Seed
	shards   [numShards]shard
	caps     capper
	maxRows  int64 // rows in all shards
	rows     atomic.Int64
	folded   atomic.Uint64 // records counted in an Other row
	dropped  atomic.Uint64 // row updates lost because maxRows was reached
	recorded atomic.Uint64 // records
	curHour  atomic.Int64  // the clock's hour at the last flush
}

type shard struct {
	mu    sync.Mutex         // guards the following fields
	rows  map[Key]*Counts    // pending deltas; zeroed rows of past hours are deleted at take
	spent map[string]*Spent  // each client's spending since the process started, plus its base
	_     [64 - 8*2 - 8]byte // keep shards on their own cache lines
}

func newAccumulator(maxModelsPerHour, maxRowsPerHour, maxPendingRows int) *accumulator {
	a := &accumulator{seed: maphash.MakeSeed(), maxRows: int64(maxPendingRows)}
	a.caps = capper{maxModels: maxModelsPerHour, maxRows: maxRowsPerHour, hours: map[int64]*hourCaps{}}
	for i := range a.shards {
		a.shards[i].rows = map[Key]*Counts{}
		a.shards[i].spent = map[string]*Spent{}
	}
	return a
}

func (a *accumulator) shardOf(client string) *shard {
	return &a.shards[maphash.String(a.seed, client)%numShards]
}

// record adds e (normalized) with its cost to the client's row, the
// serving agent's or provider's row, and the client's spending.
func (a *accumulator) record(e *Entry, cost, saved Money) {
	h := hourOf(e.Time)
	sh := a.shardOf(e.Client)
	sh.mu.Lock()
	a.add(sh, Key{h, KindClient, e.Client, e.Model}, e, cost, saved)
	if e.Agent != "" {
		a.add(sh, Key{h, KindAgent, e.Agent, e.Model}, e, 0, 0)
	}
	if e.Provider != "" {
		a.add(sh, Key{h, KindProvider, e.Provider, e.Model}, e, cost, saved)
	}
	sh.spend(e, cost)
	sh.mu.Unlock()
	a.recorded.Add(1)
}

func (a *accumulator) add(sh *shard, k Key, e *Entry, cost, saved Money) {
	c := sh.rows[k]
	if c == nil {
		if c = a.newRow(sh, k); c == nil {
			a.dropped.Add(1)
			return
		}
	}
	c.addEntry(e, cost, saved)
}

// newRow finds or makes the row that counts k in sh, applying the caps:
// the slow path, taken once per row and hour, and on every record a cap
// folds.
func (a *accumulator) newRow(sh *shard, k Key) *Counts {
	k, folded := a.caps.admit(k, a.curHour.Load(), func(k Key) bool { return sh.rows[k] != nil })
	if folded {
		a.folded.Add(1)
	}
	if c := sh.rows[k]; c != nil {
		return c
	}
	if a.rows.Load() >= a.maxRows {
		return nil
	}
	k.Name, k.Model = strings.Clone(k.Name), strings.Clone(k.Model)
	c := &Counts{}
	sh.rows[k] = c
	a.rows.Add(1)
	return c
}

func (sh *shard) spend(e *Entry, cost Money) {
	s := sh.spent[e.Client]
	d := dayOf(e.Time)
	if s == nil {
		s = &Spent{Day: d, Month: monthOf(e.Time)}
		sh.spent[strings.Clone(e.Client)] = s
	}
	tok := e.PromptTokens + e.CompletionTokens
	switch {
	case d == s.Day:
		s.DayTokens += tok
	case d > s.Day:
		s.Day, s.DayTokens = d, tok
		if m := monthOf(e.Time); m != s.Month {
			s.Month, s.MonthTokens, s.MonthCost = m, 0, 0
		}
	default: // a late record of an earlier day: its month may still count
		if monthOf(e.Time) != s.Month {
			return
		}
	}
	s.MonthTokens += tok
	s.MonthCost += cost
}

// addBase adds what the store holds for client (read when it opened) to
// its spending.
func (a *accumulator) addBase(client string, base Spent) {
	sh := a.shardOf(client)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	s := sh.spent[client]
	if s == nil {
		s = &Spent{Day: base.Day, Month: base.Month}
		sh.spent[strings.Clone(client)] = s
	}
	if base.Day == s.Day {
		s.DayTokens += base.DayTokens
	}
	if base.Month == s.Month {
		s.MonthTokens += base.MonthTokens
		s.MonthCost += base.MonthCost
	}
}

// spentOf returns client's spending as seen at now.
func (a *accumulator) spentOf(client string, now time.Time) Spent {
	return a.spentRaw(client).In(now)
}

// spentRaw returns client's spending in its latest day and month.
func (a *accumulator) spentRaw(client string) Spent {
	sh := a.shardOf(client)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s := sh.spent[client]; s != nil {
		return *s
	}
	return Spent{}
}

// ClientSpent is one client's spending, as relays tell each other.
type ClientSpent struct {
	Client string `json:"client"`
	Spent
}

// appendSpent appends every client's spending seen at now, skipping
// clients with nothing spent in now's month.
func (a *accumulator) appendSpent(dst []ClientSpent, now time.Time) []ClientSpent {
	for i := range a.shards {
		sh := &a.shards[i]
		sh.mu.Lock()
		for name, s := range sh.spent {
			if in := s.In(now); in.MonthTokens > 0 || in.MonthCost > 0 || in.DayTokens > 0 {
				dst = append(dst, ClientSpent{Client: name, Spent: in})
			}
		}
		sh.mu.Unlock()
	}
	return dst
}

// take moves every pending delta into dst and zeroes its row; zeroed rows
// of hours before curHour are deleted.
func (a *accumulator) take(dst []Delta, curHour int64) []Delta {
	for i := range a.shards {
		sh := &a.shards[i]
		sh.mu.Lock()
		for k, c := range sh.rows {
			if *c != (Counts{}) {
				dst = append(dst, Delta{Key: k, Counts: *c})
				*c = Counts{}
			} else if k.Hour < curHour {
				delete(sh.rows, k)
				a.rows.Add(-1)
			}
		}
		sh.mu.Unlock()
	}
	a.caps.retire(curHour)
	return dst
}

// each calls fn with every pending delta (for queries).
func (a *accumulator) each(fn func(Key, Counts)) {
	for i := range a.shards {
		sh := &a.shards[i]
		sh.mu.Lock()
		for k, c := range sh.rows {
			if *c != (Counts{}) {
				fn(k, *c)
			}
		}
		sh.mu.Unlock()
	}
}

// capper applies the per-hour caps on model names and rows.
type capper struct {
	maxModels, maxRows int
	mu                 sync.Mutex // guards hours
	hours              map[int64]*hourCaps
}

type hourCaps struct {
	models map[string]struct{}
	rows   [KindProvider + 1]int
}

// admit returns the key that counts k: k itself, or k folded into Other
// when a cap is reached, and whether it folded. has tells whether the
// shard already has a row. cur is the clock's hour.
func (c *capper) admit(k Key, cur int64, has func(Key) bool) (Key, bool) {
	folded := false
	if len(k.Name) > maxNameLen {
		k.Name, folded = Other, true
	}
	if len(k.Model) > maxNameLen {
		k.Model, folded = Other, true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	hc := c.hours[k.Hour]
	if hc == nil {
		if k.Hour < cur-1 {
			// A record for an hour already retired: count it as Other
			// rather than grow the caps again.
			return Key{Hour: k.Hour, Kind: k.Kind, Name: Other, Model: Other}, true
		}
		hc = &hourCaps{models: map[string]struct{}{}}
		c.hours[k.Hour] = hc
	}
	if _, ok := hc.models[k.Model]; !ok {
		if len(hc.models) >= c.maxModels {
			k.Model, folded = Other, true
		} else {
			hc.models[strings.Clone(k.Model)] = struct{}{}
		}
	}
	if has(k) {
		return k, folded
	}
	if hc.rows[k.Kind] >= c.maxRows {
		k.Name, k.Model, folded = Other, Other, true
		if has(k) {
			return k, folded
		}
	}
	hc.rows[k.Kind]++
	return k, folded
}

// retire forgets the caps of hours before cur-1.
func (c *capper) retire(cur int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for h := range c.hours {
		if h < cur-1 {
			delete(c.hours, h)
		}
	}
}
