package simengine_test

import (
	"fmt"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
)

// A discrete-event simulation drives an Engine in virtual time: submit at
// the request's time, then repeatedly jump to Next and collect events with
// Advance. Here a second turn re-sends the first prompt and its answer.
func ExampleEngine() {
	eng, err := simengine.NewEngine(simengine.EngineConfig{})
	if err != nil {
		panic(err)
	}
	now := time.Unix(0, 0)
	prompt := simengine.Tokenize(nil, simengine.Filler(1, 4000))
	hashes := simengine.BlockHashes(nil, prompt, 16)
	var events []simengine.Event
	for turn := uint64(1); turn <= 2; turn++ {
		start := now
		if err := eng.Submit(now, &simengine.Request{ID: turn, Tokens: prompt, Hashes: hashes, MaxTokens: 50}); err != nil {
			panic(err)
		}
		for at, ok := eng.Next(); ok; at, ok = eng.Next() {
			now = at
			for _, ev := range eng.Advance(now, events[:0]) {
				switch ev.Kind {
				case simengine.EventFirstToken:
					fmt.Printf("turn %d: %d of %d prompt tokens cached, first token after %v\n",
						turn, ev.Usage.CachedTokens, ev.Usage.PromptTokens, ev.At.Sub(start).Round(time.Millisecond))
				case simengine.EventDone:
					// the next turn: this prompt, the answer and a new question
					prompt = append(append(prompt, ev.Output...), simengine.Tokenize(nil, simengine.Filler(2, 20))...)
					hashes = simengine.BlockHashes(hashes, prompt, 16) // only the new blocks are hashed
				}
			}
		}
	}
	// Output:
	// turn 1: 0 of 4000 prompt tokens cached, first token after 160ms
	// turn 2: 4048 of 4070 prompt tokens cached, first token after 1ms
}
