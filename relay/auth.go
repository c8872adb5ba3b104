package relay

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strings"
)

// keyring checks client API keys. It keeps only SHA-256 digests and compares
// a presented key's digest with every stored digest, without stopping at a
// match, so neither the key's content nor its position shows in the timing.
type keyring struct {
	digests [][sha256.Size]byte
}

func newKeyring(keys []string) *keyring {
	k := &keyring{digests: make([][sha256.Size]byte, 0, len(keys))}
	for _, key := range keys {
		k.digests = append(k.digests, sha256.Sum256([]byte(key)))
	}
	return k
}

// check reports whether r carries "Authorization: Bearer KEY" with a known KEY.
func (k *keyring) check(r *http.Request) bool {
	h := r.Header.Get("Authorization")
	const prefix = "bearer "
	if len(h) <= len(prefix) || !strings.EqualFold(h[:len(prefix)], prefix) {
		return false
	}
	d := sha256.Sum256([]byte(strings.TrimSpace(h[len(prefix):])))
	ok := 0
	for i := range k.digests {
		ok |= subtle.ConstantTimeCompare(d[:], k.digests[i][:])
	}
	return ok == 1
}
