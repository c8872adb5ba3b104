package relay_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/transport"
)

// churnAgent is a lightweight agent of its own identity (a libp2p host and
// peer ID, a name, a model): it joins the relay through the real join
// protocol, serves inference streams, joins gossip, publishes a prefix
// index, and leaves.
type churnAgent struct {
	h      host.Host
	srv    io.Closer
	m      *transport.Membership
	g      *transport.Gossip
	prefix network.Stream
}

// churnAnswer is the engine's answer: a chat completion with usage.
const churnAnswer = `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`

func startChurnAgent(ctx context.Context, relayInfo peer.AddrInfo, i int) (*churnAgent, error) {
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		return nil, err
	}
	a := &churnAgent{h: h}
	fail := func(err error) (*churnAgent, error) {
		a.stop()
		return nil, err
	}
	a.srv, err = transport.ServeHTTP(h, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, churnAnswer)
	}), func(p peer.ID) bool { return p == relayInfo.ID })
	if err != nil {
		return fail(err)
	}
	if err := h.Connect(ctx, relayInfo); err != nil {
		return fail(err)
	}
	name, model := fmt.Sprintf("churn-%d", i), fmt.Sprintf("churn-model-%d", i)
	if a.m, err = transport.Join(ctx, h, relayInfo.ID, []byte(itToken), transport.JoinInfo{Name: name, Models: []string{model}}); err != nil {
		return fail(err)
	}
	a.g, err = transport.NewGossip(transport.GossipConfig{
		Host:    h,
		Admit:   func(p peer.ID) bool { return p == relayInfo.ID },
		Trusted: []peer.ID{relayInfo.ID},
		MetaSource: func() transport.NodeMeta {
			return transport.NodeMeta{Role: transport.NodeRoleAgent, Models: []string{model}, ModelsDigest: transport.ModelsDigest([]string{model})}
		},
	})
	if err != nil {
		return fail(err)
	}
	if _, err := a.g.Join(relayInfo.ID); err != nil {
		return fail(err)
	}
	// A prefix index: its hello and a snapshot of a few blocks.
	if a.prefix, err = h.NewStream(ctx, relayInfo.ID, transport.PrefixProtocol); err != nil {
		return fail(err)
	}
	var b []byte
	for _, m := range []transport.PrefixMsg{
		{Type: transport.PrefixHello},
		{Type: transport.PrefixSnapshot, Seq: 1, First: true, Last: true, Added: []uint64{uint64(i)<<8 | 1, uint64(i)<<8 | 2}},
	} {
		if b, err = transport.AppendPrefixFrame(b, &m); err != nil {
			return fail(err)
		}
	}
	if _, err := a.prefix.Write(b); err != nil {
		return fail(err)
	}
	return a, nil
}

// stop leaves as an agent that stops does: gossip leave, then the end of
// the registration, then the host.
func (a *churnAgent) stop() {
	if a.g != nil {
		_ = a.g.Leave(time.Second)
		_ = a.g.Shutdown()
	}
	if a.prefix != nil {
		_ = a.prefix.Close()
	}
	if a.m != nil {
		_ = a.m.Close()
	}
	if a.srv != nil {
		_ = a.srv.Close()
	}
	_ = a.h.Close()
}

// relayFootprint is the relay's memory and metric series at one moment.
type relayFootprint struct {
	heap   uint64 // live heap after GC, bytes
	series int    // series on /metrics
}

func footprint(t *testing.T, rl *relaytest.Relay) relayFootprint {
	t.Helper()
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	resp, err := http.Get(rl.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	n := 0
	for line := range strings.Lines(string(b)) {
		if !strings.HasPrefix(line, "#") && strings.TrimSpace(line) != "" {
			n++
		}
	}
	if dir := os.Getenv("COMPUTEFLUX_CHURN_PROFILE"); dir != "" {
		f, _ := os.Create(fmt.Sprintf("%s/heap-%d.pprof", dir, ms.NumGC))
		_ = pprof.Lookup("heap").WriteTo(f, 0)
		f.Close()
		_ = os.WriteFile(fmt.Sprintf("%s/metrics-%d.txt", dir, ms.NumGC), b, 0o644)
		g, _ := os.Create(fmt.Sprintf("%s/goroutines-%d.txt", dir, ms.NumGC))
		_ = pprof.Lookup("goroutine").WriteTo(g, 1)
		g.Close()
	}
	return relayFootprint{heap: ms.HeapAlloc, series: n}
}

// Agents that come and go under new peer IDs and names leave no state
// behind at the relay: churning identities through it (each joins, gossips,
// publishes a prefix index, serves a request and leaves) ends with the
// relay's /metrics series, and its heap, within 10% of what they were after
// the first tenth of them.
//
// By default 60 identities go through and the series are checked (their
// count leaks at once, if at all). COMPUTEFLUX_CHURN=10000 churns that many
// and checks the heap too (about 25 minutes). Libp2p keeps some state of a
// departed peer for a minute or two (its resource scope, its peerstore
// manager's note of the disconnection), and a Go map keeps the size it had
// at its fullest: so identities come at a steady churnRate, the first
// tenth fills those windows, and before each measurement the test waits
// them out.
// churnRate is the pace, in identities per second, of a heap-checking churn
// run (the machine may make it slower).
const churnRate = 8

func TestChurnStaysBounded(t *testing.T) {
	if os.Getenv("COMPUTEFLUX_CHURN_PROFILE") != "" {
		runtime.MemProfileRate = 512
	}
	total, first, full := 60, 10, false
	if v, err := strconv.Atoi(os.Getenv("COMPUTEFLUX_CHURN")); err == nil && v >= 10 {
		total, first, full = v, v/10, true
	}
	rl := relaytest.ServeRelay(t, relay.Config{
		P2PListen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"},
		Token:     []byte(itToken),
		APIKeys:   []string{itKey},
		Logger:    zerolog.New(io.Discard),
	})
	relayInfo := rl.Info()
	c := newClient(t, rl.URL)
	ctx := context.Background()

	const workers = 4
	var stops sync.WaitGroup
	churn := func(from, to int) {
		defer stops.Wait()
		var wg sync.WaitGroup
		errc := make(chan error, workers)
		next := make(chan int)
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					jctx, cancel := context.WithTimeout(ctx, 20*time.Second)
					a, err := startChurnAgent(jctx, relayInfo, i)
					cancel()
					if err != nil {
						errc <- fmt.Errorf("agent %d: %w", i, err)
						return
					}
					resp, err := c.post("/v1/chat/completions", fmt.Sprintf(`{"model":"churn-model-%d","messages":[{"role":"user","content":"hi"}]}`, i))
					if err == nil {
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if resp.StatusCode != http.StatusOK || resp.Header.Get(relay.HeaderAgent) != fmt.Sprintf("churn-%d", i) {
							err = fmt.Errorf("status %d from %q", resp.StatusCode, resp.Header.Get(relay.HeaderAgent))
						}
					}
					stops.Add(1)
					go func() {
						defer stops.Done()
						a.stop()
					}()
					if err != nil {
						errc <- fmt.Errorf("agent %d: request: %w", i, err)
						return
					}
				}
			}()
		}
		var pace <-chan time.Time // nil: as fast as the workers go
		if full {
			tk := time.NewTicker(time.Second / churnRate)
			defer tk.Stop()
			pace = tk.C
		}
	feed:
		for i := from; i < to; i++ {
			if pace != nil {
				<-pace
			}
			select {
			case next <- i:
			case err := <-errc:
				close(next)
				wg.Wait()
				t.Fatal(err)
				break feed
			}
		}
		close(next)
		wg.Wait()
		select {
		case err := <-errc:
			t.Fatal(err)
		default:
		}
	}

	start := time.Now()
	churn(0, first)
	t.Logf("%d identities in %v", first, time.Since(start))
	base := settle(t, rl, full)
	t.Logf("after %d identities: heap %d KiB, %d series", first, base.heap>>10, base.series)
	churn(first, total)
	t.Logf("%d identities in %v", total, time.Since(start))
	end := settle(t, rl, full)
	t.Logf("after %d identities: heap %d KiB, %d series", total, end.heap>>10, end.series)
	if full && float64(end.heap) > 1.1*float64(base.heap) {
		t.Errorf("relay heap grew from %d KiB to %d KiB over %d more identities", base.heap>>10, end.heap>>10, total-first)
	}
	if float64(end.series) > 1.1*float64(base.series) {
		t.Errorf("/metrics series grew from %d to %d over %d more identities", base.series, end.series, total-first)
	}
}

// libp2pRetention bounds how long libp2p keeps a departed peer's state of
// its own: the resource manager frees unused peer scopes on a one-minute
// tick, so a scope lives up to two minutes after its last use.
const libp2pRetention = 2*time.Minute + 10*time.Second

// settle waits until the relay holds no registration and no connection
// from a churned agent and, for a heap measurement (withHeap), until
// libp2p's own retention has passed and the heap holds still; it returns
// the footprint then.
func settle(t *testing.T, rl *relaytest.Relay, withHeap bool) relayFootprint {
	t.Helper()
	waitFor(t, "every churned agent gone", func() bool {
		return len(rl.Relay.Registry().Agents()) == 0 && len(rl.Relay.Host().Network().Peers()) == 0
	})
	fp := footprint(t, rl)
	if !withHeap {
		return fp
	}
	since := time.Now()
	for deadline := since.Add(2 * libp2pRetention); time.Now().Before(deadline); {
		time.Sleep(10 * time.Second) // a pace, not a wait for a condition: the loop checks it
		prev := fp
		fp = footprint(t, rl)
		still := float64(fp.heap) <= 1.02*float64(prev.heap) && float64(prev.heap) <= 1.02*float64(fp.heap)
		if time.Since(since) >= libp2pRetention && still {
			break
		}
	}
	return fp
}
