package scenario

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/computeflux/computeflux/transport/internal/netlab"
)

// Role is a running role process and its line protocol.
type Role struct {
	Hello Hello
	proc  *netlab.Proc
	enc   *json.Encoder
}

// StartRole starts the role in namespace ns from binary exe (a test binary
// whose TestMain calls MaybeRunRole) and waits for its Hello.
func StartRole(ctx context.Context, lab *netlab.Lab, ns, exe, role string, cfg RoleConfig, stderr io.Writer) (*Role, error) {
	js, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	p, err := lab.Start(ns, []string{RoleEnv + "=" + role, ConfigEnv + "=" + string(js)}, stderr, exe)
	if err != nil {
		return nil, err
	}
	r := &Role{proc: p, enc: json.NewEncoder(p.Stdin)}
	if err := r.read(ctx, &r.Hello); err != nil {
		return nil, fmt.Errorf("%s in %s: %w", role, ns, err)
	}
	if r.Hello.Error != "" {
		return nil, fmt.Errorf("%s in %s: %s", role, ns, r.Hello.Error)
	}
	return r, nil
}

// read decodes the role's next line into v, giving up when ctx ends (the
// process is then stopped, which unblocks the read).
func (r *Role) read(ctx context.Context, v any) error {
	done := make(chan error, 1)
	go func() {
		line, err := r.proc.Stdout.ReadBytes('\n')
		if err != nil {
			done <- fmt.Errorf("role exited: %w", err)
			return
		}
		done <- json.Unmarshal(line, v)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		r.proc.Stop(time.Second)
		<-done
		return ctx.Err()
	}
}

// Do sends a command and waits for the reply.
func (r *Role) Do(ctx context.Context, c Command) (Reply, error) {
	var rep Reply
	if err := r.enc.Encode(c); err != nil {
		return rep, err
	}
	if err := r.read(ctx, &rep); err != nil {
		return rep, err
	}
	if rep.Error != "" {
		return rep, errors.New(rep.Error)
	}
	return rep, nil
}

// Stop ends the role process.
func (r *Role) Stop() {
	_ = r.proc.Stdin.Close()
	r.proc.Stop(3 * time.Second)
}

// HolePunchRun is the outcome of one hole-punch run: peer A (in the first
// home) reaches peer B (in the second) through the relay; B, which receives
// the relayed connection, starts the punch.
type HolePunchRun struct {
	A, B   netlab.NATKind
	Direct bool  // the relayed connection became direct
	A2B    Reply // A's view: timings, RTTs, path, stream path
	BStats Reply // B's counters after the run
	Build  time.Duration
}

// HolePunchConfig configures RunHolePunch.
type HolePunchConfig struct {
	A, B netlab.NATKind
	// Exe is the binary to run roles from; "" means this process's binary.
	Exe string
	// WaitDirect bounds the wait for a direct connection [20s].
	WaitDirect time.Duration
	// PunchTimeout is passed to the peers (0: the product default).
	PunchTimeout time.Duration
	// Prefix and Logf are passed to netlab.
	Prefix string
	Logf   func(string, ...any)
	Stderr io.Writer
}

// RunHolePunch builds a fresh lab (relay, two homes), runs one attempt and
// tears the lab down.
func RunHolePunch(ctx context.Context, cfg HolePunchConfig) (HolePunchRun, error) {
	run := HolePunchRun{A: cfg.A, B: cfg.B}
	if cfg.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return run, err
		}
		cfg.Exe = exe
	}
	if cfg.WaitDirect == 0 {
		cfg.WaitDirect = 20 * time.Second
	}
	t := time.Now()
	lab, err := netlab.New(netlab.Config{Homes: []netlab.NATKind{cfg.A, cfg.B}, Prefix: cfg.Prefix, Logf: cfg.Logf})
	if err != nil {
		return run, err
	}
	defer lab.Close()
	run.Build = time.Since(t)

	cidrs := []string{netlab.PublicCIDR}
	relay, err := StartRole(ctx, lab, lab.Relay.NS, cfg.Exe, "relay", RoleConfig{
		Listen: "/ip4/" + netlab.RelayIP + "/udp/4001/quic-v1", PublicCIDRs: cidrs,
	}, cfg.Stderr)
	if err != nil {
		return run, err
	}
	defer relay.Stop()
	relayAddr := "/ip4/" + netlab.RelayIP + "/udp/4001/quic-v1/p2p/" + relay.Hello.ID
	peerCfg := RoleConfig{Listen: "/ip4/0.0.0.0/udp/4001/quic-v1", PublicCIDRs: cidrs, Relay: relayAddr, PunchTimeout: cfg.PunchTimeout}
	a, err := StartRole(ctx, lab, lab.Homes[0].NS, cfg.Exe, "peer", peerCfg, cfg.Stderr)
	if err != nil {
		return run, err
	}
	defer a.Stop()
	b, err := StartRole(ctx, lab, lab.Homes[1].NS, cfg.Exe, "peer", peerCfg, cfg.Stderr)
	if err != nil {
		return run, err
	}
	defer b.Stop()

	run.A2B, err = a.Do(ctx, Command{Cmd: "connect", Peer: b.Hello.ID, WaitDirect: cfg.WaitDirect, GiveUpAfterPunches: 3})
	if err != nil {
		return run, err
	}
	run.Direct = run.A2B.Path == "direct"
	run.BStats, err = b.Do(ctx, Command{Cmd: "stats"})
	return run, err
}

// Summary aggregates runs of one NAT pairing.
type Summary struct {
	Name       string
	Runs       int
	Direct     int
	StreamOK   int
	ToDirectMS []float64 // relayed connection to direct (AgentNAT's upgrade time), per direct run
	ContactMS  []float64 // first contact (dial start) to direct, per direct run
	RTTRelayed []float64
	RTTDirect  []float64
	GaveUpMS   []float64 // relayed connection to the last failed punch, per relayed run
	Errors     []string
}

// Add records one run (or its error).
func (s *Summary) Add(r HolePunchRun, err error) {
	s.Runs++
	if err != nil {
		s.Errors = append(s.Errors, err.Error())
		return
	}
	if r.Direct {
		s.Direct++
		// The upgrade time stamped by AgentNAT's connection notifier is exact;
		// DirectMS is when this side looked, after pinging the relayed path.
		up := r.A2B.UpgradeMS
		if up == 0 {
			up = r.A2B.DirectMS
		}
		s.ToDirectMS = append(s.ToDirectMS, up)
		s.ContactMS = append(s.ContactMS, r.A2B.RelayedMS+up)
		if r.A2B.RTTDirectMS > 0 {
			s.RTTDirect = append(s.RTTDirect, r.A2B.RTTDirectMS)
		}
	}
	if r.A2B.GaveUpMS > 0 {
		s.GaveUpMS = append(s.GaveUpMS, r.A2B.GaveUpMS)
	}
	if r.A2B.StreamOK {
		s.StreamOK++
	}
	if r.A2B.RTTRelayedMS > 0 {
		s.RTTRelayed = append(s.RTTRelayed, r.A2B.RTTRelayedMS)
	}
}

// Median returns the median of xs (0 when empty).
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// Line renders the summary as the one-line scenario report natlab.sh prints:
// SCENARIO <name> PASS|FAIL key=value...
func (s *Summary) Line(pass bool) string {
	verdict := "FAIL"
	if pass {
		verdict = "PASS"
	}
	minmax := func(xs []float64) string {
		if len(xs) == 0 {
			return "-"
		}
		s := append([]float64(nil), xs...)
		sort.Float64s(s)
		return fmt.Sprintf("%.0f..%.0f", s[0], s[len(s)-1])
	}
	parts := []string{
		"SCENARIO", s.Name, verdict,
		fmt.Sprintf("runs=%d", s.Runs),
		fmt.Sprintf("direct=%d/%d", s.Direct, s.Runs),
		fmt.Sprintf("stream_ok=%d/%d", s.StreamOK, s.Runs),
		fmt.Sprintf("to_direct_ms_p50=%.1f", Median(s.ToDirectMS)),
		fmt.Sprintf("to_direct_ms_range=%s", minmax(s.ToDirectMS)),
		fmt.Sprintf("contact_to_direct_ms_p50=%.1f", Median(s.ContactMS)),
		fmt.Sprintf("rtt_relayed_ms_p50=%.3f", Median(s.RTTRelayed)),
		fmt.Sprintf("rtt_direct_ms_p50=%.3f", Median(s.RTTDirect)),
		fmt.Sprintf("gave_up_ms_p50=%.0f", Median(s.GaveUpMS)),
		fmt.Sprintf("errors=%d", len(s.Errors)),
	}
	return strings.Join(parts, " ")
}
