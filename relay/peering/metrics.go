package peering

import "github.com/prometheus/client_golang/prometheus"

// collector exports the binding traffic at scrape time.
type collector struct{ pm *Manager }

var (
	descPeerRelays = prometheus.NewDesc("computeflux_peer_relays",
		"Peer relays this relay shares session bindings with.", nil, nil)
	descPeerBindings = prometheus.NewDesc("computeflux_peer_bindings_total",
		"Session binding updates exchanged with peer relays, by direction.", []string{"direction"}, nil)
	descPeerBytes = prometheus.NewDesc("computeflux_peer_bytes_total",
		"Bytes of the sessions protocol with peer relays, by direction.", []string{"direction"}, nil)
	descPeerSessions = prometheus.NewDesc("computeflux_peer_sessions",
		"Session bindings held in the shared binding table.", nil, nil)
	descPeerResyncs = prometheus.NewDesc("computeflux_peer_resyncs_total",
		"Peer relays that came back as a new process while our stream to them looked alive, and were sent every binding again.", nil, nil)
)

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPeerRelays, descPeerBindings, descPeerBytes, descPeerSessions, descPeerResyncs} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	st := c.pm.Stats()
	ch <- prometheus.MustNewConstMetric(descPeerRelays, prometheus.GaugeValue, float64(st.Peers))
	ch <- prometheus.MustNewConstMetric(descPeerBindings, prometheus.CounterValue, float64(st.BindingsSent), "sent")
	ch <- prometheus.MustNewConstMetric(descPeerBindings, prometheus.CounterValue, float64(st.BindingsReceived), "received")
	ch <- prometheus.MustNewConstMetric(descPeerBytes, prometheus.CounterValue, float64(st.BytesSent), "sent")
	ch <- prometheus.MustNewConstMetric(descPeerBytes, prometheus.CounterValue, float64(st.BytesReceived), "received")
	ch <- prometheus.MustNewConstMetric(descPeerSessions, prometheus.GaugeValue, float64(st.Sessions))
	ch <- prometheus.MustNewConstMetric(descPeerResyncs, prometheus.CounterValue, float64(st.Resyncs))
}

// Collector returns a prometheus.Collector of the binding traffic, read
// at scrape time.
func (pm *Manager) Collector() prometheus.Collector { return collector{pm} }
