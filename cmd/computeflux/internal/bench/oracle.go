package bench

import (
	"cmp"
	"slices"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
)

// Oracle returns the best prefix-cache hit ratio any placement can reach on
// w with blockSize-token cache blocks: every request is served by a cache
// of unbounded size that has seen every earlier request (its session's
// history and the prefixes other sessions share). As on the engine, only
// full blocks are cached and the last prompt token is always computed.
//
// Chat: a first turn finds the shared system prompt (except the very first
// session's); a later turn finds the whole previous prompt and its answer.
// Trace: a request finds the leading text of its hash-id blocks that
// earlier requests (in the order the workload sends them) already sent.
func Oracle(w *Workload, blockSize int) float64 {
	if blockSize <= 0 {
		blockSize = simengine.DefaultBlockSize
	}
	var prompt, cached int64
	hit := func(shared, n int) {
		c := min(shared, n-1) / blockSize * blockSize
		prompt += int64(n)
		cached += int64(max(c, 0))
	}
	if w.Chat {
		sysPrefix := simengine.CountTokens(imStart + "system\n" + w.System + imEnd + imStart + "user\n")
		firstOver := simengine.CountTokens(imEnd + genPrompt)                 // after the question
		nextOver := simengine.CountTokens(imEnd+imStart+"user\n") + firstOver // between answer and question, and after it
		for i, s := range w.Sessions {
			n, prev := 0, 0
			for t, tn := range s.Turns {
				if t == 0 {
					n = sysPrefix + tn.QuestionTokens + firstOver
					if w.System == "" {
						n = simengine.CountTokens(imStart+"user\n") + tn.QuestionTokens + firstOver
					}
					shared := sysPrefix
					if i == 0 || w.System == "" {
						shared = 0
					}
					hit(shared, n)
				} else {
					n = prev + tn.QuestionTokens + nextOver
					hit(prev, n)
				}
				prev = n + tn.MaxTokens
			}
		}
	} else {
		// Trace turns are sent in time order across sessions.
		type req struct {
			at time.Duration
			t  *Turn
		}
		var reqs []req
		for si := range w.Sessions {
			for ti := range w.Sessions[si].Turns {
				t := &w.Sessions[si].Turns[ti]
				reqs = append(reqs, req{t.At, t})
			}
		}
		slices.SortStableFunc(reqs, func(a, b req) int { return cmp.Compare(a.at, b.at) })
		head := simengine.CountTokens(imStart + "user\n")
		tail := simengine.CountTokens(imEnd + genPrompt)
		// seen holds, per block id, the most tokens of its text any earlier
		// request sent: a request's last block is usually cut short.
		seen := make(map[uint64]int)
		for _, r := range reqs {
			n := head + r.t.InputTokens + tail
			shared, whole := head, true
			for i, id := range r.t.Blocks {
				k := min(TraceBlockTokens, r.t.InputTokens-i*TraceBlockTokens)
				got := seen[id]
				shared += min(got, k)
				if got < k {
					whole = false
					break
				}
			}
			switch {
			case whole:
				shared = n // the same prompt again
			case shared == head:
				shared = 0 // only the template's first tokens: less than a block
			}
			hit(shared, n)
			for i, id := range r.t.Blocks {
				k := min(TraceBlockTokens, r.t.InputTokens-i*TraceBlockTokens)
				seen[id] = max(seen[id], k)
			}
		}
	}
	if prompt == 0 {
		return 0
	}
	return float64(cached) / float64(prompt)
}
