package relay

import (
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// series returns the values of vec's series by their joined label values.
func series(t *testing.T, vec prometheus.Collector) map[string]float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(vec)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var k []string
			for _, l := range m.GetLabel() {
				k = append(k, l.GetValue())
			}
			out[strings.Join(k, ",")] = m.GetCounter().GetValue()
		}
	}
	return out
}

// testMetrics returns the request metrics alone, as newMetrics builds them.
func testMetrics() *metrics {
	return &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "r"}, []string{"agent", "status"}),
		affinity: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "a"}, []string{"result"}),
		ttfb:     prometheus.NewHistogram(prometheus.HistogramOpts{Name: "t"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "d"}),
	}
}

// The resolved counters count into the vectors' own series, one per label
// set, and a label set appears only once used.
func TestMetricsResolvedCounters(t *testing.T) {
	m := testMetrics()
	obs := []reqLog{
		{agent: "a", status: 200, affinity: "hit", ttfb: time.Millisecond},
		{agent: "a", status: 200, affinity: "miss"},
		{agent: "b", status: 200, affinity: "hit"},
		{agent: "a", status: 502},
		{agent: "", status: 404},
		{agent: "a", status: 0}, // not answered: not counted
	}
	for i := range obs {
		m.observe(&obs[i], time.Millisecond)
	}
	want := map[string]float64{"a,200": 2, "b,200": 1, "a,502": 1, ",404": 1}
	if got := series(t, m.requests); !maps.Equal(got, want) {
		t.Errorf("requests = %v, want %v", got, want)
	}
	// No "none" series before one is seen.
	if got, want := series(t, m.affinity), map[string]float64{"hit": 2, "miss": 1}; !maps.Equal(got, want) {
		t.Errorf("affinity = %v, want %v", got, want)
	}
}

func BenchmarkMetricsObserve(b *testing.B) {
	m := testMetrics()
	rl := reqLog{agent: "agent-1", status: 200, affinity: "hit", ttfb: time.Millisecond}
	b.ReportAllocs()
	for b.Loop() {
		m.observe(&rl, time.Millisecond)
	}
}
