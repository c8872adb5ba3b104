package relay

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/computeflux/computeflux/scheduler"
)

func TestParseClientsFile(t *testing.T) {
	digest := sha256.Sum256([]byte("sk-carol"))
	file := `
default:
  weight: 0.5
  class: batch
clients:
  - name: alice
    keys: [sk-alice-1, sk-alice-2]
    weight: 2
    budget: {tokens_per_day: 1000000, tokens_per_month: 20000000, cost_per_month: 50}
  - name: bob
    key_files: [bob.keys]
    class: batch
  - name: carol
    key_sha256: [` + strings.ToUpper(hex.EncodeToString(digest[:])) + `]
`
	files := map[string]string{"bob.keys": "# bob\nsk-bob\n"}
	cf, err := ParseClientsFile([]byte(file), func(p string) ([]byte, error) {
		if s, ok := files[p]; ok {
			return []byte(s), nil
		}
		return nil, errors.New("no such file")
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(cf.Clients) != 3 {
		t.Fatalf("%d clients", len(cf.Clients))
	}
	a, b, c := cf.Clients[0], cf.Clients[1], cf.Clients[2]
	if a.Name != "alice" || !a.Named || a.Weight != 2 || a.Class != scheduler.BandInteractive || len(a.Digests) != 2 ||
		a.Budget != (Budget{TokensPerDay: 1_000_000, TokensPerMonth: 20_000_000, CostPerMonth: 50}) {
		t.Fatalf("alice: %+v", a)
	}
	if b.Weight != 1 || b.Class != scheduler.BandBatch || b.Digests[0] != sha256.Sum256([]byte("sk-bob")) || !b.Budget.Unlimited() {
		t.Fatalf("bob: %+v", b)
	}
	if c.Digests[0] != digest {
		t.Fatalf("carol's digest %x", c.Digests[0])
	}
	if cf.Default.Weight != 0.5 || cf.Default.Class != scheduler.BandBatch {
		t.Fatalf("default: %+v", cf.Default)
	}

	tab := newClientTable([]string{"sk-alice-1", "sk-dave"}, cf)
	if got := tab.lookup(sha256.Sum256([]byte("sk-alice-2"))); got == nil || got.Name != "alice" {
		t.Fatalf("alice's second key: %+v", got)
	}
	d := sha256.Sum256([]byte("sk-dave"))
	dave := tab.lookup(d)
	if dave == nil || dave.Named || dave.Name != "key-"+hex.EncodeToString(d[:6]) || dave.Weight != 0.5 || dave.Class != scheduler.BandBatch {
		t.Fatalf("a key no client names: %+v", dave)
	}
	if strings.Contains(dave.Name, "dave") {
		t.Fatal("a key's client name shows the key")
	}
	if tab.lookup(sha256.Sum256([]byte("sk-nobody"))) != nil {
		t.Fatal("an unknown key has a client")
	}
	if tab.size() != 5 {
		t.Fatalf("%d keys known, want 5", tab.size())
	}
}

func TestParseClientsFileErrors(t *testing.T) {
	cases := []struct{ name, file, want string }{
		{"unknown field", "clients:\n  - name: a\n    keys: [k]\n    wieght: 2\n", "line 4: field wieght not found in a client"},
		{"bad name", "clients:\n  - name: 'a b'\n    keys: [k]\n", "line 2: clients[0] (\"a b\"): name"},
		{"reserved name", "clients:\n  - name: key-1\n    keys: [k]\n", "line 2: clients[0] (\"key-1\"): name"},
		{"duplicate name", "clients:\n  - name: a\n    keys: [k1]\n  - name: a\n    keys: [k2]\n", "line 4: clients[1] (\"a\"): name: \"a\" is also the name of clients[0]"},
		{"duplicate key", "clients:\n  - name: a\n    keys: [k1]\n  - name: b\n    keys: [k2, k1]\n", "line 5: clients[1] (\"b\"): keys: key 2 is also a key of clients[0] (\"a\")"},
		{"key twice", "clients:\n  - name: a\n    keys: [k1, k1]\n", "line 3: clients[0] (\"a\"): keys: key 2 is given twice"},
		{"no key", "clients:\n  - name: a\n    weight: 1\n", "line 2: clients[0] (\"a\"): keys: a client needs at least one key"},
		{"zero weight", "clients:\n  - name: a\n    keys: [k]\n    weight: 0\n", "line 4: clients[0] (\"a\"): weight: must be a number above 0"},
		{"negative weight", "clients:\n  - name: a\n    keys: [k]\n    weight: -1\n", "line 4: clients[0] (\"a\"): weight"},
		{"unknown class", "clients:\n  - name: a\n    keys: [k]\n    class: urgent\n", "line 4: clients[0] (\"a\"): class: \"urgent\": want interactive or batch"},
		{"negative budget", "clients:\n  - name: a\n    keys: [k]\n    budget: {tokens_per_day: -5}\n", "line 4: clients[0] (\"a\"): budget: tokens_per_day"},
		{"negative cost", "clients:\n  - name: a\n    keys: [k]\n    budget:\n      cost_per_month: -1\n", "line 4: clients[0] (\"a\"): budget"},
		{"bad digest", "clients:\n  - name: a\n    key_sha256: [abc]\n", "line 3: clients[0] (\"a\"): key_sha256: digest 1 is not 64 hex digits"},
		{"key with space", "clients:\n  - name: a\n    keys: ['k 1']\n", "line 3: clients[0] (\"a\"): keys: key 1 is empty or contains white space"},
		{"key files refused", "clients:\n  - name: a\n    key_files: [f]\n", "key files are not allowed here"},
		{"default with keys", "default:\n  keys: [k]\n", "line 2: default: name: the default applies to keys no client names"},
		{"default bad weight", "default:\n  weight: 0\n", "line 2: default: weight"},
		{"not a list", "clients: 5\n", "into clients (want a list)"},
		{"bad yaml", "clients: [\n", "did not find expected node content"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseClientsFile([]byte(tc.file), nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "k1") && tc.name != "unknown field" {
				t.Fatalf("error %q shows a key", err)
			}
		})
	}
}
