package transport

import (
	"sync/atomic"
	"time"

	pbv2 "github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/pb"
	"github.com/libp2p/go-libp2p/p2p/protocol/circuitv2/relay"
)

// RelayCounters counts what a relay's circuit relay service granted,
// refused and carried (RelayNATConfig.Counters). The zero value is ready;
// its methods are safe for concurrent use.
type RelayCounters struct {
	reservationsGranted, reservationsRefused atomic.Uint64
	circuitsOpened, circuitsRefused          atomic.Uint64
	bytes                                    atomic.Uint64
}

// RelayCircuitStats is a snapshot of RelayCounters.
type RelayCircuitStats struct {
	// ReservationsGranted counts reservations and renewals granted;
	// ReservationsRefused the requests answered with any other status.
	ReservationsGranted, ReservationsRefused uint64
	// CircuitsOpened counts relayed connections set up; CircuitsRefused
	// the connection requests answered with any other status.
	CircuitsOpened, CircuitsRefused uint64
	// Bytes counts the bytes relayed, both directions.
	Bytes uint64
}

// Stats returns the counters.
func (c *RelayCounters) Stats() RelayCircuitStats {
	return RelayCircuitStats{
		ReservationsGranted: c.reservationsGranted.Load(),
		ReservationsRefused: c.reservationsRefused.Load(),
		CircuitsOpened:      c.circuitsOpened.Load(),
		CircuitsRefused:     c.circuitsRefused.Load(),
		Bytes:               c.bytes.Load(),
	}
}

// relayTracer feeds RelayCounters from the relay service's tracer hooks.
type relayTracer struct{ c *RelayCounters }

var _ relay.MetricsTracer = relayTracer{}

func (relayTracer) RelayStatus(bool)               {}
func (t relayTracer) ConnectionOpened()            { t.c.circuitsOpened.Add(1) }
func (relayTracer) ConnectionClosed(time.Duration) {}
func (t relayTracer) ConnectionRequestHandled(s pbv2.Status) {
	if s != pbv2.Status_OK {
		t.c.circuitsRefused.Add(1)
	}
}
func (relayTracer) ReservationAllowed(bool) {}
func (relayTracer) ReservationClosed(int)   {}
func (t relayTracer) ReservationRequestHandled(s pbv2.Status) {
	if s == pbv2.Status_OK {
		t.c.reservationsGranted.Add(1)
	} else {
		t.c.reservationsRefused.Add(1)
	}
}
func (t relayTracer) BytesTransferred(n int) { t.c.bytes.Add(uint64(n)) }
