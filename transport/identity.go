package transport

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"

	"github.com/libp2p/go-libp2p/core/crypto"
)

// maxIdentityFileSize bounds what LoadOrCreateIdentity reads: a marshalled
// Ed25519 key is 68 bytes.
const maxIdentityFileSize = 4096

// LoadOrCreateIdentity returns the Ed25519 private key kept in the file at
// path. When the file does not exist, a new key is generated and written there
// with mode 0600 (the directory is created 0700 if missing). A file readable
// or writable by group or others, or holding another kind of key, is refused
// with an error that says why. An empty path returns a new ephemeral key.
func LoadOrCreateIdentity(path string) (crypto.PrivKey, error) {
	if path == "" {
		k, _, err := crypto.GenerateEd25519Key(rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("generate identity: %w", err)
		}
		return k, nil
	}
	k, err := loadIdentity(path)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return k, err
	}
	return createIdentity(path)
}

func loadIdentity(path string) (crypto.PrivKey, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("identity file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("identity file: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("identity file %s is not a regular file", path)
	}
	// Windows has no Unix permission bits worth checking.
	if runtime.GOOS != "windows" && st.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("identity file %s has mode %04o: it holds a private key and must be accessible by its owner only (chmod 600 %s)",
			path, st.Mode().Perm(), path)
	}
	if st.Size() > maxIdentityFileSize {
		return nil, fmt.Errorf("identity file %s is %d bytes: not a libp2p private key", path, st.Size())
	}
	b := make([]byte, st.Size())
	if _, err := f.ReadAt(b, 0); err != nil {
		return nil, fmt.Errorf("read identity file %s: %w", path, err)
	}
	k, err := crypto.UnmarshalPrivateKey(b)
	if err != nil {
		return nil, fmt.Errorf("identity file %s does not hold a libp2p private key: %w", path, err)
	}
	if k.Type() != crypto.Ed25519 {
		return nil, fmt.Errorf("identity file %s holds a %s key; an Ed25519 key is required", path, k.Type())
	}
	return k, nil
}

func createIdentity(path string) (crypto.PrivKey, error) {
	k, _, err := crypto.GenerateEd25519Key(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate identity: %w", err)
	}
	b, err := crypto.MarshalPrivateKey(k)
	if err != nil {
		return nil, fmt.Errorf("marshal identity: %w", err)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("identity directory: %w", err)
	}
	// Write a temporary file and link it into place so that a crash never
	// leaves a half-written key, and two processes racing to create the key
	// agree on one (the loser loads the winner's).
	tmp, err := os.CreateTemp(dir, ".identity-*")
	if err != nil {
		return nil, fmt.Errorf("create identity file: %w", err)
	}
	tmpName := tmp.Name()
	defer os.Remove(tmpName)
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return nil, fmt.Errorf("create identity file: %w", err)
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return nil, fmt.Errorf("write identity file: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return nil, fmt.Errorf("write identity file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return nil, fmt.Errorf("write identity file: %w", err)
	}
	if err := os.Link(tmpName, path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return loadIdentity(path)
		}
		// Some file systems have no hard links: fall back to a rename.
		if err := os.Rename(tmpName, path); err != nil {
			return nil, fmt.Errorf("create identity file: %w", err)
		}
	}
	return k, nil
}
