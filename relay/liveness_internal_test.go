package relay

import (
	"context"
	"sync"
	"testing"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/transport"
)

// TestFlightEndDisarmsAckBound ends flights with and without their
// acknowledgement: once a flight is over its ack bound must not be armed,
// or it goes off for an attempt that no longer waits, pings the agent and,
// the agent answering, re-arms itself for as long as the relay runs.
func TestFlightEndDisarmsAckBound(t *testing.T) {
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	bg, stop := context.WithCancel(context.Background())
	stop() // a closed relay starts no prober: the flights alone are tested
	var wg sync.WaitGroup
	l := newLiveness(h, nil, zerolog.Nop(), bg, &wg)
	for _, acked := range []bool{true, false, true, false} {
		ctx, cancel := context.WithCancelCause(context.Background())
		f, _ := l.begin(ctx, cancel, h.ID(), "agent")
		if acked {
			f.acked()
		}
		f.end()
		if f.timer.t.Stop() {
			t.Fatalf("acked %v: the ack bound of an ended flight was still armed", acked)
		}
		if cause := context.Cause(ctx); cause != nil {
			t.Fatalf("acked %v: flight cancelled with %v", acked, cause)
		}
		cancel(nil)
	}
	wg.Wait()
}
