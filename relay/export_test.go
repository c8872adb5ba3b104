package relay

// Test hooks for package relay_test.

// WithoutLiveness turns the request path's liveness checks (acks and
// probes) off in c, so that a test sees gossip's own failure detection.
func WithoutLiveness(c *Config) { c.noLiveness = true }

// The liveness timings (liveness.go), for tests that bound what they see
// by them.
const (
	IdleProbeInterval = idleProbeInterval
	IdleSilentAfter   = idleSilentAfter
	ProbeInterval     = probeInterval
	SilentAfter       = silentAfter
	DeadAfter         = deadAfter
	MinAckTimeout     = minAckTimeout
)
