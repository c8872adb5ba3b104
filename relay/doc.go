// Package relay serves the OpenAI HTTP API on a public host and routes each
// request to an agent.
//
// A Relay (relay.go) is built by New from a Config (config.go), serves HTTP
// with Run or Serve and stops with Close; relay.go also runs the circuit
// relay service on the relay's own libp2p host and the periodic sweep of
// what departed agents left behind. handler.go dispatches by path: the
// inference APIs and requests about stored responses take the request path
// below, and /v1/models, /healthz and /metrics are answered there. Every
// error a client sees is an Error in OpenAI's shape (errors.go).
//
// # The request path
//
// The stages, in order (proxy.go describes them in full):
//
//   - serveProxied and runStages (proxy.go): check the API key against the
//     client table (clients.go), run the stages below, then record the
//     request in the usage ledger (usage.go) and write its log line and
//     metrics (metrics.go).
//   - prepare: prepareInference (proxy.go) reads the body and its routing
//     fields (request.go, routingscan.go), turns a Messages request into the
//     chat request it means (messages.go, package anthropic), hashes the
//     prompt's blocks for the prefix index (prefix.go), limits the Responses API to agents whose
//     engines serve it (responses.go), and, while audits run, gives agents
//     the relay's seed and pseudonyms (forward.go). prepareStored
//     (responses.go) prepares a request about a stored response, which goes
//     to the agent that holds it.
//   - admit (proxy.go): the client's budget (usage.go), then the per-key
//     rate and concurrency limits (limits.go).
//   - proxy (proxy.go): up to Config.MaxAttempts attempts, each a pick, an
//     attempt and a finish.
//   - pick (proxy.go): the route names the endpoint (the scheduler, or
//     storedRoute in responses.go); an inference request that finds no room
//     waits in the fair queue (queue.go).
//   - attempt (attempt.go): send, first byte, commit, copy. The upstream
//     URL, round tripper and provider key come from providers.go (target);
//     an endpoint not known to serve the Messages API gets the chat request
//     instead (anthropic.Writer). Headers are filtered both ways by headers.go,
//     an agent's attempt runs under a liveness flight (package liveness) and
//     every attempt under one watchdog timer (watchdog.go). The first-byte
//     stage checks that a non-streamed answer is JSON (sse.go); copy passes
//     the body through one pooled buffer (copy.go), re-frames event streams
//     (sse.go) and turns a translated answer back into a Messages answer
//     (anthropic.Writer).
//   - finish (proxy.go): report the outcome to the route, give back the
//     queue's slot, share a new session binding with the peer relays
//     (peers.go, package peering), hand the answer to the auditor (audits.go), and count and
//     log an attempt that failed (metrics.go, providers.go).
//
// # Subsystems
//
//   - Agents: the Registry (registry.go) holds the joined agents, is the
//     join service's handler and feeds the scheduler. gossip.go runs the
//     membership gossip, reconciles it with the join registrations and
//     disconnects peers that connect without joining; forgery.go cuts off a
//     peer caught forging gossip. Package liveness checks agents on the
//     request path (acknowledgements and probes) and keeps the relay's own
//     stalls out of those checks. prefix.go takes the agents' prefix index
//     streams into the scheduler. agentusage.go answers an agent's query for
//     its own usage.
//   - Peer relays (peers.go): the relay's side of package peering, which
//     shares session bindings with the other relays of a fleet, and the
//     spending of clients with a budget with the peers the operator named;
//     peers.go builds it from what it needs of the relay and holds the
//     request path's hooks (installBinding, bindingPending, shareBinding).
//   - Audits (audits.go): the relay's side of package auditor, which runs
//     them: the fleet it sees and how its requests go out. While audits run,
//     forward.go gives every chat and completions request to an agent a seed
//     and pseudonyms, so that audits look like client requests.
//   - Provider endpoints (providers.go): OpenAI-compatible APIs that the
//     relay calls itself, with API keys, beside the agents; model discovery,
//     and ReloadEndpoints to replace them.
//   - Operator files: the API keys file (config.go, LoadAPIKeys), the
//     clients file (clients.go) and the endpoints file (endpointsfile.go).
//     operator.go merges an endpoint's weight, priority and state from the
//     endpoints file, the admin API and what the agent declared.
//   - Admin surface, on a listener of its own (admin.go): the routing table,
//     endpoint actions and the status page (status.html), with the queue
//     (queue_admin.go) and usage (usage_admin.go) routes and the audits'
//     manual quarantine and release (audits.go).
//   - Queue (queue.go): requests wait for room, fairly between clients, and
//     a relay that has just started holds requests while its agents rejoin.
//   - Ledger and budgets: usage.go records each request in package ledger,
//     with the counts package transport/usage reads from the answer, and
//     checks a client's budget; usage_admin.go reports usage.
//   - Metrics (metrics.go): the relay's Prometheus registry; gossip.go,
//     package peering and prefix.go add collectors of their own.
//   - TLS (package certs): certificate files, picked up when renewed, or
//     certificates the relay obtains and renews itself by ACME.
//
// Subpackages: auditor runs the audits, peering shares session bindings and
// spending with peer relays, ledger keeps the usage ledger, relaytest runs
// a whole cluster in one process for tests, benchmarks and demos, and
// internal/threadcpu measures benchmarks' CPU time.
package relay
