// Package bench compares routing policies on one workload, side by side:
// live, through a real relay, agents and simulated engines over QUIC on
// loopback (package relaytest), or as a discrete-event simulation in
// virtual time that drives the real scheduler and the simulated engine
// model, fast enough for a thousand engines.
//
// A run builds one Workload (synthetic multi-turn chat, or a Mooncake trace
// replay), computes its oracle hit ratio (Oracle), then runs each policy on
// a fresh cluster with the same seed and reports cache hit ratio, time to
// first token, end-to-end latency, throughput, load imbalance and errors
// (Report).
package bench
