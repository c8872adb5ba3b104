package simengine

import (
	"testing"
	"time"
)

// BenchmarkManyEngines2000 serves 2,000-token prompts round robin over 128
// engines with full caches, as the bench command's simulation does with a
// thousand: the caches together are far larger than the processor's, so
// this measures the cache's misses to memory, which a single engine's
// benchmark does not.
func BenchmarkManyEngines2000(b *testing.B) {
	const engines, prompts = 128, 256
	es := make([]*Engine, engines)
	for i := range es {
		es[i], _ = NewEngine(EngineConfig{})
	}
	ps := make([][]Token, prompts)
	hs := make([][]BlockHash, prompts)
	for i := range ps {
		ps[i] = Tokenize(nil, Filler(uint64(i%8), 1000)+Filler(uint64(i), 1000))
		hs[i] = BlockHashes(nil, ps[i], DefaultBlockSize)
	}
	now := t0
	var evs []Event
	serve := func(i int) {
		e := es[i%engines]
		p := (i / engines * 7) % prompts
		if err := e.Submit(now, &Request{ID: uint64(i), Tokens: ps[p], Hashes: hs[p], MaxTokens: 20}); err != nil {
			b.Fatal(err)
		}
		for {
			at, ok := e.Next()
			if !ok {
				break
			}
			if at.After(now) {
				now = at
			}
			evs = e.Advance(now, evs[:0])
		}
		now = now.Add(time.Millisecond)
	}
	for i := range engines * 160 { // fill every cache
		serve(i)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		serve(engines*160 + i)
	}
}
