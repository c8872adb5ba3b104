package relay

import (
	"crypto/sha256"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/computeflux/computeflux/scheduler"
)

// Per-API-key limits. A key may send at most KeyRPM inference requests in
// any sliding window of one minute and have at most KeyConcurrency of them
// in flight. The window is exact: the limiter keeps the start times of the
// last KeyRPM requests of a key in a ring, so a refused request learns
// exactly when the oldest one leaves the window (its Retry-After).
//
// State is kept per key that passed authentication, so its size is bounded
// by the configured keys. With NoAuth there is no key to tell clients apart:
// every client shares one budget.

// rateWindow is the window KeyRPM counts over.
const rateWindow = time.Minute

// MaxKeyRPM bounds Config.KeyRPM: the limiter keeps one timestamp (8 bytes)
// per request in the window, per key.
const MaxKeyRPM = 1_000_000

// keyLimits enforces KeyRPM and KeyConcurrency. Its methods are safe for
// concurrent use; a nil *keyLimits (no limits) admits everything.
type keyLimits struct {
	rpm, conc int
	clock     scheduler.Clock
	epoch     time.Time // timestamps are offsets from it (monotonic)

	mu   sync.Mutex // guards keys and every keyState
	keys map[[sha256.Size]byte]*keyState
}

// keyState is one key's window and in-flight count.
type keyState struct {
	ring     []time.Duration // start offsets of the last len(ring) requests, oldest at head
	head     int             // index of the oldest entry once the ring is full
	inFlight int
}

// newKeyLimits returns nil when both limits are off.
func newKeyLimits(rpm, conc int, clock scheduler.Clock) *keyLimits {
	if rpm <= 0 && conc <= 0 {
		return nil
	}
	return &keyLimits{rpm: rpm, conc: conc, clock: clock, epoch: clock.Now(),
		keys: make(map[[sha256.Size]byte]*keyState)}
}

// keyID names the budget a request draws on: the digest of its bearer key
// (or, without an Authorization header, of its x-api-key, as Anthropic's
// SDKs send it), or the zero digest for every client when auth is off.
func keyID(r *http.Request, noAuth bool) [sha256.Size]byte {
	if noAuth {
		return [sha256.Size]byte{}
	}
	h := r.Header.Get("Authorization")
	if h == "" {
		// Anthropic's SDKs send the key as x-api-key.
		h = r.Header.Get("X-Api-Key")
	}
	const prefix = "bearer "
	if len(h) > len(prefix) && strings.EqualFold(h[:len(prefix)], prefix) {
		h = strings.TrimSpace(h[len(prefix):])
	}
	return sha256.Sum256([]byte(h))
}

// acquire admits one request of key id, or returns the 429 to send. On
// success the caller must call release once the request ends.
func (l *keyLimits) acquire(id [sha256.Size]byte) error {
	if l == nil {
		return nil
	}
	now := l.clock.Now().Sub(l.epoch)
	l.mu.Lock()
	defer l.mu.Unlock()
	st := l.keys[id]
	if st == nil {
		st = &keyState{}
		l.keys[id] = st
	}
	if l.conc > 0 && st.inFlight >= l.conc {
		return errKeyConcurrency(l.conc)
	}
	if l.rpm > 0 {
		if len(st.ring) == l.rpm {
			oldest := st.ring[st.head]
			if wait := oldest + rateWindow - now; wait > 0 {
				return errKeyRate(l.rpm, wait)
			}
			st.ring[st.head] = now
			st.head = (st.head + 1) % l.rpm
		} else {
			// The ring grows to KeyRPM entries only for keys that use it.
			st.ring = append(st.ring, now)
		}
	}
	st.inFlight++
	return nil
}

// release ends a request that acquire admitted.
func (l *keyLimits) release(id [sha256.Size]byte) {
	if l == nil {
		return
	}
	l.mu.Lock()
	if st := l.keys[id]; st != nil && st.inFlight > 0 {
		st.inFlight--
	}
	l.mu.Unlock()
}

func errKeyRate(rpm int, wait time.Duration) *Error {
	return &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "rate_limit_exceeded",
		Message: "Rate limit of " + strconv.Itoa(rpm) + " requests per minute reached for this API key; retry in " +
			strconv.FormatInt(int64((wait+time.Second-1)/time.Second), 10) + " s",
		RetryAfter: wait}
}

func errKeyConcurrency(n int) *Error {
	// No window to compute from: a slot frees when any request of the key
	// ends, so a short wait is the honest hint.
	return &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "concurrency_limit_exceeded",
		Message: "This API key already has " + strconv.Itoa(n) + " requests in flight, its limit", RetryAfter: time.Second}
}
