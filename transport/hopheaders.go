package transport

import (
	"net/http"
	"net/textproto"
	"strings"
)

// The hop-by-hop header rule, one for the relay and the agent: a header
// that describes one connection (RFC 9110 section 7.6.1, with
// httputil.ReverseProxy's list), or that the Connection header names, is not
// forwarded, in either direction.

// HopHeader reports whether the canonical header name k is hop-by-hop.
func HopHeader(k string) bool {
	switch k {
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return false
}

// RemoveConnectionNamed deletes the headers that h's Connection header
// names.
func RemoveConnectionNamed(h http.Header) {
	for _, f := range h["Connection"] {
		for sf := range strings.SplitSeq(f, ",") {
			if sf = textproto.TrimString(sf); sf != "" {
				h.Del(sf)
			}
		}
	}
}

// RemoveHopHeaders deletes h's hop-by-hop headers (HopHeader) and those
// its Connection header names.
func RemoveHopHeaders(h http.Header) {
	RemoveConnectionNamed(h)
	for k := range h {
		if HopHeader(k) {
			delete(h, k)
		}
	}
}
