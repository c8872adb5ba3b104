package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// TraceRecord is one request of a Mooncake trace.
type TraceRecord struct {
	// Timestamp is milliseconds since the trace's start.
	Timestamp int64 `json:"timestamp"`
	// InputLength and OutputLength are prompt and answer tokens.
	InputLength  int `json:"input_length"`
	OutputLength int `json:"output_length"`
	// HashIDs name the prompt's 512-token blocks, as chained prefix hashes:
	// equal leading ids mean an equal prefix.
	HashIDs []uint64 `json:"hash_ids"`
}

// ReadTrace reads a Mooncake trace (one JSON object a line), at most limit
// records when limit > 0. Blank lines are skipped; a malformed line is an
// error naming its line number.
func ReadTrace(r io.Reader, limit int) ([]TraceRecord, error) {
	var out []TraceRecord
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for line := 1; sc.Scan(); line++ {
		b := sc.Bytes()
		if len(b) == 0 {
			continue
		}
		var rec TraceRecord
		if err := json.Unmarshal(b, &rec); err != nil {
			return nil, fmt.Errorf("bench: trace line %d: %w", line, err)
		}
		if rec.InputLength < 1 || rec.OutputLength < 0 || rec.Timestamp < 0 ||
			len(rec.HashIDs) != (rec.InputLength+TraceBlockTokens-1)/TraceBlockTokens {
			return nil, fmt.Errorf("bench: trace line %d: %d hash ids for %d input tokens", line, len(rec.HashIDs), rec.InputLength)
		}
		out = append(out, rec)
		if limit > 0 && len(out) >= limit {
			break
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("bench: trace: %w", err)
	}
	return out, nil
}

// TraceConfig shapes a trace replay. The zero value of every field means
// the default in its comment.
type TraceConfig struct {
	// Bucket is the granularity of the trace's timestamps; requests that
	// share a timestamp are spread uniformly over one bucket. Default 3 s.
	Bucket time.Duration
	// Speed divides the trace's times: 10 replays a 10-minute trace in one
	// minute (the engines keep their speed, so the load rises). Default 1.
	Speed float64
	// MaxOutput caps answer lengths (0: none).
	MaxOutput int
	// Keyless sends no session key: with Clients TraceClientsRequest every
	// request is then a session of its own and none are inferred.
	Keyless bool
	// Clients says who the relay's queue sees as a client: each request
	// (TraceClientsRequest, the default: the trace names no clients) or
	// each inferred conversation (TraceClientsConversation: one user, one
	// API key), keys or none.
	Clients string
}

// Client models of a trace replay (TraceConfig.Clients).
const (
	TraceClientsRequest      = "request"
	TraceClientsConversation = "conversation"
)

// TraceWorkload turns trace records into an open-loop workload. Sessions
// are inferred as the traces' documentation suggests: a request whose
// prompt starts with all full blocks of an earlier, shorter request is that
// conversation's next turn (the longest such request wins); any other
// request starts a session. Requests keep their (spread, sped-up) times.
func TraceWorkload(recs []TraceRecord, cfg TraceConfig, seed uint64) (*Workload, error) {
	if cfg.Bucket == 0 {
		cfg.Bucket = 3 * time.Second
	}
	if cfg.Speed == 0 {
		cfg.Speed = 1
	}
	if !(cfg.Speed > 0) || math.IsInf(cfg.Speed, 0) || cfg.Bucket < 0 {
		return nil, fmt.Errorf("bench: trace replay: speed %v and bucket %v must be positive", cfg.Speed, cfg.Bucket)
	}
	perConversation := false
	switch cfg.Clients {
	case "", TraceClientsRequest:
	case TraceClientsConversation:
		perConversation = true
	default:
		return nil, fmt.Errorf("bench: trace replay: clients %q: want %s or %s", cfg.Clients, TraceClientsRequest, TraceClientsConversation)
	}
	infer := !cfg.Keyless || perConversation
	rng := rand.New(rand.NewPCG(seed, 0x7472616365)) // "trace"
	// Spread each group of equal timestamps over one bucket.
	at := make([]time.Duration, len(recs))
	for i := 0; i < len(recs); {
		j := i
		for j < len(recs) && recs[j].Timestamp == recs[i].Timestamp {
			j++
		}
		offs := make([]float64, j-i)
		for k := range offs {
			offs[k] = rng.Float64()
		}
		slices.Sort(offs)
		for k := range offs {
			t := time.Duration(recs[i+k].Timestamp)*time.Millisecond + time.Duration(offs[k]*float64(cfg.Bucket))
			at[i+k] = time.Duration(float64(t) / cfg.Speed)
		}
		i = j
	}
	order := make([]int, len(recs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		switch {
		case at[a] < at[b]:
			return -1
		case at[a] > at[b]:
			return 1
		}
		return 0
	})

	type ends struct{ session, full int }
	byLast := make(map[uint64]ends) // id of a request's last full block -> its session and full-block count
	w := &Workload{Name: "mooncake-trace", ClientPerTurn: !perConversation}
	for _, i := range order {
		rec := recs[i]
		full := rec.InputLength / TraceBlockTokens
		sess := -1
		for j := min(full, len(rec.HashIDs)) - 1; j >= 0 && sess < 0 && infer; j-- {
			if e, ok := byLast[rec.HashIDs[j]]; ok && e.full == j+1 && e.full < full {
				sess = e.session
			}
		}
		if sess < 0 {
			sess = len(w.Sessions)
			key := fmt.Sprintf("t%06d", sess)
			if cfg.Keyless {
				key = ""
			}
			w.Sessions = append(w.Sessions, Session{Key: key, Start: at[i]})
		}
		if full > 0 {
			byLast[rec.HashIDs[full-1]] = ends{sess, full}
		}
		out := max(rec.OutputLength, 1)
		if cfg.MaxOutput > 0 {
			out = min(out, cfg.MaxOutput)
		}
		w.Sessions[sess].Turns = append(w.Sessions[sess].Turns, Turn{
			At: at[i], Blocks: rec.HashIDs, InputTokens: rec.InputLength, MaxTokens: out,
		})
	}
	return w, nil
}
