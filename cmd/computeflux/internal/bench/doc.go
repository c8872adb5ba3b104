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
// (Report). Every engine of a run answers with the same seed, so a
// session's prompts do not depend on where its turns ran: all policies see
// exactly the same requests (a test checks that live and simulated runs
// send the same prompt tokens).
//
// # Live mode
//
// Each session is a client goroutine that streams chat completions
// through the relay with X-Session-ID, re-sending the history and the
// previous answer each turn, as chat clients do. Engines run TimeScale
// times faster than real time and every latency is reported in model time
// (measured × TimeScale), so the relay, libp2p and HTTP overheads, and any
// stall of a busy machine, are magnified by the same factor: a loaded
// machine shows up in the latency columns, never in the hit ratio. Config.
// Parallel runs the policies at the same time so they meet the same load.
//
// # Simulation mode
//
// A calendar of events (session turns, engine events, scenario actions) in
// virtual time; the scheduler reads a virtual clock. A request is Begin,
// Pick, Submit to the engine model; its first token and its end come from
// the engine (Next and Advance); Report gets the time to first token as the
// relay reports it (time to the first response byte) when the stream ends,
// as the relay does. The relay's retries are modelled (a killed agent's
// requests that have not started streaming are picked again, up to
// MaxAttempts); network time is not. The scheduler's own cost is measured
// in wall time around Pick and Report and reported per request. As in the
// product, each agent takes at most its dispatch limit (its engine's batch
// by default) and a request that finds every agent full waits in its
// relay's fair queue until a slot frees (simqueue.go); every policy runs
// with the same limits and queue.
//
// # Scenarios
//
// Actions are timed on the workload's arrival span S (the last session
// start): degraded slows engine 0 by 5 at S/2; failure kills engine 0's
// agent at S/3 (the relay sees its connection close, streams in flight
// break) and restarts it at 2S/3 with the engine's cache intact; join adds
// the last engine at S/2; skew makes 5% of the chat sessions heavy (20
// times the turns, a fifth of the think time), which then send about half
// of the requests. Load imbalance counts every engine, so in join the late
// engine's short presence raises it for every policy.
package bench
