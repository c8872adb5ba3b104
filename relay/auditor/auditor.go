// Package auditor runs the relay's audits of its agents: the I/O around
// scheduler/audit's pure verdicts. It learns the form of each model's
// client requests (audit.Template) and their shared phrases
// (audit.Phrases), writes audit prompts of that form, sends them the way
// client requests go to an agent, keeps the answers that can judge others
// in a bank (audit.Bank), records verdicts in the book (audit.Book), puts
// each agent's standing into routing, and checks sampled answers cheaply.
//
// It is built from a Config of what it needs from the relay (the fleet, a
// way to send, the routing weight, the relay's seed and pseudonyms), not
// from the relay itself; docs/audits.md says what it does and why.
package auditor

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"runtime/debug"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/scheduler/audit"
)

// Settings are the operator's settings of the audits. The zero value
// audits at the defaults: it works with no configuration.
type Settings struct {
	// Disabled turns audits off.
	Disabled bool
	// Share is the audits' budget as a share of the tokens served to
	// clients. If zero, audit.DefaultFraction (2%); negative means no
	// budget: only the floor, new agents and quarantine re-audits.
	Share float64
	// FloorEvery: every agent and model is audited at least this often,
	// budget or not. If zero, audit.DefaultFloorEvery.
	FloorEvery time.Duration
	// References is the number of other agents (of other groups) sent a
	// live round's prompt beside the agent under audit. If zero,
	// DefaultReferences.
	References int
	// MinVoices is audit.Rules.MinVoices. If zero, its default (2).
	MinVoices int
	// Independence says which agents are one voice. The zero value is
	// audit.ByNetwork.
	Independence audit.Independence
	// Timeout bounds one audit round, its wait for room at the agents
	// included. If zero, DefaultTimeout.
	Timeout time.Duration
	// Interval is how often the auditor looks for an audit due. If zero,
	// DefaultInterval.
	Interval time.Duration
	// PhraseClients is how many distinct clients must have used a phrase
	// before audit prompts use it (audit.NewPhrases). If zero, its
	// default (3).
	PhraseClients int
	// Policy turns evidence into weight and quarantine; zero fields take
	// audit's defaults (FloorEvery above wins over Policy.FloorEvery).
	Policy audit.Policy
	// Bank bounds the bank of audit prompts; zero fields take audit's
	// defaults.
	Bank audit.BankPolicy
}

// Defaults for the zero values of Settings.
const (
	DefaultReferences = 3
	DefaultTimeout    = time.Minute
	DefaultInterval   = time.Second
)

func (s Settings) populate() Settings {
	if s.References <= 0 {
		s.References = DefaultReferences
	}
	if s.Timeout <= 0 {
		s.Timeout = DefaultTimeout
	}
	if s.Interval <= 0 {
		s.Interval = DefaultInterval
	}
	if s.FloorEvery > 0 {
		s.Policy.FloorEvery = s.FloorEvery
	}
	return s
}

// Validate reports settings that cannot work.
func (s Settings) Validate() error {
	if s.Share > 1 || s.Share != s.Share || s.FloorEvery < 0 || s.References < 0 || s.MinVoices < 0 || s.PhraseClients < 0 {
		return fmt.Errorf("audit settings: share at most 1, and no negative floor, references, voices or phrase clients")
	}
	if s.Independence < audit.ByNetwork || s.Independence > audit.ByAgent {
		return fmt.Errorf("audit settings: %v", s.Independence)
	}
	return s.Policy.Validate()
}

// Member is one endpoint of the fleet that may be audited or answer an
// audit.
type Member struct {
	// Name is the agent's (or provider endpoint's) name.
	Name string
	// Models it serves.
	Models []string
	// Kind is the engine's kind (transport.JoinInfo.Engine); for a
	// provider endpoint, what its endpoints file or model list says.
	Kind string
	// Addr is the agent's address as the relay sees its connection;
	// invalid for a provider endpoint.
	Addr netip.Addr
	// Provider marks a provider endpoint: never audited, a voice of its
	// own where it serves a model.
	Provider bool
	// Trusted marks the operator's reference: never audited; where it
	// answers comparably, it alone judges.
	Trusted bool
}

// Load is an agent's load as it publishes it beside what the relay has
// in flight on it.
type Load struct {
	Agent     string
	Models    []string
	Published int // its engine's running and waiting requests, from gossip
	InFlight  int // this relay's requests in flight on it
}

// Request is one audit request to one endpoint.
type Request struct {
	// Endpoint names the agent or provider endpoint.
	Endpoint string
	// Model is the model asked for.
	Model string
	// Client is a recent client of the model whose flow the request names,
	// as every request the relay sends an agent names its client's.
	Client string
	// Body and Header are the request, sent as they are.
	Body   []byte
	Header http.Header
	// Cost is the request's expected tokens, for the fair queue.
	Cost int
}

// Config is what the auditor needs. Every func but FirstSeen is required;
// they may be called concurrently and must not call back into the
// auditor.
type Config struct {
	Settings
	// Clock gives the time; nil means the wall clock.
	Clock interface{ Now() time.Time }
	// Logger receives the audits' log lines.
	Logger zerolog.Logger
	// Metrics registers the audits' metrics; nil registers none.
	Metrics prometheus.Registerer
	// Fleet returns the endpoints routable now.
	Fleet func() []Member
	// Send sends req the way a client's request goes to the endpoint (its
	// slot in the fair queue, the path, the stream protocol) and returns
	// the answer; the caller closes its body.
	Send func(ctx context.Context, req Request) (*http.Response, error)
	// SetWeight puts an agent's standing for a model into routing.
	SetWeight func(agent, model string, weight float64)
	// Seed returns body with what the relay adds to every request it
	// forwards to an agent (a seed where the client set none).
	Seed func(body []byte) []byte
	// Pseudonym returns what agents get for an identity field's value
	// (user, safety_identifier).
	Pseudonym func(string) string
	// EngineHeaders returns the headers of a client's request its engine
	// gets, the session's excepted.
	EngineHeaders func(http.Header) http.Header
	// Loads returns the agents' published and measured loads; nil when
	// there is no gossip to compare with.
	Loads func() []Load
	// FirstSeen, if set, returns when an agent's name was first known
	// (the ledger's claim), for its tenure; zero when unknown.
	FirstSeen func(agent string) time.Time
}

type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }

// Auditor runs the audits. Its methods are safe for concurrent use; those
// the request path calls (TapDue, Served, Answered) do no I/O.
type Auditor struct {
	cfg Config
	log zerolog.Logger
	m   *metrics

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex // guards the following
	book    *audit.Book
	budget  *audit.Budget
	bank    *audit.Bank
	traffic map[string]*modelTraffic // by model
	recent  []Record                 // the latest audits, oldest first
	seq     uint64
	rng     *rand.Rand
	loads   map[string]*audit.LoadCheck // by agent
	checks  []recheck                   // clients' answers waiting for a re-check
	started bool
}

// New builds an auditor; Start starts it.
func New(cfg Config) *Auditor {
	cfg.Settings = cfg.Settings.populate()
	if cfg.Clock == nil {
		cfg.Clock = wallClock{}
	}
	a := &Auditor{
		cfg:     cfg,
		log:     cfg.Logger.With().Str("component", "audit").Logger(),
		book:    audit.NewBook(cfg.Policy),
		budget:  audit.NewBudget(cfg.Share, 0),
		bank:    audit.NewBank(cfg.Bank),
		traffic: make(map[string]*modelTraffic),
		rng:     rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
		loads:   make(map[string]*audit.LoadCheck),
		done:    make(chan struct{}),
	}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	a.m = newMetrics(a, cfg.Metrics)
	return a
}

// Start runs the audit loop until Close.
func (a *Auditor) Start() {
	a.mu.Lock()
	a.started = true
	a.mu.Unlock()
	go func() {
		defer close(a.done)
		t := time.NewTicker(a.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-a.ctx.Done():
				return
			case <-t.C:
				a.safeTick()
			}
		}
	}()
}

// safeTick runs tick; a panic in it is logged, not the relay's end: the
// audits are not worth its serving.
func (a *Auditor) safeTick() {
	defer func() {
		if v := recover(); v != nil {
			a.log.Error().Str("panic", fmt.Sprint(v)).Str("stack", string(debug.Stack())).Msg("audit round failed")
		}
	}()
	a.tick()
}

// Close ends the loop and waits for it (a round in flight is cancelled
// and gives no evidence). It is safe to call more than once, and on an
// auditor never started.
func (a *Auditor) Close() {
	a.cancel()
	a.mu.Lock()
	started := a.started
	a.mu.Unlock()
	if started {
		<-a.done
	}
}

func (a *Auditor) now() time.Time { return a.cfg.Clock.Now() }

// maxRecent bounds the audits the admin API shows.
const maxRecent = 64

// Record is one audit as the admin API and logs show it.
type Record struct {
	ID      string    `json:"id"`
	At      time.Time `json:"at"`
	Model   string    `json:"model"`
	Subject string    `json:"subject"`
	// Why is the reason it was due: new, floor, recheck, suspected,
	// budget, or client (a client's answer re-checked).
	Why string `json:"why"`
	// Item is the bank item's ID: a prompt first sent in an earlier audit
	// when Replay is set.
	Item   string `json:"item"`
	Replay bool   `json:"replay,omitempty"`
	// Sampled is true for a prompt decoded with sampling.
	Sampled bool `json:"sampled"`
	// Verdicts are by participant: agree, disagree or inconclusive, and
	// "error: ..." for a participant whose answer could not be had.
	Verdicts map[string]string `json:"verdicts"`
	// Against and Reason explain the subject's verdict.
	Against string `json:"against,omitempty"`
	Reason  string `json:"reason,omitempty"`
	// Tokens is what the round cost.
	Tokens int `json:"tokens"`
}
