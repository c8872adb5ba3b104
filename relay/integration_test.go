package relay_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/multiformats/go-multiaddr"
	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
	"github.com/computeflux/computeflux/relay/relaytest/poll"
	"github.com/computeflux/computeflux/transport"
)

// These tests run the real parts over QUIC on 127.0.0.1: a relay with its
// libp2p host, agents that join it with the token, and httptest engines
// that speak the OpenAI API.

const (
	itToken = "join-secret-for-tests"
	itKey   = "sk-integration"
)

func startRelay(t testing.TB, identity string, p2pAddr string) *relaytest.Relay {
	t.Helper()
	return startRelayWith(t, identity, p2pAddr, zerolog.New(io.Discard))
}

func startRelayLogger(t testing.TB, log zerolog.Logger) *relaytest.Relay {
	t.Helper()
	return startRelayWith(t, "", "", log)
}

func startRelayWith(t testing.TB, identity string, p2pAddr string, log zerolog.Logger) *relaytest.Relay {
	t.Helper()
	if p2pAddr == "" {
		p2pAddr = "/ip4/127.0.0.1/udp/0/quic-v1"
	}
	return relaytest.ServeRelay(t, relay.Config{
		P2PListen:    []string{p2pAddr},
		IdentityFile: identity,
		Token:        []byte(itToken),
		APIKeys:      []string{itKey},
		Logger:       log,
	})
}

// peerIDFor returns a distinct fake peer ID (for relays without libp2p).
func peerIDFor(i int) peer.ID { return peer.ID(fmt.Sprintf("fake-peer-%d", i)) }

func joinInfo(name string) transport.JoinInfo {
	return transport.JoinInfo{Name: name, Models: []string{"m1"}}
}

func newHost(t testing.TB) host.Host {
	t.Helper()
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h
}

// waitFor polls cond until it holds or a generous deadline passes.
var waitFor = poll.Eventually

// waitAgents waits until each named agent is joined with its models and is
// neither draining nor dead, so requests may be routed to it. /v1/models
// alone does not show that when several agents serve the same models: it
// lists a model as soon as one of them has joined.
func waitAgents(t testing.TB, rl *relaytest.Relay, names ...string) {
	t.Helper()
	waitFor(t, "agents "+strings.Join(names, ", ")+" routable", func() bool {
		joined := map[string]relay.AgentInfo{}
		for _, a := range rl.Relay.Registry().Agents() {
			joined[a.Name] = a
		}
		for _, n := range names {
			a, ok := joined[n]
			if !ok || len(a.Models) == 0 || a.Draining || a.Dead || a.Health.Draining {
				return false
			}
		}
		return true
	})
}

type client struct {
	t   testing.TB
	url string
	hc  *http.Client
}

func newClient(t testing.TB, url string) *client {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &client{t: t, url: url, hc: &http.Client{Transport: tr, Timeout: time.Minute}}
}

func (c *client) post(path, body string, hdr ...string) (*http.Response, error) {
	req, _ := http.NewRequest("POST", c.url+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+itKey)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return c.hc.Do(req)
}

// chat returns the status and serving agent of a non-streamed completion.
func (c *client) chat(model, session string) (int, string) {
	c.t.Helper()
	resp, err := c.post("/v1/chat/completions", `{"model":"`+model+`","messages":[{"role":"user","content":"hi"}]}`, "X-Session-ID", session)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, resp.Header.Get(relay.HeaderAgent)
}

func (c *client) models() []string {
	c.t.Helper()
	req, _ := http.NewRequest("GET", c.url+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer "+itKey)
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct{ Data []struct{ ID string } }
	_ = json.NewDecoder(resp.Body).Decode(&list)
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	return ids
}

func TestIntegrationRouting(t *testing.T) {
	t.Parallel() // waits on agents over QUIC, in its own relay
	rl := startRelay(t, "", "")
	// a, b, c and d are package agent Agents; d's packets will be dropped
	// without any goodbye.
	engines := map[string]*relaytest.FakeEngine{}
	agents := map[string]*relaytest.Agent{}
	for _, n := range []string{"a", "b", "c", "d"} {
		models := []string{"m1"}
		if n != "b" {
			models = append(models, "only-"+n)
		}
		engines[n] = relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: n, Models: models})
		agents[n] = relaytest.RunKillableAgent(t, relaytest.AgentConfig(n, itToken, engines[n].URL(), rl.Addr()))
	}
	c := newClient(t, rl.URL)
	waitAgents(t, rl, "a", "b", "c", "d")

	t.Run("sessions spread", func(t *testing.T) {
		seen := map[string]int{}
		for i := 0; i < 30; i++ {
			status, agent := c.chat("m1", fmt.Sprintf("spread-%d", i))
			if status != 200 {
				t.Fatal(status)
			}
			seen[agent]++
		}
		t.Logf("30 new sessions: %v", seen)
		for a, n := range seen {
			if n > 20 {
				t.Errorf("agent %s took %d of 30 new sessions: %v", a, n, seen)
			}
		}
	})
	t.Run("same session, same agent", func(t *testing.T) {
		var first string
		for i := 0; i < 20; i++ {
			status, agent := c.chat("m1", "it-session")
			if status != 200 {
				t.Fatalf("request %d: %d", i, status)
			}
			if i == 0 {
				first = agent
			} else if agent != first {
				t.Fatalf("request %d on %s, session began on %s", i, agent, first)
			}
		}
	})
	t.Run("stream first event before the engine finishes", func(t *testing.T) {
		e := engines["a"]
		g := e.Hold()
		defer e.Unhold()
		resp, err := c.post("/v1/chat/completions", `{"model":"only-a","stream":true}`)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		line, err := br.ReadString('\n')
		if err != nil || !strings.Contains(line, "hello") || resp.Header.Get(relay.HeaderAgent) != "a" {
			t.Fatalf("first line %q %v from %q", line, err, resp.Header.Get(relay.HeaderAgent))
		}
		select {
		case <-g.Done():
			t.Fatal("engine finished before the first event reached the client")
		default:
		}
		g.Release()
		rest, _ := io.ReadAll(br)
		if !strings.Contains(string(rest), "[DONE]") {
			t.Errorf("rest %q", rest)
		}
	})
	t.Run("client disconnect cancels the engine's request", func(t *testing.T) {
		e := engines["a"]
		g := e.Hold()
		defer e.Unhold()
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, "POST", c.url+"/v1/chat/completions", strings.NewReader(`{"model":"only-a","stream":true}`))
		req.Header.Set("Authorization", "Bearer "+itKey)
		resp, err := c.hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		cancel()
		resp.Body.Close()
		select {
		case <-g.Done(): // the handler returned without release: its request was cancelled
		case <-time.After(30 * time.Second):
			g.Release()
			t.Fatal("the engine's request outlived the client")
		}
	})
	t.Run("agent silenced mid-run", func(t *testing.T) {
		// Sessions spread over all four; then d's every packet vanishes,
		// as when its machine loses power. Every following request must
		// succeed elsewhere.
		for i := 0; i < 12; i++ {
			c.chat("m1", fmt.Sprintf("mid-%d", i))
		}
		agents["d"].Kill()
		for i := 0; i < 30; i++ {
			status, agent := c.chat("m1", fmt.Sprintf("mid-%d", i%12))
			if status != 200 || agent == "d" {
				t.Fatalf("request %d after d died: %d from %q", i, status, agent)
			}
		}
		// The relay's liveness checks find it dead (liveness.DeadAfter)
		// and its models go from the list.
		waitFor(t, "only-d dropped from /v1/models", func() bool {
			return strings.Join(c.models(), ",") == "m1,only-a,only-c"
		})
		// Its registration may last until its connection times out, but
		// out of routing.
		for _, a := range rl.Relay.Registry().Agents() {
			if a.Name == "d" && !a.Dead && !a.Health.Draining {
				t.Errorf("d still routable: %+v", a)
			}
		}
		if status, _ := c.chat("only-d", "x"); status != 404 {
			t.Errorf("model only d served: %d, want 404", status)
		}
	})
	t.Run("agent stopped mid-run", func(t *testing.T) {
		// c drains, leaves and closes its host while requests keep coming.
		stopped := make(chan struct{})
		go func() { agents["c"].Stop(); close(stopped) }()
		for i := 0; ; i++ {
			status, agent := c.chat("m1", fmt.Sprintf("stop-%d", i%12))
			if status != 200 {
				t.Fatalf("request %d while c stopped: %d from %q", i, status, agent)
			}
			select {
			case <-stopped:
			default:
				if i < 10_000 {
					continue
				}
			}
			break
		}
		for i := 0; i < 20; i++ {
			if status, agent := c.chat("m1", fmt.Sprintf("stop-%d", i%12)); status != 200 || agent == "c" {
				t.Fatalf("request %d after c stopped: %d from %q", i, status, agent)
			}
		}
		waitFor(t, "only-c dropped from /v1/models", func() bool {
			return strings.Join(c.models(), ",") == "m1,only-a"
		})
	})
}

func TestIntegrationJoinSecurity(t *testing.T) {
	rl := startRelay(t, "", "")
	e := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "a"})
	a := relaytest.RunAgent(t, relaytest.AgentConfig("a", itToken, e.URL(), rl.Addr()))
	c := newClient(t, rl.URL)
	waitFor(t, "agent a routable", func() bool { return len(c.models()) == 1 })

	t.Run("wrong token cannot join", func(t *testing.T) {
		h := newHost(t)
		if err := h.Connect(context.Background(), rl.Info()); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		m, err := transport.Join(ctx, h, rl.Relay.Host().ID(), []byte("not-the-token"), transport.JoinInfo{Name: "evil", Models: []string{"evil"}})
		if err == nil {
			m.Close()
			t.Fatal("joined with a wrong token")
		}
		if _, ok := rl.Relay.Registry().Peer("evil"); ok {
			t.Error("registry holds the intruder")
		}
	})
	t.Run("taken name", func(t *testing.T) {
		h := newHost(t)
		if err := h.Connect(context.Background(), rl.Info()); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		m, err := transport.Join(ctx, h, rl.Relay.Host().ID(), []byte(itToken), transport.JoinInfo{Name: "a", Models: []string{"stolen"}})
		if err == nil {
			m.Close()
			t.Fatal("a second peer took the name a")
		}
		if !errors.Is(err, transport.ErrRejected) {
			t.Errorf("err = %v, want a rejection", err)
		}
		if p, _ := rl.Relay.Registry().Peer("a"); p != a.ID() {
			t.Errorf("name a bound to %s", p)
		}
		if got := strings.Join(c.models(), ","); got != "m1" {
			t.Errorf("models %s", got)
		}
	})
	t.Run("agent refuses streams from a peer that is not its relay", func(t *testing.T) {
		// The agent's address, as the relay sees its connection.
		conns := rl.Relay.Host().Network().ConnsToPeer(a.ID())
		if len(conns) == 0 {
			t.Fatal("relay has no connection to the agent")
		}
		h := newHost(t)
		if err := h.Connect(context.Background(), peer.AddrInfo{ID: a.ID(), Addrs: []multiaddr.Multiaddr{conns[0].RemoteMultiaddr()}}); err != nil {
			t.Fatal(err)
		}
		hc := &http.Client{Transport: transport.NewRoundTripper(h), Timeout: 20 * time.Second}
		resp, err := hc.Post("http://"+a.ID().String()+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m1"}`))
		if err == nil {
			resp.Body.Close()
			t.Fatalf("a stranger got %d from the agent", resp.StatusCode)
		}
		if n := e.Hits.Load(); n != 0 {
			t.Errorf("engine saw %d requests", n)
		}
	})
}

func TestIntegrationRelayRestart(t *testing.T) {
	identity := filepath.Join(t.TempDir(), "relay.key")
	rl := startRelay(t, identity, "")
	id := rl.Relay.Host().ID()
	port, err := rl.Relay.Host().Addrs()[0].ValueForProtocol(multiaddr.P_UDP)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"a", "b"} {
		relaytest.RunAgent(t, relaytest.AgentConfig(n, itToken, relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: n}).URL(), rl.Addr()))
	}
	c := newClient(t, rl.URL)
	waitFor(t, "agents joined", func() bool { return len(c.models()) == 1 && len(rl.Relay.Registry().Agents()) == 2 })
	if status, _ := c.chat("m1", "before"); status != 200 {
		t.Fatalf("before restart: %d", status)
	}

	rl.Stop()
	rl2 := startRelay(t, identity, "/ip4/127.0.0.1/udp/"+port+"/quic-v1")
	if rl2.Relay.Host().ID() != id {
		t.Fatalf("restarted relay has peer ID %s, was %s", rl2.Relay.Host().ID(), id)
	}
	waitFor(t, "agents joined the restarted relay", func() bool { return len(rl2.Relay.Registry().Agents()) == 2 })
	for _, ag := range rl2.Relay.Registry().Agents() {
		if len(ag.Models) == 0 {
			t.Errorf("agent %s rejoined without models", ag.Name)
		}
	}
	c2 := newClient(t, rl2.URL)
	for i := 0; i < 5; i++ {
		if status, agent := c2.chat("m1", "after"); status != 200 || agent == "" {
			t.Fatalf("after restart: %d from %q", status, agent)
		}
	}
}

func TestIntegrationErrors(t *testing.T) {
	t.Parallel() // waits on agents over QUIC, in its own relay
	rl := startRelay(t, "", "")
	good := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "good"})
	bad := relaytest.NewFakeEngine(t, relaytest.EngineConfig{Name: "bad", Models: []string{"m1", "m-bad"}})
	bad.SetAnswer(func(w http.ResponseWriter, r *http.Request) {
		bad.Hits.Add(1)
		http.Error(w, `{"error":{"message":"engine exploded"}}`, 500)
	})
	relaytest.RunAgent(t, relaytest.AgentConfig("good", itToken, good.URL(), rl.Addr()))
	badCfg := relaytest.AgentConfig("bad", itToken, bad.URL(), rl.Addr())
	badCfg.RefreshInterval = 200 * time.Millisecond // it drains soon after its engine goes
	relaytest.RunAgent(t, badCfg)
	c := newClient(t, rl.URL)
	// Both agents: m1 and m-bad are listed as soon as bad alone has joined,
	// and m1 then has nowhere to go but bad.
	waitAgents(t, rl, "good", "bad")

	status := func(body string, hdr ...string) int {
		resp, err := c.post("/v1/chat/completions", body, hdr...)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var e struct {
			Error struct{ Message, Type, Code string }
		}
		if resp.StatusCode != 200 {
			if err := json.NewDecoder(resp.Body).Decode(&e); err != nil || e.Error.Message == "" || e.Error.Type == "" || e.Error.Code == "" {
				t.Errorf("status %d without OpenAI error JSON (%v)", resp.StatusCode, err)
			}
		}
		return resp.StatusCode
	}
	for _, tc := range []struct {
		name, body string
		hdr        []string
		want       int
	}{
		{"malformed", `{"model":`, nil, 400},
		{"missing model", `{}`, nil, 400},
		{"bad key", `{"model":"m1"}`, []string{"Authorization", "Bearer nope"}, 401},
		{"unknown model", `{"model":"zzz"}`, nil, 404},
		{"every attempt failed", `{"model":"m-bad"}`, nil, 502},
	} {
		if got := status(tc.body, tc.hdr...); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
	// m1 survives the bad agent: retries hide its 500s.
	for i := 0; i < 10; i++ {
		if got := status(`{"model":"m1"}`, "X-Session-ID", fmt.Sprintf("s%d", i)); got != 200 {
			t.Fatalf("m1 request %d: %d", i, got)
		}
	}
	// An agent whose engine is gone drains (an update over its join
	// stream, it stays joined) and takes nothing new.
	bad.Down()
	waitFor(t, "m-bad gone from /v1/models", func() bool { return strings.Join(c.models(), ",") == "m1" })
	if got := status(`{"model":"m-bad"}`); got != 503 {
		t.Errorf("model of a draining agent: %d, want 503", got)
	}
}
