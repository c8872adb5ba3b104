package relay

import (
	"bufio"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// Benchmarks of the latency the relay adds. Each iteration sends one request
// straight to the engine and one through the relay (client -> relay HTTP ->
// relay's transport -> engine), so both see the same machine state; the
// reported figures are percentiles of the per-request times, in µs.
//
//	go test -run '^$' -bench . -benchtime 2000x ./relay/
//
// The libp2p (QUIC) path is measured by BenchmarkQUIC* in
// integration_test.go.

// benchClient is an HTTP client with enough idle connections for the
// parallel benchmarks.
func benchClient(b *testing.B) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 256, MaxIdleConns: 256}
	b.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func benchRequest(b *testing.B, c *http.Client, url, body string, stream bool) time.Duration {
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+testKey)
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
		// Time to the first event.
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

// reportPercentiles reports p50 and p99 of direct and relayed times and the
// difference at each percentile, in µs.
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
	b.ReportMetric(0, "ns/op") // per-op time mixes both paths; the percentiles say it
}

// newBenchTestbed is a testbed whose request log is encoded but discarded,
// so the benchmark pays for logging as production does.
func newBenchTestbed(b *testing.B, names []string) *testbed {
	return newTestbed(b, names, func(c *Config) { c.Logger = zerolog.New(io.Discard) })
}

func BenchmarkAddedLatency(b *testing.B) {
	for _, mode := range []struct {
		name   string
		body   string
		stream bool
	}{
		{"small", `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`, false},
		{"stream-ttfb", `{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}`, true},
	} {
		b.Run(mode.name, func(b *testing.B) {
			tb := newBenchTestbed(b, []string{"a"})
			c := benchClient(b)
			eng := tb.engines["a"].srv.URL + "/v1/chat/completions"
			rel := tb.srv.URL + "/v1/chat/completions"
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

// BenchmarkThroughput reports requests per second through one relay in front
// of three engines, with 32 concurrent clients, small non-streamed requests.
func BenchmarkThroughput(b *testing.B) {
	tb := newBenchTestbed(b, []string{"a", "b", "c"})
	c := benchClient(b)
	rel := tb.srv.URL + "/v1/chat/completions"
	b.SetParallelism(16) // 16 × GOMAXPROCS goroutines
	start := time.Now()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			benchRequest(b, c, rel, `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`, false)
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
}
