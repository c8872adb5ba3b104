package relay

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"

	yaml "go.yaml.in/yaml/v3"

	"github.com/computeflux/computeflux/scheduler"
)

// Client is who sends requests: the holder of one or more API keys. The
// clients file names clients and gives each its share of the fleet under
// contention, its class and its budget; a key the file does not name is a
// client of its own with the file's defaults.
type Client struct {
	// Name is the client's name from the clients file; for a key without
	// a name, "key-" and the first 12 hex digits of the key's SHA-256 (not
	// a secret: the digest does not give the key back).
	Name string
	// Named is true for a client the clients file names.
	Named bool
	// Weight is the client's share when several wait for the fleet; 1
	// unless the file says.
	Weight float64
	// Class is the client's band: interactive unless the file says.
	Class scheduler.Band
	// Budget bounds the client's use; the zero value is unlimited.
	Budget Budget
	// Verify is the share of the client's chat answers sent again, with
	// the same seed, to the operator's references for the model, and the
	// agent's answer compared with theirs (audits.go); 0 means none. The
	// prompt goes to the operator's references only.
	Verify float64
}

// Budget bounds what a client may use. Zero fields are unlimited.
type Budget struct {
	// TokensPerDay bounds prompt plus completion tokens per UTC day.
	TokensPerDay int64
	// TokensPerMonth bounds them per UTC calendar month.
	TokensPerMonth int64
	// CostPerMonth bounds the cost per UTC calendar month, priced by the
	// endpoints file's prices.
	CostPerMonth float64
}

// Unlimited reports whether b bounds nothing.
func (b Budget) Unlimited() bool { return b == Budget{} }

// ClientsFile is the parsed --clients-file: named clients with their keys,
// and the defaults for keys no client names.
type ClientsFile struct {
	// Clients are the named clients, in file order.
	Clients []ClientSpec
	// Default applies to every key no client names (its Name and Keys are
	// empty).
	Default ClientSpec
}

// ClientSpec is one named client.
type ClientSpec struct {
	Client
	// Digests are the SHA-256 digests of the client's keys (keys given in
	// clear are kept only as digests).
	Digests [][sha256.Size]byte
}

type clientsFileSpec struct {
	Clients []clientSpecYAML `yaml:"clients"`
	Default *clientSpecYAML  `yaml:"default"`
}

type clientSpecYAML struct {
	Name      string      `yaml:"name"`
	Keys      []string    `yaml:"keys"`
	KeyFiles  []string    `yaml:"key_files"`
	KeySHA256 []string    `yaml:"key_sha256"`
	Weight    *float64    `yaml:"weight"`
	Class     string      `yaml:"class"`
	Budget    *budgetYAML `yaml:"budget"`
	Verify    float64     `yaml:"verify"`
}

type budgetYAML struct {
	TokensPerDay   int64   `yaml:"tokens_per_day"`
	TokensPerMonth int64   `yaml:"tokens_per_month"`
	CostPerMonth   float64 `yaml:"cost_per_month"`
}

// maxClientsFileBytes bounds the file.
const maxClientsFileBytes = 16 << 20

// MaxClientWeight bounds a client's weight.
const MaxClientWeight = 1000

// LoadClientsFile reads and parses a clients file; key_files are read too.
// Errors name the file, the line and the field, never a key.
func LoadClientsFile(path string) (*ClientsFile, error) {
	b, err := readConfigFile("clients file", path, maxClientsFileBytes) // endpointsfile.go
	if err != nil {
		return nil, err
	}
	cf, err := ParseClientsFile(b, os.ReadFile)
	if err != nil {
		return nil, fmt.Errorf("clients file %s: %w", path, err)
	}
	return cf, nil
}

// ParseClientsFile parses a clients file's content (YAML; JSON parses
// too). readFile reads key_files (nil refuses them). Errors name the line
// and the field, never a key's content. A key may belong to one client
// only.
func ParseClientsFile(b []byte, readFile func(string) ([]byte, error)) (*ClientsFile, error) {
	var spec clientsFileSpec
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&spec); err != nil && !errors.Is(err, io.EOF) {
		return nil, cleanClientsYAMLError(err)
	}
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err != nil {
		return nil, cleanClientsYAMLError(err)
	}
	lines := fileLines{root: &root}
	out := &ClientsFile{Default: ClientSpec{Client: Client{Weight: 1}}}
	if d := spec.Default; d != nil {
		at := func(field string) string {
			return fmt.Sprintf("line %d: default: %s", defaultLine(&root, field), field)
		}
		if d.Name != "" || len(d.Keys)+len(d.KeyFiles)+len(d.KeySHA256) > 0 {
			return nil, fmt.Errorf("%s: the default applies to keys no client names; it takes no name or keys", at("name"))
		}
		c, err := d.client(at)
		if err != nil {
			return nil, err
		}
		out.Default.Client = c
	}
	names := map[string]int{}
	owner := map[[sha256.Size]byte]int{}
	for i, cs := range spec.Clients {
		at := func(field string) string {
			return fmt.Sprintf("line %d: clients[%d] (%q): %s", lines.of("clients", i, field), i, cs.Name, field)
		}
		if !validName.MatchString(cs.Name) || strings.HasPrefix(cs.Name, "key-") {
			return nil, fmt.Errorf("%s: want 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit (and not \"key-\", which names keys without a client)", at("name"))
		}
		if j, ok := names[cs.Name]; ok {
			return nil, fmt.Errorf("%s: %q is also the name of clients[%d]", at("name"), cs.Name, j)
		}
		names[cs.Name] = i
		c, err := cs.client(at)
		if err != nil {
			return nil, err
		}
		c.Name, c.Named = cs.Name, true
		cl := ClientSpec{Client: c}
		add := func(field string, d [sha256.Size]byte, n int) error {
			if j, ok := owner[d]; ok {
				if j == i {
					return fmt.Errorf("%s: key %d is given twice", at(field), n)
				}
				return fmt.Errorf("%s: key %d is also a key of clients[%d] (%q)", at(field), n, j, spec.Clients[j].Name)
			}
			owner[d] = i
			cl.Digests = append(cl.Digests, d)
			return nil
		}
		for k, key := range cs.Keys {
			if err := checkKey(key); err != nil {
				return nil, fmt.Errorf("%s: key %d %w", at("keys"), k+1, err)
			}
			if err := add("keys", sha256.Sum256([]byte(key)), k+1); err != nil {
				return nil, err
			}
		}
		for _, kf := range cs.KeyFiles {
			keys, err := readKeyFile(readFile, kf, at("key_files"))
			if err != nil {
				return nil, err
			}
			for k, key := range keys {
				if err := add("key_files", sha256.Sum256([]byte(key)), k+1); err != nil {
					return nil, err
				}
			}
		}
		for k, h := range cs.KeySHA256 {
			raw, err := hex.DecodeString(strings.ToLower(h))
			if err != nil || len(raw) != sha256.Size {
				return nil, fmt.Errorf("%s: digest %d is not 64 hex digits (a key's SHA-256, as `printf %%s KEY | sha256sum` prints it)", at("key_sha256"), k+1)
			}
			if err := add("key_sha256", [sha256.Size]byte(raw), k+1); err != nil {
				return nil, err
			}
		}
		if len(cl.Digests) == 0 {
			return nil, fmt.Errorf("%s: a client needs at least one key (keys, key_files or key_sha256)", at("keys"))
		}
		out.Clients = append(out.Clients, cl)
	}
	return out, nil
}

// client checks and converts the fields a client and the default share.
func (cs clientSpecYAML) client(at func(string) string) (Client, error) {
	c := Client{Weight: 1}
	if cs.Weight != nil {
		w := *cs.Weight
		if !(w > 0) || w > MaxClientWeight {
			return c, fmt.Errorf("%s: must be a number above 0 and at most %d, got %v", at("weight"), MaxClientWeight, w)
		}
		c.Weight = w
	}
	if cs.Class != "" {
		band, err := scheduler.ParseBand(cs.Class)
		if err != nil {
			return c, fmt.Errorf("%s: %q: want interactive or batch", at("class"), cs.Class)
		}
		c.Class = band
	}
	if b := cs.Budget; b != nil {
		if b.TokensPerDay < 0 || b.TokensPerMonth < 0 || !(b.CostPerMonth >= 0) || math.IsInf(b.CostPerMonth, 0) {
			return c, fmt.Errorf("%s: tokens_per_day, tokens_per_month and cost_per_month must not be negative", at("budget"))
		}
		c.Budget = Budget(*b)
	}
	if v := cs.Verify; !(v >= 0 && v <= 1) {
		return c, fmt.Errorf("%s: must be a share from 0 to 1, got %v", at("verify"), v)
	}
	c.Verify = cs.Verify
	return c, nil
}

// defaultLine returns the line of field in the top-level default block,
// or of the block itself.
func defaultLine(root *yaml.Node, field string) int {
	if root == nil || len(root.Content) == 0 {
		return 0
	}
	d := mapValue(root.Content[0], "default")
	if d == nil {
		return 0
	}
	for j := 0; j+1 < len(d.Content); j += 2 {
		if d.Content[j].Value == field {
			return d.Content[j].Line
		}
	}
	return d.Line
}

// cleanClientsYAMLError turns the decoder's type names into the file's words.
func cleanClientsYAMLError(err error) error {
	msg := err.Error()
	msg = strings.TrimPrefix(msg, "yaml: ")
	msg = strings.ReplaceAll(msg, "unmarshal errors:\n  ", "")
	msg = strings.ReplaceAll(msg, "\n  ", "; ")
	r := strings.NewReplacer("in type relay.clientSpecYAML", "in a client", "in type relay.budgetYAML", "in a budget",
		"in type relay.clientsFileSpec", "at the top level (want clients, default)", "into relay.clientsFileSpec", "into the file's top level",
		"into []relay.clientSpecYAML", "into clients (want a list)", "into relay.clientSpecYAML", "into a client (want a mapping)",
		"into relay.budgetYAML", "into a budget (want a mapping)")
	return errors.New(r.Replace(msg))
}

// keyClientName names the client of a key no client names.
func keyClientName(digest [sha256.Size]byte) string {
	return "key-" + hex.EncodeToString(digest[:6])
}

// clientTable resolves a key's digest to its client. It is built once and
// read without locks; a reload builds a new one.
type clientTable struct {
	byDigest map[[sha256.Size]byte]*Client
	names    map[string]*Client
	def      Client
	named    []*Client // in file order
}

// newClientTable builds the table of keys (from the API keys file, each its
// own client unless cf names it) and cf's clients. cf may be nil.
func newClientTable(keys []string, cf *ClientsFile) *clientTable {
	t := &clientTable{byDigest: make(map[[sha256.Size]byte]*Client), names: make(map[string]*Client), def: Client{Weight: 1}}
	if cf != nil {
		t.def = cf.Default.Client
		for i := range cf.Clients {
			c := cf.Clients[i].Client
			t.named = append(t.named, &c)
			for _, d := range cf.Clients[i].Digests {
				t.byDigest[d] = &c
			}
		}
	}
	for _, k := range keys {
		d := sha256.Sum256([]byte(k))
		if _, ok := t.byDigest[d]; ok {
			continue
		}
		c := t.def
		c.Name, c.Named = keyClientName(d), false
		t.byDigest[d] = &c
	}
	for _, c := range t.byDigest {
		t.names[c.Name] = c
	}
	for _, c := range t.named {
		t.names[c.Name] = c
	}
	return t
}

// lookup returns the client of a key's digest, or nil for an unknown key.
// The digest is compared by map lookup: its timing tells nothing about a
// key, since the digest does not give the key back.
func (t *clientTable) lookup(d [sha256.Size]byte) *Client {
	return t.byDigest[d]
}

// size returns the number of keys known.
func (t *clientTable) size() int { return len(t.byDigest) }

// byName returns the client called name (a key's "key-" name too), or nil.
func (t *clientTable) byName(name string) *Client {
	return t.names[name]
}
