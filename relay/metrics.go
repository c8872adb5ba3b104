package relay

import (
	stdlog "log"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// metrics are the relay's Prometheus metrics, on a registry of its own.
type metrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec // by agent and status
	affinity *prometheus.CounterVec // by result
	ttfb     prometheus.Histogram
	duration prometheus.Histogram
	retries  prometheus.Counter
	failures *prometheus.CounterVec // failed attempts before the first byte, by agent
	routable prometheus.GaugeFunc
	forged   prometheus.Counter // peers cut off for forged gossip
	index    *indexMetrics      // prefix index traffic (prefix.go)
	relay    *Relay

	panics *prometheus.CounterVec // recovered handler panics, by server

	// Children of requests, affinity and failures, resolved once per label
	// set.
	requestsBy resolvedCounters[requestLabels]
	affinityBy resolvedCounters[string]
	failuresBy resolvedCounters[string]
}

// requestLabels are the labels of computeflux_requests_total.
type requestLabels struct {
	agent  string
	status int
}

// latencyBuckets span a cached turn on loopback to a long cold prefill.
var latencyBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}

func newMetrics(r *Relay) *metrics {
	m := &metrics{
		reg:   prometheus.NewRegistry(),
		relay: r,
		index: newIndexMetrics(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_requests_total",
			Help: "Inference requests answered, by serving agent (empty if none) and HTTP status (499: client left).",
		}, []string{"agent", "status"}),
		affinity: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_affinity_total",
			Help: "Session affinity of routed requests: hit, miss or none.",
		}, []string{"result"}),
		ttfb: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "computeflux_ttfb_seconds",
			Help:    "Time from receiving a request to the first response byte from the serving agent.",
			Buckets: latencyBuckets,
		}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "computeflux_request_duration_seconds",
			Help:    "Time from receiving an inference request to the end of its response.",
			Buckets: latencyBuckets,
		}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_retries_total",
			Help: "Attempts beyond the first for inference requests.",
		}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_attempt_failures_total",
			Help: "Attempts that failed before their first byte (and were retried or given up), by agent.",
		}, []string{"agent"}),
		// Read at scrape time from the state the scheduler routes on.
		routable: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "computeflux_agents_routable",
			Help: "Joined agents the scheduler routes to (serving a model; not dead, disabled, draining or suspect).",
		}, func() float64 { return float64(r.reg.routable()) }),
		forged: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "computeflux_gossip_forgeries_total",
			Help: "Joined peers cut off because they sent gossip no honest member sends.",
		}),
		panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "computeflux_panics_total",
			Help: "Request handler panics the relay's HTTP servers recovered (each logged with its stack), by server: http (the API) or admin-http.",
		}, []string{"component"}),
	}
	for _, c := range panicComponents {
		m.panics.WithLabelValues(c) // the series exist from the start, at 0
	}
	m.reg.MustRegister(m.requests, m.affinity, m.ttfb, m.duration, m.retries, m.failures, m.routable, m.forged, m.panics,
		schedulerCollector{r: r},
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.reg.MustRegister(m.index.collectors(r.sched)...)
	return m
}

// panicComponents are the values of computeflux_panics_total's label.
var panicComponents = []string{"http", "admin-http"}

// serverLog is the ErrorLog of the relay's HTTP server named component
// (one of panicComponents): into the relay's log, panics counted.
func (r *Relay) serverLog(component string) *stdlog.Logger {
	return transport.ServerLog(r.log.With().Str("source", component).Logger(), r.metrics.panics.WithLabelValues(component).Inc)
}

// observe records one finished inference request.
func (m *metrics) observe(rl *reqLog, dur time.Duration) {
	if rl.status == 0 {
		return
	}
	m.requestCounter(rl.agent, rl.status).Inc()
	if rl.affinity != "" {
		m.affinityCounter(rl.affinity).Inc()
	}
	if rl.ttfb > 0 {
		m.ttfb.Observe(rl.ttfb.Seconds())
	}
	m.duration.Observe(dur.Seconds())
}

// resolvedCounters holds a counter vector's children by a key of their
// labels: WithLabelValues validates and hashes its labels, takes the
// vector's lock and (for a status) needs strconv, so each label set is
// resolved once. Series still appear on first use only. The zero value is
// empty.
type resolvedCounters[K comparable] struct {
	mu sync.RWMutex // guards m
	m  map[K]prometheus.Counter
}

// get returns the child of k, resolved by resolve the first time.
func (r *resolvedCounters[K]) get(k K, resolve func(K) prometheus.Counter) prometheus.Counter {
	r.mu.RLock()
	c, ok := r.m[k]
	r.mu.RUnlock()
	if ok {
		return c
	}
	c = resolve(k)
	r.mu.Lock()
	if r.m == nil {
		r.m = make(map[K]prometheus.Counter)
	}
	r.m[k] = c
	r.mu.Unlock()
	return c
}

// forget removes the children whose key matches and returns their keys.
func (r *resolvedCounters[K]) forget(match func(K) bool) []K {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []K
	for k := range r.m {
		if match(k) {
			delete(r.m, k)
			out = append(out, k)
		}
	}
	return out
}

// keys returns the keys of the children resolved so far.
func (r *resolvedCounters[K]) keys() []K {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return slices.Collect(maps.Keys(r.m))
}

// requestCounter returns the requests counter of agent and status.
func (m *metrics) requestCounter(agent string, status int) prometheus.Counter {
	return m.requestsBy.get(requestLabels{agent, status}, func(k requestLabels) prometheus.Counter {
		return m.requests.WithLabelValues(k.agent, strconv.Itoa(k.status))
	})
}

// failureCounter returns the failed-attempts counter of agent.
func (m *metrics) failureCounter(agent string) prometheus.Counter {
	return m.failuresBy.get(agent, func(a string) prometheus.Counter {
		return m.failures.WithLabelValues(a)
	})
}

// forgetAgent removes agent's series (its registration ended): agents that
// come and go under new names leave no series behind.
func (m *metrics) forgetAgent(agent string) {
	for _, k := range m.requestsBy.forget(func(k requestLabels) bool { return k.agent == agent }) {
		m.requests.DeleteLabelValues(k.agent, strconv.Itoa(k.status))
	}
	if len(m.failuresBy.forget(func(a string) bool { return a == agent })) > 0 {
		m.failures.DeleteLabelValues(agent)
	}
	m.index.forgetAgent(agent)
}

// agentNames returns the agents that have series of their own.
func (m *metrics) agentNames() map[string]bool {
	out := make(map[string]bool)
	for _, k := range m.requestsBy.keys() {
		out[k.agent] = true
	}
	for _, a := range m.failuresBy.keys() {
		out[a] = true
	}
	return out
}

// affinityCounter returns the affinity counter of result.
func (m *metrics) affinityCounter(result string) prometheus.Counter {
	return m.affinityBy.get(result, func(r string) prometheus.Counter {
		return m.affinity.WithLabelValues(r)
	})
}

// schedulerCollector exports the scheduler's per-agent state at scrape time.
type schedulerCollector struct{ r *Relay }

var (
	descInFlight = prometheus.NewDesc("computeflux_agent_in_flight",
		"Requests in flight on an agent, as the scheduler counts them.", []string{"agent"}, nil)
	descEWMA = prometheus.NewDesc("computeflux_agent_ewma_latency_seconds",
		"Moving average of an agent's time to first byte (0 before the first sample).", []string{"agent"}, nil)
	descBreaker = prometheus.NewDesc("computeflux_agent_breaker_state",
		"Circuit breaker state of an agent: 1 for the current state, 0 for the others.", []string{"agent", "state"}, nil)
	descScore = prometheus.NewDesc("computeflux_agent_score",
		"The sticky policy's score of an agent right now.", []string{"agent"}, nil)
	descSuccessRate = prometheus.NewDesc("computeflux_agent_success_rate",
		"Decayed success rate of an agent.", []string{"agent"}, nil)
)

var breakerStates = []scheduler.BreakerState{scheduler.BreakerClosed, scheduler.BreakerOpen, scheduler.BreakerHalfOpen}

// Describe implements prometheus.Collector.
func (c schedulerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descInFlight
	ch <- descEWMA
	ch <- descBreaker
	ch <- descScore
	ch <- descSuccessRate
}

// Collect implements prometheus.Collector.
func (c schedulerCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.r.sched.Snapshot() {
		ch <- prometheus.MustNewConstMetric(descInFlight, prometheus.GaugeValue, float64(s.InFlight), s.ID)
		ch <- prometheus.MustNewConstMetric(descEWMA, prometheus.GaugeValue, s.EWMALatency.Seconds(), s.ID)
		ch <- prometheus.MustNewConstMetric(descScore, prometheus.GaugeValue, s.Score, s.ID)
		ch <- prometheus.MustNewConstMetric(descSuccessRate, prometheus.GaugeValue, s.SuccessRate, s.ID)
		for _, st := range breakerStates {
			v := 0.0
			if s.Breaker == st {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(descBreaker, prometheus.GaugeValue, v, s.ID, st.String())
		}
	}
}
