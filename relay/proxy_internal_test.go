package relay

import (
	"encoding/json"
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

// FuzzJSONString checks jsonString against json.Unmarshal on every valid
// JSON string.
func FuzzJSONString(f *testing.F) {
	for _, s := range []string{`"m1"`, `""`, `"a\"b"`, `"\u00e9t\u00e9"`, "\"\xff\"", `"été"`, `"tab	"`, `"x\\"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) || len(raw) == 0 || raw[0] != '"' {
			return
		}
		var want string
		wantErr := json.Unmarshal(raw, &want)
		got, err := jsonString(raw)
		if (err != nil) != (wantErr != nil) || got != want {
			t.Fatalf("jsonString(%q) = %q, %v; Unmarshal: %q, %v", raw, got, err, want, wantErr)
		}
	})
}
