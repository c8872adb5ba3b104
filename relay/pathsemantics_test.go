package relay_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay/relaytest"
)

// The HTTP semantics the relay path keeps however it is tuned, checked
// through the real parts: client, relay, QUIC, package agent, engine.

// lockstepEngine streams events one at a time: it writes event k, flushes,
// and writes event k+1 only once the client said it has read event k. A
// hop that buffered events would stall it until the wait runs out.
type lockstepEngine struct {
	*relaytest.FakeEngine
	events   int
	ack      chan int       // the client read event k
	stalled  chan int       // an event the client never acknowledged
	canceled chan time.Time // when a stream's request context ended
	hold     bool           // after the first event, wait for cancellation
}

func newLockstepEngine(t *testing.T, events int, hold bool) *lockstepEngine {
	e := &lockstepEngine{events: events, ack: make(chan int), stalled: make(chan int, 1),
		canceled: make(chan time.Time, 8), hold: hold}
	e.FakeEngine = relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "a"})
	e.SetAnswer(e.serve)
	return e
}

func (e *lockstepEngine) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/chat/completions" {
		http.NotFound(w, r)
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "text/event-stream")
	f := w.(http.Flusher)
	for k := 0; k < e.events; k++ {
		fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"e%d\"}}]}\n\n", k)
		f.Flush()
		if e.hold {
			<-r.Context().Done()
			e.canceled <- time.Now()
			return
		}
		select {
		case got := <-e.ack:
			if got != k {
				e.stalled <- k
				return
			}
		case <-time.After(10 * time.Second):
			e.stalled <- k
			return
		case <-r.Context().Done():
			return
		}
	}
	io.WriteString(w, "data: [DONE]\n\n")
}

func startLockstepPath(t *testing.T, e *lockstepEngine) string {
	t.Helper()
	rl := startRelayLogger(t, zerolog.New(io.Discard))
	relaytest.RunAgent(t, relaytest.AgentConfig("a", itToken, e.URL(), rl.Addr()))
	c := newClient(t, rl.URL)
	waitFor(t, "agent a routable", func() bool { return len(c.models()) == 1 })
	return rl.URL
}

func streamRequest(ctx context.Context, t *testing.T, url string) *http.Response {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions",
		strings.NewReader(`{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer "+itKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		t.Fatalf("status %d", resp.StatusCode)
	}
	return resp
}

// TestStreamEventsReachClientOneByOne: every event the engine flushes
// reaches the client before the engine writes the next one.
func TestStreamEventsReachClientOneByOne(t *testing.T) {
	const events = 5
	e := newLockstepEngine(t, events, false)
	url := startLockstepPath(t, e)
	resp := streamRequest(context.Background(), t, url)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for k := 0; k < events; k++ {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("event %d: %v", k, err)
		}
		if want := fmt.Sprintf(`"e%d"`, k); !strings.Contains(line, want) {
			t.Fatalf("event %d: got %q, want it to hold %s", k, line, want)
		}
		if _, err := br.ReadString('\n'); err != nil { // the blank line ending the event
			t.Fatal(err)
		}
		select {
		case e.ack <- k:
		case k := <-e.stalled:
			t.Fatalf("the engine gave up waiting for the client to read event %d", k)
		case <-time.After(15 * time.Second):
			t.Fatalf("the engine never waited for event %d's acknowledgement", k)
		}
	}
	rest, err := io.ReadAll(br)
	if err != nil || !strings.Contains(string(rest), "data: [DONE]") {
		t.Fatalf("tail %q, %v", rest, err)
	}
}

// TestClientGoneCancelsEngineWithinASecond: a client that leaves a stream
// ends the engine's request within a second, through relay and agent.
func TestClientGoneCancelsEngineWithinASecond(t *testing.T) {
	e := newLockstepEngine(t, 1, true)
	url := startLockstepPath(t, e)
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithCancel(context.Background())
		resp := streamRequest(ctx, t, url)
		if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
			cancel()
			t.Fatalf("first event %q: %v", line, err)
		}
		left := time.Now()
		cancel()
		resp.Body.Close()
		select {
		case at := <-e.canceled:
			if d := at.Sub(left); d > time.Second {
				t.Errorf("request %d: the engine saw the client leave after %v, want within 1s", i, d)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("request %d: the engine never saw the client leave", i)
		}
	}
}
