package relay

import "time"

// Test hooks for package relay_test.

// WithoutLiveness turns the request path's liveness checks (acks and
// probes) off in c, so that a test sees gossip's own failure detection.
func WithoutLiveness(c *Config) { c.noLiveness = true }

// WithPeerSyncWait sets how long, after it learned a peer relay, a relay
// that has just started holds a request for that peer's table.
func WithPeerSyncWait(c *Config, d time.Duration) { c.peerSyncWait = d }

// DelayPeerSnapshots makes r wait d before it sends its binding table to
// a peer relay, so that a test sees what a slow table costs.
func DelayPeerSnapshots(r *Relay, d time.Duration) { r.peers.SetSnapshotDelay(d) }

// ShareBinding records a success of session on agent ep for the peer
// relays, as a served request does.
func ShareBinding(r *Relay, session, ep string) { r.shareBinding(session, ep) }
