package scheduler

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestConcurrentUse runs requests, registry changes and clock moves from
// many goroutines at once (meant for -race), then checks that every slot
// taken was given back.
func TestConcurrentUse(t *testing.T) {
	for _, p := range []Policy{PolicySticky, PolicyConsistentHash, PolicyRoundRobin} {
		t.Run(p.String(), func(t *testing.T) {
			s, clk := newTest(t, Config{Policy: p, MaxSessions: 64, ColdStartSamples: 5})
			for i := range 8 {
				s.Upsert(Endpoint{ID: fmt.Sprint("e", i), Models: []string{"m", fmt.Sprint("m", i%2)}, Capacity: i % 3})
			}
			outcomes := []Outcome{ok200, ok200, ok200, fail500, {Status: 429}, {Status: 401}, {Status: 400}, connErr}
			var wg sync.WaitGroup
			for g := range 6 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 7))
					for range 1500 {
						a := s.Begin(Request{Model: []string{"m", "m0", "m1"}[rng.IntN(3)], SessionKey: fmt.Sprint("s", rng.IntN(100))})
						for try := 0; try < 3; try++ {
							c, err := a.Pick()
							if err != nil {
								break
							}
							if a.Report(c, outcomes[rng.IntN(len(outcomes))]).Retryable() == false {
								break
							}
						}
					}
				})
			}
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(99, 7))
				for i := range 600 {
					id := fmt.Sprint("e", rng.IntN(8))
					switch i % 6 {
					case 0:
						s.SetHealth(id, Health{Suspect: rng.IntN(4) == 0, Running: rng.IntN(3), KVCacheUsage: rng.Float64()})
					case 1:
						s.Upsert(Endpoint{ID: id, Models: []string{"m", "m1"}, Capacity: rng.IntN(3), Disabled: rng.IntN(5) == 0})
					case 2:
						if rng.IntN(10) == 0 {
							s.Remove(id)
						}
					case 3:
						clk.Advance(time.Duration(rng.IntN(20)) * time.Second)
					case 4:
						_ = s.Snapshot()
					case 5:
						_ = s.Models()
					}
				}
			})
			wg.Wait()
			for _, st := range s.Snapshot() {
				if st.InFlight != 0 || st.Probes != 0 {
					t.Fatalf("slots leaked: %+v", st)
				}
			}
			if n := s.Sessions(); n > 64 {
				t.Fatalf("%d sessions, bound 64", n)
			}
		})
	}
}
