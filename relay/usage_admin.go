package relay

import (
	"net/http"
	"time"

	"github.com/computeflux/computeflux/relay/ledger"
)

// The admin API's usage route:
//
//	GET /admin/v1/usage?since=7d&by=client   usage since a time, grouped by client, agent, model or provider
//
// since is a duration back from now (7d, 36h, 90m) or an RFC 3339 time,
// 7d when absent; by is client (the default), agent, model or provider.
// The answer is a ledger.Report: rows per group with requests, prompt,
// cached and completion tokens, errors, estimated counts, serving time,
// cost and cache savings, the total of every request, and the ledger's
// health. It is an admin route: it needs the admin key, and no client or
// agent can read it. It names clients by name, never by key.

// Defaults of the usage route's parameters.
const (
	defaultUsageSince = "7d"
	defaultUsageBy    = "client"
)

func (r *Relay) serveUsage(w http.ResponseWriter, req *http.Request) {
	l := r.cfg.Ledger
	if l == nil {
		writeError(w, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "ledger_off",
			Message: "This relay keeps no usage ledger"})
		return
	}
	q := req.URL.Query()
	for k := range q {
		if k != "since" && k != "by" {
			writeError(w, errBadRequest("invalid_parameter", "Unknown parameter '"+k+"': want since and by", nil))
			return
		}
	}
	since, by := q.Get("since"), q.Get("by")
	if since == "" {
		since = defaultUsageSince
	}
	if by == "" {
		by = defaultUsageBy
	}
	t, err := ledger.ParseSince(since, r.cfg.Clock.Now())
	if err != nil {
		writeError(w, errBadRequest("invalid_since", err.Error(), err))
		return
	}
	b, err := ledger.ParseBy(by)
	if err != nil {
		writeError(w, errBadRequest("invalid_by", err.Error(), err))
		return
	}
	rep, err := l.Usage(t, b)
	if err != nil {
		writeError(w, &Error{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "ledger_unavailable",
			Message: "The usage ledger cannot be read: " + err.Error(), Err: err})
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

// errOverBudget is the answer to a client over its budget: 429 in
// OpenAI's insufficient_quota shape, saying which budget and when it
// resets, with Retry-After.
func errOverBudget(v ledger.Verdict, now time.Time) *Error {
	return &Error{Status: http.StatusTooManyRequests, Type: "insufficient_quota", Code: "insufficient_quota",
		Message: v.Message(), RetryAfter: v.RetryAfter(now)}
}
