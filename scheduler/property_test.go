package scheduler

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// Property tests for the scheduler's stateful structures: each drives the
// real structure and a plain model of it (slices and maps) with the same
// sequence of operations, decoded from bytes, and checks after every step
// that the two agree and that the structure's invariants hold. The
// property tests feed random bytes; the fuzz targets feed the fuzzer's.

// opBytes decodes an input into operations and their arguments. Once the
// input is used up every read returns 0 and done reports true.
type opBytes struct {
	b []byte
	i int
}

func (o *opBytes) done() bool { return o.i >= len(o.b) }

// next returns the next byte, or 0 past the end.
func (o *opBytes) next() byte {
	if o.i >= len(o.b) {
		return 0
	}
	o.i++
	return o.b[o.i-1]
}

// intn returns the next byte modulo n (n > 0).
func (o *opBytes) intn(n int) int { return int(o.next()) % n }

// stepper is a property test's machine: a structure, its model and their
// checks, driven one operation at a time.
type stepper interface{ step(o *opBytes) }

// runMachine builds a machine from o's first bytes and steps it until o
// is used up.
func runMachine[M stepper](t *testing.T, o *opBytes, newMachine func(*testing.T, *opBytes) M) {
	m := newMachine(t, o)
	for !o.done() {
		m.step(o)
	}
}

// checkProperty runs machines on runs random inputs of up to size bytes
// from a fixed seed. A machine fails the test (t.Fatalf) on the first
// broken property; the input is then logged, ready to be added as a fuzz
// seed.
func checkProperty[M stepper](t *testing.T, runs, size int, newMachine func(*testing.T, *opBytes) M) {
	t.Helper()
	rng := rand.New(rand.NewPCG(0x5eed, uint64(len(t.Name()))))
	for range runs {
		b := make([]byte, 1+rng.IntN(size))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		func() {
			defer func() {
				if t.Failed() {
					t.Logf("failing input (a fuzz seed): %s", goBytes(b))
				}
			}()
			runMachine(t, &opBytes{b: b}, newMachine)
		}()
		if t.Failed() {
			return
		}
	}
}

// fuzzMachine runs machines on the fuzzer's inputs of up to maxLen bytes.
func fuzzMachine[M stepper](f *testing.F, maxLen int, newMachine func(*testing.T, *opBytes) M) {
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) <= maxLen {
			runMachine(t, &opBytes{b: data}, newMachine)
		}
	})
}

// goBytes formats b as a Go []byte literal.
func goBytes(b []byte) string { return fmt.Sprintf("[]byte(%q)", b) }
