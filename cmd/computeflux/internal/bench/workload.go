package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
)

// Workload is a fixed set of sessions to replay against a cluster. It is a
// pure value: the same Workload gives the same prompts whatever the routing,
// because every engine of a run uses the same answer seed, so a session's
// answers (and so its next prompts) do not depend on where it ran.
type Workload struct {
	// Name describes the workload in reports.
	Name string
	// System is the system prompt every chat session starts with; empty
	// for trace replays.
	System string
	// Chat selects closed-loop sessions: each turn re-sends the history and
	// the previous answer and is sent Turn.Think after the previous response
	// ended. Otherwise turns are sent at Turn.At (open loop, trace replay).
	Chat bool
	// ClientPerTurn makes every turn a client of its own in the relay's
	// queue, as a trace that names no clients; otherwise a session is one
	// client. A session key never changes a request's client.
	ClientPerTurn bool
	// Sessions are sorted by Start.
	Sessions []Session
}

// Session is one conversation.
type Session struct {
	// Key is sent as X-Session-ID.
	Key string
	// Start is when the first turn is sent, from the workload's start.
	Start time.Duration
	// Turns are sent in order.
	Turns []Turn
}

// Turn is one request of a session.
type Turn struct {
	// Think is the pause between the previous response and this turn
	// (chat workloads; zero for the first turn).
	Think time.Duration
	// At is the send time from the workload's start (open-loop workloads).
	At time.Duration
	// QuestionSeed and QuestionTokens make the new user message of a chat
	// turn: simengine.Filler(QuestionSeed, QuestionTokens).
	QuestionSeed   uint64
	QuestionTokens int
	// Blocks and InputTokens make the single user message of a trace
	// request: one 512-token text block per id, the last one cut so the
	// message has InputTokens tokens.
	Blocks      []uint64
	InputTokens int
	// MaxTokens is the answer length (the simulated model always generates
	// exactly this many tokens).
	MaxTokens int
}

// Requests returns the number of turns in the workload.
func (w *Workload) Requests() int {
	n := 0
	for _, s := range w.Sessions {
		n += len(s.Turns)
	}
	return n
}

// WithoutKeys returns a copy of w whose sessions send no key.
func (w *Workload) WithoutKeys() *Workload {
	c := *w
	c.Sessions = append([]Session(nil), w.Sessions...)
	for i := range c.Sessions {
		c.Sessions[i].Key = ""
	}
	return &c
}

// Span returns the last session start.
func (w *Workload) Span() time.Duration {
	if len(w.Sessions) == 0 {
		return 0
	}
	return w.Sessions[len(w.Sessions)-1].Start
}

// ChatConfig shapes the synthetic multi-turn chat workload. The zero value
// of every field means the default in its comment. The defaults aim at
// chat as deployed assistants see it: a long shared system prompt
// (instructions and tool definitions run to a few thousand tokens), short
// questions with a heavy tail (pasted code or documents), answers of a few
// hundred tokens, a handful of turns per conversation and people reading
// and typing between turns. After five turns a prompt holds about 4,400
// tokens, the size of the median request of the Mooncake conversation trace
// (6,900) minus its longest documents.
type ChatConfig struct {
	// Sessions is the number of conversations. Default 120.
	Sessions int
	// ArrivalSpan is the time over which sessions start (a Poisson process
	// of rate Sessions/ArrivalSpan). Default 60 s.
	ArrivalSpan time.Duration
	// SystemTokens is the length of the system prompt all sessions share.
	// Default 2,000.
	SystemTokens int
	// MeanTurns is the mean number of turns of a session: geometric,
	// at least 1, at most MaxTurns. Default 5.
	MeanTurns float64
	// MaxTurns caps turns per session. Default 16.
	MaxTurns int
	// QuestionTokens is the median length of a user message: log-normal
	// with sigma 1, clipped to 8..4,000. Default 120.
	QuestionTokens int
	// AnswerTokens is the median answer length: log-normal with sigma 0.6,
	// clipped to 16..1,200. Default 250.
	AnswerTokens int
	// Think is the median pause between a response and the next turn:
	// log-normal with sigma 0.6, clipped to 1 s..2 min. Default 12 s.
	Think time.Duration
	// HeavyShare is the share of sessions that are heavy (the skew
	// scenario): 20 times the turns (so MaxTurns does not bind them, up to
	// the context limit) and a fifth of the think time, like agents and
	// power users. With 5% heavy sessions they send about half the
	// requests. Zero means none.
	HeavyShare float64
	// MaxPromptTokens ends a session before a turn whose prompt would
	// exceed it. Default 200,000 (the engine's context is 262,144).
	MaxPromptTokens int
}

func (c *ChatConfig) populate() {
	if c.Sessions == 0 {
		c.Sessions = 120
	}
	if c.ArrivalSpan == 0 {
		c.ArrivalSpan = 60 * time.Second
	}
	if c.SystemTokens == 0 {
		c.SystemTokens = 2000
	}
	if c.MeanTurns == 0 {
		c.MeanTurns = 5
	}
	if c.MaxTurns == 0 {
		c.MaxTurns = 16
	}
	if c.QuestionTokens == 0 {
		c.QuestionTokens = 120
	}
	if c.AnswerTokens == 0 {
		c.AnswerTokens = 250
	}
	if c.Think == 0 {
		c.Think = 12 * time.Second
	}
	if c.MaxPromptTokens == 0 {
		c.MaxPromptTokens = 200_000
	}
}

func (c *ChatConfig) validate() error {
	switch {
	case c.Sessions < 1:
		return fmt.Errorf("sessions %d: must be positive", c.Sessions)
	case c.ArrivalSpan < 0 || c.Think < 0:
		return fmt.Errorf("arrival span and think time must not be negative")
	case c.SystemTokens < 0 || c.QuestionTokens < 1 || c.AnswerTokens < 1:
		return fmt.Errorf("token sizes must be positive")
	case !(c.MeanTurns >= 1) || c.MaxTurns < 1:
		return fmt.Errorf("mean turns %v and max turns %d: must be at least 1", c.MeanTurns, c.MaxTurns)
	case !(c.HeavyShare >= 0 && c.HeavyShare <= 1):
		return fmt.Errorf("heavy share %v: must be in 0..1", c.HeavyShare)
	}
	return nil
}

// Per-message overhead of the chat template in tokens, an upper bound used
// only to keep prompts under MaxPromptTokens.
const templateTokens = 8

// Chat generates the synthetic multi-turn chat workload. The same cfg and
// seed always give the same workload.
func Chat(cfg ChatConfig, seed uint64) (*Workload, error) {
	cfg.populate()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("bench: chat workload: %w", err)
	}
	rng := rand.New(rand.NewPCG(seed, 0x636861745f776b6c)) // "chat_wkl"
	logNormal := func(median, sigma float64) float64 { return median * math.Exp(sigma*rng.NormFloat64()) }
	clip := func(x, lo, hi float64) float64 { return max(lo, min(hi, x)) }
	w := &Workload{
		Name:   "chat",
		System: simengine.Filler(seed^0x73797374656d, cfg.SystemTokens),
		Chat:   true,
	}
	if cfg.HeavyShare > 0 {
		w.Name = "chat-skew"
	}
	heavyEvery := 0
	if cfg.HeavyShare > 0 {
		heavyEvery = max(1, int(math.Round(1/cfg.HeavyShare)))
	}
	rate := float64(cfg.Sessions) / cfg.ArrivalSpan.Seconds()
	var at time.Duration
	p := 1 / cfg.MeanTurns // geometric success probability
	for i := range cfg.Sessions {
		if i > 0 && rate > 0 && !math.IsInf(rate, 0) {
			at += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		}
		heavy := heavyEvery > 0 && i%heavyEvery == heavyEvery/2
		turns, maxTurns, think := 1, cfg.MaxTurns, cfg.Think
		for turns < maxTurns && rng.Float64() >= p {
			turns++
		}
		if heavy {
			turns *= 20
			think /= 5
		} else {
			turns = min(turns, maxTurns)
		}
		s := Session{Key: fmt.Sprintf("s%06d-%08x", i, uint32(rng.Uint64())), Start: at}
		prompt := cfg.SystemTokens + 2*templateTokens
		for t := range turns {
			q := int(clip(logNormal(float64(cfg.QuestionTokens), 1), 8, 4000))
			a := int(clip(logNormal(float64(cfg.AnswerTokens), 0.6), 16, 1200))
			if prompt+q+templateTokens+a > cfg.MaxPromptTokens {
				break
			}
			prompt += q + a + 2*templateTokens
			tn := Turn{QuestionSeed: rng.Uint64(), QuestionTokens: q, MaxTokens: a}
			if t > 0 {
				tn.Think = time.Duration(clip(logNormal(float64(think), 0.6), float64(think/12), float64(10*think)))
				tn.Think = max(tn.Think, 200*time.Millisecond)
			}
			s.Turns = append(s.Turns, tn)
		}
		if len(s.Turns) > 0 {
			w.Sessions = append(w.Sessions, s)
		}
	}
	return w, nil
}

// message is one chat message as sent to the API.
type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// conversation is a client's side of one session: the messages it sends,
// growing turn by turn.
type conversation struct {
	w    *Workload
	s    *Session
	msgs []message
}

func newConversation(w *Workload, s *Session) *conversation {
	c := &conversation{w: w, s: s}
	if w.Chat && w.System != "" {
		c.msgs = append(c.msgs, message{Role: "system", Content: w.System})
	}
	return c
}

// next returns the messages of turn t (appending its question).
func (c *conversation) next(t *Turn) []message {
	if !c.w.Chat {
		return []message{{Role: "user", Content: traceText(t.Blocks, t.InputTokens)}}
	}
	c.msgs = append(c.msgs, message{Role: "user", Content: simengine.Filler(t.QuestionSeed, t.QuestionTokens)})
	return c.msgs
}

// answered records the answer to the last turn.
func (c *conversation) answered(text string) {
	if c.w.Chat {
		c.msgs = append(c.msgs, message{Role: "assistant", Content: text})
	}
}

// TraceBlockTokens is the size of one Mooncake hash-id block.
const TraceBlockTokens = 512

// traceBlockSeed maps a trace hash id to the Filler seed of its text.
func traceBlockSeed(id uint64) uint64 { return id*0x9e3779b97f4a7c15 + 0x6d6f6f6e }

// traceText is the user message of a trace request: one deterministic
// 512-token text block per hash id, the last cut to make n tokens.
func traceText(blocks []uint64, n int) string {
	var b strings.Builder
	b.Grow(n * 5)
	for i, id := range blocks {
		k := min(TraceBlockTokens, n-i*TraceBlockTokens)
		if k <= 0 {
			break
		}
		b.WriteString(simengine.Filler(traceBlockSeed(id), k))
	}
	return b.String()
}

// ChatML template pieces, as the simulated engine renders chat requests.
const (
	imStart   = "<|im_start|>"
	imEnd     = "<|im_end|>\n"
	genPrompt = "<|im_start|>assistant\n"
)

// render returns the prompt text the engine builds from msgs.
func render(msgs []message) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(imStart + m.Role + "\n" + m.Content + imEnd)
	}
	b.WriteString(genPrompt)
	return b.String()
}
