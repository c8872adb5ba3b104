package scheduler

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// Clock tells the scheduler the time. All time-based behaviour (session
// expiry, breaker cooldowns, decay of success rates) reads it, so a test can
// drive the scheduler with a fake clock. Implementations must be safe for
// concurrent use.
type Clock interface{ Now() time.Time }

type realClock struct{}

// Now returns time.Now().
func (realClock) Now() time.Time { return time.Now() }

// Policy selects how a Scheduler chooses among allowed endpoints.
// The zero value is PolicySticky.
type Policy int

const (
	// PolicySticky is the product policy: session affinity first, then the
	// best score (weight, success rate, load, latency).
	PolicySticky Policy = iota
	// PolicyRoundRobin cycles through a model's endpoints in ID order.
	PolicyRoundRobin
	// PolicyRandom chooses uniformly at random.
	PolicyRandom
	// PolicyLeastLoaded chooses the endpoint with the fewest requests in
	// flight, breaking ties randomly.
	PolicyLeastLoaded
	// PolicyConsistentHash hashes the session key onto a ring of virtual
	// nodes; requests without a session key are placed at random.
	PolicyConsistentHash
	// PolicyPrefixHash hashes the request's prefix (its first
	// prefixKeyBlocks blocks) onto the ring; requests without a prefix are
	// placed at random. For comparison.
	PolicyPrefixHash
	// PolicyDualMap hashes the prefix to two candidates and takes the one
	// with fewer requests in flight (DualMap). For comparison.
	PolicyDualMap
	// PolicySGLang is SGLang's cache-aware router: an approximate tree per
	// endpoint of the prefixes routed to it; the longest match wins when it
	// covers more than 30% of the prompt, otherwise the endpoint with the
	// smallest tree; shortest queue while the load is unbalanced (more than
	// 64 requests and 1.5 times between the busiest and the idlest). For
	// comparison.
	PolicySGLang
)

var policyNames = [...]string{
	PolicySticky:         "sticky",
	PolicyRoundRobin:     "round-robin",
	PolicyRandom:         "random",
	PolicyLeastLoaded:    "least-loaded",
	PolicyConsistentHash: "consistent-hash",
	PolicyPrefixHash:     "prefix-hash",
	PolicyDualMap:        "dualmap",
	PolicySGLang:         "sglang",
}

// String returns the policy's name as accepted by ParsePolicy.
func (p Policy) String() string {
	if p < 0 || int(p) >= len(policyNames) {
		return fmt.Sprintf("Policy(%d)", int(p))
	}
	return policyNames[p]
}

// ParsePolicy parses a policy name: "sticky", "round-robin", "random",
// "least-loaded", "consistent-hash", "prefix-hash", "dualmap" or "sglang"
// (case-insensitive). The empty string
// means PolicySticky.
func ParsePolicy(s string) (Policy, error) {
	s = strings.ToLower(strings.TrimSpace(s))
	if s == "" {
		return PolicySticky, nil
	}
	for i, n := range policyNames {
		if s == n {
			return Policy(i), nil
		}
	}
	return 0, fmt.Errorf("scheduler: unknown policy %q (want one of %s)", s, strings.Join(policyNames[:], ", "))
}

// Config tunes a Scheduler. The zero value of every field means its default,
// given in the field's comment.
type Config struct {
	// SessionTTL is how long a session keeps its endpoint after its last
	// successful request. Default 5 minutes.
	SessionTTL time.Duration
	// MaxSessions bounds the session table; beyond it the least recently
	// used session is forgotten. Default 1,000,000.
	MaxSessions int
	// EWMAAlpha is the weight of a new latency sample in the moving
	// average: ema = (1-a)*ema + a*sample. Default 0.3.
	EWMAAlpha float64
	// ColdStartSamples is the number of requests an endpoint is sent before
	// its score uses measurements; until then it scores its weight alone.
	// Default 20.
	ColdStartSamples int
	// HalfOpenProbes is how many requests a half-open breaker admits at a
	// time, and how many successful probes in a row close it. Default 3.
	HalfOpenProbes int

	// FailureThreshold opens the breaker after this many consecutive
	// endpoint failures. Default 5.
	FailureThreshold int
	// FailureRate opens the breaker when the decayed share of endpoint
	// failures reaches it, once FailureRateMinSamples outcomes are in the
	// window. Default 0.5.
	FailureRate float64
	// FailureRateMinSamples is the decayed number of outcomes needed before
	// FailureRate can open the breaker. Default 10; at least 2, so the rule
	// never fires on a first request.
	FailureRateMinSamples float64
	// Cooldown is how long an opened breaker stays open before admitting
	// probes (also used for a 503). Default 30 seconds.
	Cooldown time.Duration
	// RateLimitCooldown is how long a 429 opens the breaker when the
	// upstream gave no Retry-After. Default 1 minute.
	RateLimitCooldown time.Duration
	// MaxRetryAfter caps an upstream's Retry-After so a misconfigured
	// upstream cannot bench an endpoint for days. Default 10 minutes.
	MaxRetryAfter time.Duration
	// SuccessHalfLife is the half-life of the success and failure counts
	// behind the success rate and the failure-rate rule. Default 1 minute.
	SuccessHalfLife time.Duration
	// LatencyScale is the latency that doubles an endpoint's latency
	// divisor: latencyFactor = 1 + ewma/LatencyScale. Default 1 second.
	LatencyScale time.Duration
	// SaturatedKVUsage is the engine KV-cache usage (0..1) at which an engine
	// that also has queued requests counts as saturated, so sessions mapped
	// to it are placed afresh. Default 0.98; above 1 disables the rule.
	SaturatedKVUsage float64
	// AffinityCapacity is the multiple of an endpoint's Capacity up to which
	// requests of sessions whose cache it holds may fill it; new and moved
	// sessions stop at Capacity. Default 2; 1 makes Capacity strict for
	// everyone.
	AffinityCapacity float64
	// VirtualNodes is the number of ring points per unit of weight for
	// PolicyConsistentHash. Default 100.
	VirtualNodes int

	// Policy selects the selection policy. Default PolicySticky.
	Policy Policy
	// Clock supplies the time. Nil means the real clock.
	Clock Clock
	// Seed seeds the randomness used to break ties. Zero means a random seed.
	Seed int64
}

// populate returns cfg with every zero field set to its default.
func (cfg Config) populate() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&cfg.SessionTTL, 5*time.Minute)
	def(&cfg.Cooldown, 30*time.Second)
	def(&cfg.RateLimitCooldown, time.Minute)
	def(&cfg.MaxRetryAfter, 10*time.Minute)
	def(&cfg.SuccessHalfLife, time.Minute)
	def(&cfg.LatencyScale, time.Second)
	if cfg.MaxSessions == 0 {
		cfg.MaxSessions = 1_000_000
	}
	if cfg.EWMAAlpha == 0 {
		cfg.EWMAAlpha = 0.3
	}
	if cfg.ColdStartSamples == 0 {
		cfg.ColdStartSamples = 20
	}
	if cfg.HalfOpenProbes == 0 {
		cfg.HalfOpenProbes = 3
	}
	if cfg.FailureThreshold == 0 {
		cfg.FailureThreshold = 5
	}
	if cfg.FailureRate == 0 {
		cfg.FailureRate = 0.5
	}
	if cfg.FailureRateMinSamples == 0 {
		cfg.FailureRateMinSamples = 10
	}
	if cfg.SaturatedKVUsage == 0 {
		cfg.SaturatedKVUsage = 0.98
	}
	if cfg.AffinityCapacity == 0 {
		cfg.AffinityCapacity = 2
	}
	if cfg.VirtualNodes == 0 {
		cfg.VirtualNodes = 100
	}
	if cfg.Clock == nil {
		cfg.Clock = realClock{}
	}
	return cfg
}

// validate checks a populated Config.
func (cfg Config) validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"SessionTTL", cfg.SessionTTL}, {"Cooldown", cfg.Cooldown},
		{"RateLimitCooldown", cfg.RateLimitCooldown}, {"MaxRetryAfter", cfg.MaxRetryAfter},
		{"SuccessHalfLife", cfg.SuccessHalfLife}, {"LatencyScale", cfg.LatencyScale},
	} {
		if d.v < 0 {
			bad("%s must be positive, got %v", d.name, d.v)
		}
	}
	if cfg.MaxSessions < 0 || cfg.MaxSessions > math.MaxInt32-1 {
		bad("MaxSessions must be in 1..%d, got %d", math.MaxInt32-1, cfg.MaxSessions)
	}
	if !(cfg.EWMAAlpha > 0 && cfg.EWMAAlpha <= 1) {
		bad("EWMAAlpha must be in (0, 1], got %v", cfg.EWMAAlpha)
	}
	if cfg.ColdStartSamples < 0 {
		bad("ColdStartSamples must not be negative, got %d", cfg.ColdStartSamples)
	}
	if cfg.HalfOpenProbes < 0 {
		bad("HalfOpenProbes must not be negative, got %d", cfg.HalfOpenProbes)
	}
	if cfg.FailureThreshold < 0 {
		bad("FailureThreshold must not be negative, got %d", cfg.FailureThreshold)
	}
	if !(cfg.FailureRate > 0 && cfg.FailureRate <= 1) {
		bad("FailureRate must be in (0, 1], got %v", cfg.FailureRate)
	}
	if !(cfg.FailureRateMinSamples >= 2) || math.IsInf(cfg.FailureRateMinSamples, 0) {
		bad("FailureRateMinSamples must be at least 2, got %v", cfg.FailureRateMinSamples)
	}
	if !(cfg.SaturatedKVUsage > 0) || math.IsInf(cfg.SaturatedKVUsage, 0) {
		bad("SaturatedKVUsage must be positive, got %v", cfg.SaturatedKVUsage)
	}
	if !(cfg.AffinityCapacity >= 1) || cfg.AffinityCapacity > 1000 {
		bad("AffinityCapacity must be in 1..1000, got %v", cfg.AffinityCapacity)
	}
	if cfg.VirtualNodes < 0 || cfg.VirtualNodes > 10_000 {
		bad("VirtualNodes must be in 1..10000, got %d", cfg.VirtualNodes)
	}
	if cfg.Policy < 0 || int(cfg.Policy) >= len(policyNames) {
		bad("unknown Policy %d", int(cfg.Policy))
	}
	if len(errs) > 0 {
		return fmt.Errorf("scheduler: invalid config: %w", errors.Join(errs...))
	}
	return nil
}
