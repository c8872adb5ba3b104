package scheduler

import (
	"context"
	"errors"
	"time"
)

// Class is what an outcome says about an endpoint. The zero value is
// ClassSuccess.
type Class uint8

const (
	// ClassSuccess is a 2xx answer.
	ClassSuccess Class = iota
	// ClassDeadKey is a 401 or 403: the endpoint refused our credentials.
	// It is excluded for the rest of the request; other requests may use it.
	ClassDeadKey
	// ClassRateLimited is a 429: the endpoint is excluded for the rest of
	// the request and its breaker opens for Retry-After (or
	// Config.RateLimitCooldown).
	ClassRateLimited
	// ClassEndpointFailure is a 5xx, a timeout or a connection error. It
	// counts against the endpoint's breaker and success rate and ends the
	// session's affinity to it.
	ClassEndpointFailure
	// ClassClientFault is any other 4xx (400, 404, 413, 422, ...) or a
	// request the client itself cancelled: it says nothing about the
	// endpoint and is not retried.
	ClassClientFault
)

var classNames = [...]string{"success", "dead-key", "rate-limited", "endpoint-failure", "client-fault"}

// String returns a short lower-case name for the class.
func (c Class) String() string {
	if int(c) < len(classNames) {
		return classNames[c]
	}
	return "unknown"
}

// Retryable reports whether a request that ended in this class may be sent
// to another endpoint: true for dead keys, rate limits and endpoint
// failures, false for success and client faults.
func (c Class) Retryable() bool {
	return c == ClassDeadKey || c == ClassRateLimited || c == ClassEndpointFailure
}

// Classify maps an upstream HTTP status and transport error to a Class.
//
// A non-nil err wins over the status: context.Canceled (the client went
// away) is a ClassClientFault; any other error, including
// context.DeadlineExceeded and an error that cut a 2xx stream short, is a
// ClassEndpointFailure. Without an error: 2xx success; 401 and 403 dead key;
// 429 rate limited; other 4xx client fault; 5xx and anything else (including
// status 0 or a stray 1xx/3xx, which an API endpoint should not send) an
// endpoint failure.
func Classify(status int, err error) Class {
	if err != nil {
		if errors.Is(err, context.Canceled) {
			return ClassClientFault
		}
		return ClassEndpointFailure
	}
	switch {
	case status >= 200 && status < 300:
		return ClassSuccess
	case status == 401 || status == 403:
		return ClassDeadKey
	case status == 429:
		return ClassRateLimited
	case status >= 400 && status < 500:
		return ClassClientFault
	default:
		return ClassEndpointFailure
	}
}

// Outcome is how one attempt on an endpoint ended.
type Outcome struct {
	// Status is the upstream HTTP status; 0 when no response arrived.
	Status int
	// Err is the transport error, if any.
	Err error
	// Latency is the time to the first byte of the answer (to the first
	// token for a stream); 0 means not measured and leaves the average alone.
	Latency time.Duration
	// RetryAfter is the upstream's Retry-After on a 429; 0 means none given.
	RetryAfter time.Duration
}
