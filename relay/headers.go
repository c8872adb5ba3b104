package relay

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// withheldHeaders are answer headers the relay does not pass on besides the
// hop-by-hop ones (transport.HopHeader): our own routing headers when an
// agent sends them, and a provider's cookies and account names, which are
// the relay operator's, not the client's.
var withheldHeaders = map[string]bool{
	http.CanonicalHeaderKey(HeaderAgent): true, http.CanonicalHeaderKey(HeaderAffinity): true,
	http.CanonicalHeaderKey(transport.HeaderUsage): true, http.CanonicalHeaderKey(transport.HeaderAPIMissing): true,
	"Set-Cookie": true, "Openai-Organization": true, "Openai-Project": true,
}

// copyResponseHeaders passes the endpoint's answer headers src to the
// client's dst, without the hop-by-hop and withheld ones, and adds the
// routing headers of choice c.
func copyResponseHeaders(dst, src http.Header, c scheduler.Choice) {
	if len(src["Connection"]) > 0 {
		transport.RemoveConnectionNamed(src)
	}
	for k, vv := range src {
		if !transport.HopHeader(k) && !withheldHeaders[k] {
			dst[k] = vv
		}
	}
	// Set without canonicalising, so the wire shows the documented
	// spelling (X-ComputeFlux-...); header names are case-insensitive.
	dst[HeaderAgent] = []string{c.EndpointID}
	if int(c.Affinity) < len(affinityValues) {
		dst[HeaderAffinity] = affinityValues[c.Affinity]
	} else {
		dst[HeaderAffinity] = []string{c.Affinity.String()}
	}
}

// forwardedHeaders are the request headers an engine may use: looked up by
// their canonical key (as the server parsed them), forwarded with the
// spelling the APIs document. Canonicalising "OpenAI-Beta" and the like on
// every request cost an allocation each.
var forwardedHeaders = [...]struct{ canon, wire string }{
	{"Content-Type", "Content-Type"},
	{"Accept", "Accept"},
	{"Openai-Beta", "OpenAI-Beta"},
	{"X-Request-Id", "X-Request-ID"},
	{"Anthropic-Version", "anthropic-version"}, // for engines that serve /v1/messages
	{"Anthropic-Beta", "anthropic-beta"},
	{headerSessionCanon, HeaderSession},
}

// headerSessionCanon is HeaderSession in canonical form.
const headerSessionCanon = "X-Session-Id"

// Shared header values: a RoundTripper must not modify its request, so
// one slice serves every request.
var (
	jsonContentType  = []string{"application/json"}
	identityEncoding = []string{"identity"}
)

// affinityValues are the X-ComputeFlux-Affinity values by
// scheduler.Affinity, shared by every response: header values are only
// read once set (net/http copies them when the header is written).
var affinityValues = [...][]string{
	scheduler.AffinityNone: {scheduler.AffinityNone.String()},
	scheduler.AffinityHit:  {scheduler.AffinityHit.String()},
	scheduler.AffinityMiss: {scheduler.AffinityMiss.String()},
}

// copyRequestHeaders forwards what an engine may use. The client's
// Authorization (its relay key) is never forwarded.
func copyRequestHeaders(dst, src http.Header) {
	for _, h := range forwardedHeaders {
		if v := src[h.canon]; len(v) > 0 {
			dst[h.wire] = v
		}
	}
	if dst.Get("Content-Type") == "" {
		dst["Content-Type"] = jsonContentType
	}
	// Bytes pass through as the agent sends them; no transparent gzip.
	dst["Accept-Encoding"] = identityEncoding
}

// parseRetryAfter reads Retry-After as seconds or an HTTP date; 0 if absent
// or malformed.
func parseRetryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && s >= 0 {
		return time.Duration(min(s, 3600)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return min(t.Sub(now), time.Hour)
	}
	return 0
}
