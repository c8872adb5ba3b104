package relay_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/computeflux/computeflux/relay"
	"github.com/computeflux/computeflux/relay/relaytest"
)

// Benchmarks of the latency the relay adds. Each iteration sends one request
// straight to the engine and one through the relay, so both paths see the
// same machine state; the reported figures are percentiles of per-request
// times in µs, and the difference between the paths at each percentile.
//
//	go test -run '^$' -bench . -benchtime 2000x ./relay/
//
// Two relay paths:
//   - quic: client -> relay HTTP -> libp2p QUIC stream -> agent (package
//     agent) -> engine, the product's path (on loopback);
//   - http: client -> relay HTTP -> plain HTTP to the engine (Config.Transport),
//     the relay's own cost without libp2p and the agent.

const benchBody = `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`
const benchStreamBody = `{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}`

// rewriteTransport sends every request to one engine.
type rewriteTransport struct {
	base *http.Transport
	to   *url.URL
}

func (rt rewriteTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	out := req.Clone(req.Context())
	out.URL.Scheme, out.URL.Host = rt.to.Scheme, rt.to.Host
	return rt.base.RoundTrip(out)
}

// benchPaths returns the engine's URL and the relay's URL for one path kind,
// with agents named a, b, c... in front of their own engines (the first is
// the direct target).
func benchPaths(b *testing.B, kind string, agents int) (engineURL, relayURL string) {
	b.Helper()
	engines := make([]*relaytest.FakeEngine, agents)
	for i := range engines {
		engines[i] = relaytest.NewFakeEngine(b, relaytest.EngineConfig{Name: string(rune('a' + i))})
	}
	switch kind {
	case "quic":
		rl := startRelayLogger(b, zerolog.New(io.Discard))
		names := make([]string, len(engines))
		for i, e := range engines {
			names[i] = string(rune('a' + i))
			relaytest.RunAgent(b, relaytest.AgentConfig(names[i], itToken, e.URL(), rl.Addr()))
		}
		waitAgents(b, rl, names...)
		return engines[0].URL(), rl.URL
	case "http":
		tr := &http.Transport{MaxIdleConnsPerHost: 256}
		b.Cleanup(tr.CloseIdleConnections)
		u, _ := url.Parse(engines[0].URL())
		r, err := relay.New(relay.Config{NoP2P: true, Transport: rewriteTransport{tr, u}, APIKeys: []string{itKey}, Logger: zerolog.New(io.Discard)})
		if err != nil {
			b.Fatal(err)
		}
		for i := range engines {
			// All names lead to the first engine through rewriteTransport.
			_ = r.Registry().Joined(peerIDFor(i), joinInfo(string(rune('a'+i))))
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		srv := &http.Server{Handler: r.Handler()}
		go srv.Serve(ln)
		b.Cleanup(func() { srv.Close(); r.Close() })
		return engines[0].URL(), "http://" + ln.Addr().String()
	}
	b.Fatalf("unknown path kind %q", kind)
	return "", ""
}

// benchClient is an HTTP client with enough idle connections for the
// parallel benchmarks.
func benchClient(b *testing.B) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 256, MaxIdleConns: 256}
	b.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// benchRequest returns the time to the whole response, or to the first
// event of a stream.
func benchRequest(b *testing.B, c *http.Client, url, body string, stream bool) time.Duration {
	req, _ := http.NewRequest("POST", url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+itKey)
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b.Fatalf("status %d", resp.StatusCode)
	}
	if stream {
		br := bufio.NewReader(resp.Body)
		if _, err := br.ReadString('\n'); err != nil {
			b.Fatal(err)
		}
		d := time.Since(start)
		_, _ = io.Copy(io.Discard, br)
		return d
	}
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// reportPercentiles reports p50 and p99 of both paths and their differences.
func reportPercentiles(b *testing.B, direct, relayed []time.Duration) {
	pct := func(d []time.Duration, p float64) float64 {
		slices.Sort(d)
		return float64(d[int(p*float64(len(d)-1))].Nanoseconds()) / 1e3
	}
	dp50, dp99 := pct(direct, .50), pct(direct, .99)
	rp50, rp99 := pct(relayed, .50), pct(relayed, .99)
	b.ReportMetric(dp50, "direct-p50-µs")
	b.ReportMetric(dp99, "direct-p99-µs")
	b.ReportMetric(rp50, "relay-p50-µs")
	b.ReportMetric(rp99, "relay-p99-µs")
	b.ReportMetric(rp50-dp50, "added-p50-µs")
	b.ReportMetric(rp99-dp99, "added-p99-µs")
	b.ReportMetric(0, "ns/op") // one op is a request on each path; the percentiles say more
}

func BenchmarkAddedLatency(b *testing.B) {
	for _, kind := range []string{"quic", "http"} {
		for _, mode := range []struct {
			name   string
			body   string
			stream bool
		}{{"small", benchBody, false}, {"stream-ttfb", benchStreamBody, true}} {
			b.Run(kind+"/"+mode.name, func(b *testing.B) {
				eng, rel := benchPaths(b, kind, 1)
				c := benchClient(b)
				for i := 0; i < 50; i++ { // warm connections on both paths
					benchRequest(b, c, eng, mode.body, mode.stream)
					benchRequest(b, c, rel, mode.body, mode.stream)
				}
				direct := make([]time.Duration, 0, b.N)
				relayed := make([]time.Duration, 0, b.N)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					direct = append(direct, benchRequest(b, c, eng, mode.body, mode.stream))
					relayed = append(relayed, benchRequest(b, c, rel, mode.body, mode.stream))
				}
				b.StopTimer()
				reportPercentiles(b, direct, relayed)
			})
		}
	}
}

// BenchmarkThroughput reports requests per second through one relay in
// front of three agents, from 16×GOMAXPROCS concurrent clients sending small
// non-streamed requests.
func BenchmarkThroughput(b *testing.B) {
	for _, kind := range []string{"quic", "http"} {
		b.Run(kind, func(b *testing.B) {
			_, rel := benchPaths(b, kind, 3)
			c := benchClient(b)
			b.SetParallelism(16)
			start := time.Now()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					benchRequest(b, c, rel, benchBody, false)
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
		})
	}
}
