package relay

import (
	"net/http"
	"testing"
)

func TestForwardedHeadersCanonical(t *testing.T) {
	for _, h := range forwardedHeaders {
		if got := http.CanonicalHeaderKey(h.wire); got != h.canon {
			t.Errorf("%s: canonical %s, table says %s", h.wire, got, h.canon)
		}
	}
	if http.CanonicalHeaderKey(HeaderSession) != headerSessionCanon {
		t.Errorf("headerSessionCanon %s is not %s canonicalised", headerSessionCanon, HeaderSession)
	}
}
