package transport

import (
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/libp2p/go-libp2p/core/crypto"
)

func TestIdentityCreatedPrivateAndReused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", "identity.key")
	k1, err := LoadOrCreateIdentity(path)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("created with mode %04o, want 0600", st.Mode().Perm())
	}
	if k1.Type() != crypto.Ed25519 {
		t.Fatalf("key type %s", k1.Type())
	}
	k2, err := LoadOrCreateIdentity(path)
	if err != nil {
		t.Fatal(err)
	}
	if !k1.Equals(k2) {
		t.Fatal("second load returned a different key")
	}
}

func TestIdentityEphemeral(t *testing.T) {
	a, err := LoadOrCreateIdentity("")
	if err != nil {
		t.Fatal(err)
	}
	b, err := LoadOrCreateIdentity("")
	if err != nil {
		t.Fatal(err)
	}
	if a.Equals(b) {
		t.Fatal("two ephemeral identities are equal")
	}
}

func TestIdentityRefused(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.key")
	if _, err := LoadOrCreateIdentity(good); err != nil {
		t.Fatal(err)
	}
	goodBytes, _ := os.ReadFile(good)
	secp, _, _ := crypto.GenerateSecp256k1Key(rand.Reader)
	secpBytes, _ := crypto.MarshalPrivateKey(secp)

	cases := []struct {
		name    string
		content []byte
		mode    os.FileMode
		want    string
	}{
		{"group readable", goodBytes, 0o640, "chmod 600"},
		{"world readable", goodBytes, 0o644, "chmod 600"},
		{"wrong key type", secpBytes, 0o600, "Ed25519"},
		{"garbage", []byte("not a key"), 0o600, "does not hold"},
		{"empty", nil, 0o600, "does not hold"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_"))
			if err := os.WriteFile(p, c.content, c.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, c.mode); err != nil {
				t.Fatal(err)
			}
			_, err := LoadOrCreateIdentity(p)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want mention of %q", err, c.want)
			}
			// The file is left alone: no silent replacement of a key.
			after, _ := os.ReadFile(p)
			if string(after) != string(c.content) {
				t.Fatal("refused file was modified")
			}
		})
	}
}
