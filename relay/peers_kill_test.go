package relay_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/ports"
	"github.com/computeflux/computeflux/relay/relaytest/slow"
	"github.com/computeflux/computeflux/transport"
)

// The relay process for TestPeerRelayKilledUnderLoad: the test binary run
// again with this test selected and its configuration in the environment.
const (
	envRelayProcess = "COMPUTEFLUX_TEST_RELAY_PROCESS" // "1" in the child
	envRelayP2P     = "COMPUTEFLUX_TEST_RELAY_P2P"
	envRelayID      = "COMPUTEFLUX_TEST_RELAY_IDENTITY"
	envRelayHTTP    = "COMPUTEFLUX_TEST_RELAY_HTTP"
)

// TestRelayProcessHelper is not a test: it is the relay process that
// TestPeerRelayKilledUnderLoad starts and kills. Run directly, it skips.
func TestRelayProcessHelper(t *testing.T) {
	if os.Getenv(envRelayProcess) != "1" {
		t.Skip("the relay process of TestPeerRelayKilledUnderLoad, not a test")
	}
	r, err := relay.New(relay.Config{
		P2PListen:    []string{os.Getenv(envRelayP2P)},
		IdentityFile: os.Getenv(envRelayID),
		Token:        []byte(gToken),
		NoAuth:       true,
		Gossip:       relay.GossipConfig{Tune: gFastTune},
		WarmUp:       5 * time.Second,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", os.Getenv(envRelayHTTP))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	_ = r.Serve(ctx, ln)
	os.Exit(0)
}

// relayProcess is a relay running as a child process.
type relayProcess struct {
	cmd  *exec.Cmd
	url  string
	done chan struct{}
}

func startRelayProcess(t *testing.T, p2p, identity, httpAddr string) *relayProcess {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestRelayProcessHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), envRelayProcess+"=1", envRelayP2P+"="+p2p, envRelayID+"="+identity, envRelayHTTP+"="+httpAddr)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	rp := &relayProcess{cmd: cmd, url: "http://" + httpAddr, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(rp.done) }()
	t.Cleanup(func() { rp.kill() })
	return rp
}

// kill SIGKILLs the process (no goodbye to anyone) and waits for it.
func (rp *relayProcess) kill() {
	_ = rp.cmd.Process.Signal(syscall.SIGKILL)
	<-rp.done
}

// TestPeerRelayKilledUnderLoad runs two relays, one in this process and one
// as a child process, with agents joined to both and clients spreading
// keyed, non-streamed turns over both at random. A client retries a
// connection error on the other relay, twice at most, as the OpenAI SDKs
// do. The child is SIGKILLed under load and started again: no request
// fails, and the restarted relay routes again soon after its start.
func TestPeerRelayKilledUnderLoad(t *testing.T) {
	slow.Gate(t, "SIGKILLs a relay process under load")
	if os.Getenv(envRelayProcess) == "1" {
		t.Skip("inside the relay process")
	}
	t.Parallel() // paced load and a process restart, in its own relays and agents
	dir := t.TempDir()
	listenA := ports.QUIC(t)
	a := startPeerRelay(t, listenA, filepath.Join(dir, "a.key"), "relay-a")
	listenB, idB, httpB := ports.QUIC(t), filepath.Join(dir, "b.key"), ports.Free(t, "tcp")
	// The identity file is made here, so that the agents know the child's
	// peer ID before it starts.
	key, err := transport.LoadOrCreateIdentity(idB)
	if err != nil {
		t.Fatal(err)
	}
	pidB, err := peer.IDFromPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	idBPeer := pidB.String()
	b := startRelayProcess(t, listenB, idB, httpB)
	addrs := []string{listenA + "/p2p/" + a.Relay.Host().ID().String(), listenB + "/p2p/" + idBPeer}
	const na = 3
	for i := range na {
		name := fmt.Sprintf("agent-%d", i)
		relaytest.RunAgent(t, gAgentConfig(t, name, relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: name, VLLMMetrics: true}), filepath.Join(dir, name+".key"), gFastTune, "", addrs...))
	}
	relaytest.Within(t, 60*time.Second, "relay a to share sessions with the relay process", func() bool {
		return len(a.Relay.PeerRelays()) == 1
	})
	hc := &http.Client{Timeout: 20 * time.Second}
	defer hc.CloseIdleConnections()
	urls := []string{a.URL, b.url}
	relaytest.Within(t, 60*time.Second, "the relay process to serve", func() bool {
		_, _, err := chat(hc, &relaytest.Relay{URL: b.url}, "probe")
		return err == nil
	})

	// Load: 6 clients, each a session, each turn to a relay at random.
	var (
		sent, failed, retried, sameAgent, turns atomic.Int64
		crossTurns, crossSame                   atomic.Int64 // follow-ups served by the other relay than the turn before
		errMu                                   sync.Mutex
		errs                                    []string
		missAt                                  []time.Time // when a cross-relay follow-up changed agent
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 7))
			session := fmt.Sprintf("load-%d", c)
			last, lastRelay := "", -1
			for n := 0; n < 2000; n++ {
				select {
				case <-stop:
					return
				default:
				}
				first := rng.IntN(2)
				var agentName string
				var err error
				via := first
				for try := range 3 {
					via = (first + try) % 2
					agentName, _, err = chat(hc, &relaytest.Relay{URL: urls[via]}, session)
					if err == nil || !isConnError(err) {
						break
					}
					retried.Add(1)
				}
				sent.Add(1)
				if err != nil {
					failed.Add(1)
					errMu.Lock()
					errs = append(errs, err.Error())
					errMu.Unlock()
					continue
				}
				if last != "" {
					turns.Add(1)
					if agentName == last {
						sameAgent.Add(1)
					}
					if via != lastRelay {
						crossTurns.Add(1)
						if agentName == last {
							crossSame.Add(1)
						} else {
							errMu.Lock()
							missAt = append(missAt, time.Now())
							errMu.Unlock()
						}
					}
				}
				last, lastRelay = agentName, via
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	time.Sleep(2 * time.Second)
	before := sent.Load()
	b.kill()
	killedAt := time.Now()
	time.Sleep(2 * time.Second)
	during := sent.Load() - before
	b = startRelayProcess(t, listenB, idB, httpB)
	startedAt := time.Now()
	back := relaytest.Within(t, 30*time.Second, "the restarted relay to route a request", func() bool {
		_, _, err := chat(hc, &relaytest.Relay{URL: b.url}, "probe-after")
		return err == nil
	})
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	t.Logf("requests %d (%d in the 2 s after the kill at %v), failed %d, retried on the other relay %d; follow-ups on the same agent %d/%d, of those served by the other relay than the turn before %d/%d; restarted relay routed %v after its start (%v)",
		sent.Load(), during, killedAt.Format("15:04:05.000"), failed.Load(), retried.Load(), sameAgent.Load(), turns.Load(), crossSame.Load(), crossTurns.Load(), back, startedAt.Format("15:04:05.000"))
	var missBefore, missDown, missAfter int
	for _, at := range missAt {
		switch {
		case at.Before(killedAt):
			missBefore++
		case at.Before(startedAt):
			missDown++
		default:
			missAfter++
		}
	}
	t.Logf("cross-relay follow-ups that changed agent: %d before the kill, %d while the relay was down, %d after its restart", missBefore, missDown, missAfter)
	if failed.Load() != 0 {
		t.Errorf("%d requests failed: %s", failed.Load(), strings.Join(errs[:min(len(errs), 5)], "; "))
	}
	if retried.Load() == 0 {
		t.Error("no request was retried on the other relay: the kill did not meet the load")
	}
	if during == 0 {
		t.Error("no request completed while the relay process was down")
	}
	// Sessions keep their agent across relays, the kill and the restart:
	// a binding made on one relay is shared with the other, the surviving
	// relay holds every binding, and the restarted one rebuilds them from
	// it before it places a follow-up (package peering: the resync and the wait).
	// What shows the sharing is the follow-up sent to the other relay than
	// the turn before: 445 of 445 of those stayed (432 of 432 and 449 of
	// 449 in other runs; with 8 busy loops beside the test, 24 of 25, 27
	// of 28 and 23 of 24). An agent slow to acknowledge under load is
	// avoided and its sessions legitimately move, one miss per move.
	// Without sharing each relay binds a session on its own: 45 of 537 of
	// those stayed. Without the resync, the surviving relay kept writing
	// to the killed process's connection and under CI's load the
	// restarted relay did not get its table for seconds: 228 of 349.
	if n, same := crossTurns.Load(), crossSame.Load(); n == 0 || same*10 < n*9 {
		t.Errorf("follow-ups served by the other relay on the same agent %d of %d, want at least 90%%: sessions lost their agent across relays", same, n)
	}
}

// isConnError reports whether err is a connection failure (refused, reset,
// closed before the response), which an OpenAI SDK retries.
func isConnError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET)
}
