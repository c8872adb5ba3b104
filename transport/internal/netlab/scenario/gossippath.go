package scenario

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// GossipPath is what a cluster shows about the path between two agents'
// gossip, from three independent sources: the agents' logs (AgentNAT's
// "direct path to peer" and "hole punch" lines, memberlist's suspicions),
// and the home routers' packet counters.
type GossipPath struct {
	A, B int // homes
	// Direct: an agent logged a direct path to the other.
	Direct bool
	// UpgradeMS is AgentNAT's time from the first relayed connection between
	// the two (first contact) to the direct one; JoinToDirect runs from the
	// later of the two agents' gossip joins.
	UpgradeMS    float64
	JoinToDirect time.Duration
	// Punches and PunchesOK count hole-punch attempts between the two, as
	// either side logged them.
	Punches, PunchesOK int
	// DataAB and DataBA are data-sized packets (netlab.DataPacketMin) that
	// went straight from one home's WAN address to the other's and were
	// delivered into the home during the observation window (counted by the
	// receiving router), A to B and B to A: gossip on the direct path.
	// Hole-punch attempts that the other NAT drops are not counted.
	DataAB, DataBA uint64
	Window         time.Duration
	// ProbeFailures counts memberlist lines in either agent's log about a
	// failed probe of the other, or a suspicion of it: gossip between them
	// did not get through in time.
	ProbeFailures int
}

// ObserveGossipPath waits until the path between the agents of homes a and
// b is settled (a direct path logged, or punches hole-punch attempts
// logged, or settle passed since both joined the gossip), then watches it
// for window and reports what it saw.
func (c *Cluster) ObserveGossipPath(ctx context.Context, a, b int, punches int, settle, window time.Duration) (GossipPath, error) {
	r := GossipPath{A: a, B: b}
	pa, pb := c.Agents[a], c.Agents[b]
	if pa == nil || pb == nil || pa.PeerID == "" || pb.PeerID == "" {
		return r, errors.New("both agents must run and have printed their peer IDs")
	}
	var joined time.Time
	for _, p := range []*Process{pa, pb} {
		l, err := p.Log.Wait(ctx, Msg("joined the gossip"))
		if err != nil {
			return r, fmt.Errorf("%s never joined the gossip: %w", p.Name, err)
		}
		if l.At.After(joined) {
			joined = l.At
		}
	}
	about := func(self, other *Process, msg string) func(Line) bool {
		return func(l Line) bool { return l.Message() == msg && l.Str("peer") == other.PeerID }
	}
	directA, directB := about(pa, pb, "direct path to peer"), about(pb, pa, "direct path to peer")
	punchA, punchB := about(pa, pb, "hole punch"), about(pb, pa, "hole punch")
	settled := func(context.Context) (bool, error) {
		if len(pa.Log.Lines(0, directA)) > 0 || len(pb.Log.Lines(0, directB)) > 0 {
			return true, nil
		}
		return len(pa.Log.Lines(0, punchA))+len(pb.Log.Lines(0, punchB)) >= punches ||
			time.Since(joined) >= settle, nil
	}
	if err := Poll(ctx, 50*time.Millisecond, settled); err != nil {
		return r, fmt.Errorf("path between %s and %s never settled: %w", pa.Name, pb.Name, err)
	}

	// Delivered into b from a, and into a from b.
	inB, inA := "from_"+AgentName(a)+"_data", "from_"+AgentName(b)+"_data"
	count := func() (ab, ba uint64, err error) {
		cb, err := c.Lab.Counters(b)
		if err != nil {
			return 0, 0, err
		}
		ca, err := c.Lab.Counters(a)
		if err != nil {
			return 0, 0, err
		}
		return cb[inB].Packets, ca[inA].Packets, nil
	}
	ab0, ba0, err := count()
	if err != nil {
		return r, err
	}
	start := time.Now()
	select {
	case <-time.After(window):
	case <-ctx.Done():
		return r, ctx.Err()
	}
	ab1, ba1, err := count()
	if err != nil {
		return r, err
	}
	r.Window = time.Since(start)
	r.DataAB, r.DataBA = ab1-ab0, ba1-ba0

	for _, l := range append(pa.Log.Lines(0, directA), pb.Log.Lines(0, directB)...) {
		if !r.Direct || l.At.Sub(joined) < r.JoinToDirect {
			r.JoinToDirect = max(0, l.At.Sub(joined))
			if ms, ok := l.Fields["after"].(float64); ok {
				r.UpgradeMS = ms
			}
		}
		r.Direct = true
	}
	for _, l := range append(pa.Log.Lines(0, punchA), pb.Log.Lines(0, punchB)...) {
		r.Punches++
		if ok, _ := l.Fields["success"].(bool); ok {
			r.PunchesOK++
		}
	}
	failures := func(other *Process) func(Line) bool {
		return func(l Line) bool {
			m := strings.ToLower(l.Message())
			return strings.Contains(l.Message(), other.PeerID) && (strings.Contains(m, "suspect") || strings.Contains(m, "failed"))
		}
	}
	r.ProbeFailures = len(pa.Log.Lines(0, failures(pb))) + len(pb.Log.Lines(0, failures(pa)))
	return r, nil
}

// Check returns why r does not show the expected path, or nil. Direct: an
// agent logged the direct path and gossip packets crossed it both ways
// during the window. Relayed: no direct path, nothing crossed directly, and
// neither agent ever failed a probe of the other, so their gossip went
// through the relay's circuit (the only other path). Whether a punch was
// tried on the relayed path is reported, not required.
func (r GossipPath) Check(wantDirect bool) error {
	var errs []error
	if wantDirect {
		if !r.Direct {
			errs = append(errs, errors.New("no direct path was logged"))
		}
		if r.DataAB == 0 || r.DataBA == 0 {
			errs = append(errs, fmt.Errorf("gossip did not take the direct path: %d and %d data packets crossed it in %v",
				r.DataAB, r.DataBA, r.Window.Round(time.Millisecond)))
		}
	} else {
		if r.Direct || r.PunchesOK > 0 {
			errs = append(errs, errors.New("a direct path appeared"))
		}
		if r.DataAB+r.DataBA > 0 {
			errs = append(errs, fmt.Errorf("%d data packets crossed directly", r.DataAB+r.DataBA))
		}
	}
	return errors.Join(errs...)
}

// Lossless reports an error when gossip between the two agents lost probes
// (failed probes or suspicions) during the observation window.
func (r GossipPath) Lossless() error {
	if r.ProbeFailures > 0 {
		return fmt.Errorf("%d failed probes or suspicions between the agents", r.ProbeFailures)
	}
	return nil
}

// Path is "direct" or "relayed".
func (r GossipPath) Path() string {
	if r.Direct {
		return "direct"
	}
	return "relayed"
}
