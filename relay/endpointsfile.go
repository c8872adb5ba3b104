package relay

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"net/url"
	"os"
	"regexp"
	"strings"

	yaml "go.yaml.in/yaml/v3"

	"github.com/computeflux/computeflux/relay/ledger"
)

// DefaultProviderPriority is the tier of a provider endpoint whose entry
// gives no priority: overflow, behind the home agents (tier 0).
const DefaultProviderPriority = 1

// EndpointsFile is the parsed --endpoints-file: the provider endpoints and
// the operator's settings for agents, by agent name. The file is YAML (JSON
// parses too); see ParseEndpointsFile.
type EndpointsFile struct {
	// Endpoints are the provider endpoints, in file order.
	Endpoints []ProviderSpec
	// Agents are the operator's settings for agents, by name.
	Agents []AgentSetting
}

// ProviderSpec is one provider endpoint: an OpenAI-compatible API reached
// over HTTPS (plain HTTP only on the same host or LAN) with API keys.
type ProviderSpec struct {
	// Name is the endpoint's unique name, used in routing headers, logs and
	// the admin API; it may not be the name of an agent.
	Name string
	// URL is the API's base URL, ending where OpenAI's /v1 does
	// (https://api.openai.com/v1): a request for /v1/chat/completions goes
	// to URL + "/chat/completions".
	URL *url.URL
	// Keys are the API keys, tried in this order (secrets: never logged).
	// Empty means requests carry no Authorization header.
	Keys []string
	// Models are the models to route to it. Empty means discovered from
	// GET URL/models with a key.
	Models []string
	// Weight is its static weight; 0 means 1.
	Weight float64
	// Priority is its tier; DefaultProviderPriority unless the file says.
	Priority int
	// MaxConcurrency bounds its requests in flight; 0 means unlimited.
	MaxConcurrency int
	// Disabled takes it out of service from the start.
	Disabled bool
	// Prices are its prices per million tokens, for the usage ledger's
	// cost and cache savings; nil means unpriced (no cost recorded).
	Prices *ledger.Prices
	// Reference marks it as the operator's reference for audits of its
	// models: agents are judged against it, over any consensus. Without
	// it, the endpoint is one voice among the agents' where they are few.
	Reference bool
	// Engine is the kind of engine behind it, as agents report theirs
	// ("vllm", "llamacpp", ...): audits compare sampled answers only
	// between engines of one kind. Empty means not known: its sampled
	// answers are compared only with others of unknown kind.
	Engine string
}

// Prices returns the prices of the priced provider endpoints, by name:
// what the usage ledger's SetPrices takes.
func (ef *EndpointsFile) Prices() map[string]ledger.Prices {
	m := map[string]ledger.Prices{}
	for _, p := range ef.Endpoints {
		if p.Prices != nil {
			m[p.Name] = *p.Prices
		}
	}
	return m
}

// AgentSetting is the operator's word on one agent, which wins over what
// the agent declares.
type AgentSetting struct {
	// Name is the agent's name (its --name).
	Name string
	// Weight replaces the agent's declared weight; 0 means not set.
	Weight float64
	// Priority is the agent's tier; nil means 0.
	Priority *int
	// Disabled keeps the agent out of routing while it is joined.
	Disabled bool
	// Reference marks the agent as the operator's reference for audits of
	// its models: it is not audited, and the others are judged against it.
	Reference bool
}

// References returns the names of the endpoints and agents the file marks
// as references for audits.
func (ef *EndpointsFile) References() []string {
	var out []string
	for _, p := range ef.Endpoints {
		if p.Reference {
			out = append(out, p.Name)
		}
	}
	for _, a := range ef.Agents {
		if a.Reference {
			out = append(out, a.Name)
		}
	}
	return out
}

// The file's shape, as decoded.
type fileSpec struct {
	Endpoints []endpointSpec `yaml:"endpoints"`
	Agents    []agentSpec    `yaml:"agents"`
}

type endpointSpec struct {
	Name           string      `yaml:"name"`
	URL            string      `yaml:"url"`
	Keys           []string    `yaml:"keys"`
	KeyFiles       []string    `yaml:"key_files"`
	Models         []string    `yaml:"models"`
	Weight         float64     `yaml:"weight"`
	Priority       *int        `yaml:"priority"`
	MaxConcurrency int         `yaml:"max_concurrency"`
	Disabled       bool        `yaml:"disabled"`
	Prices         *pricesSpec `yaml:"prices"`
	Reference      bool        `yaml:"reference"`
	Engine         string      `yaml:"engine"`
}

// pricesSpec is an endpoint's prices per million tokens; cached_input
// defaults to input (no discount).
type pricesSpec struct {
	Input       *float64 `yaml:"input"`
	CachedInput *float64 `yaml:"cached_input"`
	Output      *float64 `yaml:"output"`
}

type agentSpec struct {
	Name      string  `yaml:"name"`
	Weight    float64 `yaml:"weight"`
	Priority  *int    `yaml:"priority"`
	Disabled  bool    `yaml:"disabled"`
	Reference bool    `yaml:"reference"`
}

// maxEndpointsFileBytes bounds the file: a routing table, not a data set.
const maxEndpointsFileBytes = 4 << 20

// LoadEndpointsFile reads and parses an endpoints file; key_files are read
// too. Errors name the file, the line and the field.
func LoadEndpointsFile(path string) (*EndpointsFile, error) {
	b, err := readConfigFile("endpoints file", path, maxEndpointsFileBytes)
	if err != nil {
		return nil, err
	}
	ef, err := ParseEndpointsFile(b, os.ReadFile)
	if err != nil {
		return nil, fmt.Errorf("endpoints file %s: %w", path, err)
	}
	return ef, nil
}

// readConfigFile reads the file of kind (say "endpoints file") at path, up
// to limit bytes; its errors name the kind and the path.
func readConfigFile(kind, path string, limit int) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", kind, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, int64(limit)+1))
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", kind, path, err)
	}
	if len(b) > limit {
		return nil, fmt.Errorf("%s %s: larger than %d bytes", kind, path, limit)
	}
	return b, nil
}

var validName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ParseEndpointsFile parses an endpoints file's content. readFile reads
// key_files (nil refuses them). Errors name the line and the field, never a
// key's content.
func ParseEndpointsFile(b []byte, readFile func(string) ([]byte, error)) (*EndpointsFile, error) {
	var spec fileSpec
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&spec); err != nil && !errors.Is(err, io.EOF) {
		return nil, cleanYAMLError(err)
	}
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err != nil {
		return nil, cleanYAMLError(err)
	}
	lines := fileLines{root: &root}
	out := &EndpointsFile{}
	names := map[string]int{}
	for i, es := range spec.Endpoints {
		at := func(field string) string {
			return fmt.Sprintf("line %d: endpoints[%d] (%q): %s", lines.of("endpoints", i, field), i, es.Name, field)
		}
		p := ProviderSpec{Name: es.Name, Models: es.Models, Weight: es.Weight, MaxConcurrency: es.MaxConcurrency, Disabled: es.Disabled, Reference: es.Reference, Engine: es.Engine}
		if !validName.MatchString(es.Name) {
			return nil, fmt.Errorf("%s: want 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit", at("name"))
		}
		if j, ok := names[es.Name]; ok {
			return nil, fmt.Errorf("%s: %q is also the name of endpoints[%d]", at("name"), es.Name, j)
		}
		names[es.Name] = i
		u, err := parseProviderURL(es.URL)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", at("url"), err)
		}
		p.URL = u
		for k, key := range es.Keys {
			if err := checkKey(key); err != nil {
				return nil, fmt.Errorf("%s: key %d %w", at("keys"), k+1, err)
			}
			p.Keys = append(p.Keys, key)
		}
		for _, kf := range es.KeyFiles {
			keys, err := readKeyFile(readFile, kf, at("key_files"))
			if err != nil {
				return nil, err
			}
			p.Keys = append(p.Keys, keys...)
		}
		for m, model := range es.Models {
			if strings.TrimSpace(model) == "" || len(model) > 256 {
				return nil, fmt.Errorf("%s: model %d is empty or longer than 256 bytes", at("models"), m+1)
			}
		}
		if !(es.Weight >= 0) || math.IsInf(es.Weight, 0) {
			return nil, fmt.Errorf("%s: must be a non-negative number, got %v", at("weight"), es.Weight)
		}
		p.Priority = DefaultProviderPriority
		if es.Priority != nil {
			if *es.Priority < 0 || *es.Priority > 1000 {
				return nil, fmt.Errorf("%s: must be 0..1000, got %d", at("priority"), *es.Priority)
			}
			p.Priority = *es.Priority
		}
		if es.MaxConcurrency < 0 {
			return nil, fmt.Errorf("%s: must not be negative, got %d", at("max_concurrency"), es.MaxConcurrency)
		}
		if ps := es.Prices; ps != nil {
			atPrice := func(field string) string {
				return fmt.Sprintf("line %d: endpoints[%d] (%q): prices", lines.nested("endpoints", i, "prices", field), i, es.Name)
			}
			if ps.Input == nil || ps.Output == nil {
				return nil, fmt.Errorf("%s: give input and output (per million tokens; cached_input defaults to input)", atPrice("input"))
			}
			pr := ledger.Prices{Input: *ps.Input, CachedInput: *ps.Input, Output: *ps.Output}
			if ps.CachedInput != nil {
				pr.CachedInput = *ps.CachedInput
			}
			if err := pr.Validate(); err != nil {
				field, _, _ := strings.Cut(err.Error(), ":")
				return nil, fmt.Errorf("%s: %w", atPrice(field), err)
			}
			p.Prices = &pr
		}
		out.Endpoints = append(out.Endpoints, p)
	}
	agents := map[string]int{}
	for i, as := range spec.Agents {
		at := func(field string) string {
			return fmt.Sprintf("line %d: agents[%d] (%q): %s", lines.of("agents", i, field), i, as.Name, field)
		}
		if as.Name == "" || len(as.Name) > maxNameLen {
			return nil, fmt.Errorf("%s: must be an agent's name (1 to %d bytes)", at("name"), maxNameLen)
		}
		if j, ok := agents[as.Name]; ok {
			return nil, fmt.Errorf("%s: agents[%d] already sets %q", at("name"), j, as.Name)
		}
		if j, ok := names[as.Name]; ok {
			return nil, fmt.Errorf("%s: %q is the name of endpoints[%d]", at("name"), as.Name, j)
		}
		agents[as.Name] = i
		if !(as.Weight >= 0) || math.IsInf(as.Weight, 0) {
			return nil, fmt.Errorf("%s: must be a non-negative number, got %v", at("weight"), as.Weight)
		}
		if as.Priority != nil && (*as.Priority < 0 || *as.Priority > 1000) {
			return nil, fmt.Errorf("%s: must be 0..1000, got %d", at("priority"), *as.Priority)
		}
		out.Agents = append(out.Agents, AgentSetting(as))
	}
	return out, nil
}

func checkKey(key string) error {
	if key == "" || strings.ContainsAny(key, " \t\r\n") {
		return errors.New("is empty or contains white space")
	}
	return nil
}

// parseProviderURL checks a provider's base URL: https, or http to a host
// on this machine or the LAN; no credentials, query or fragment.
func parseProviderURL(s string) (*url.URL, error) {
	if s == "" {
		return nil, errors.New("required (the API's base URL, e.g. https://api.example.com/v1)")
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, errors.New("not a URL") // url's error repeats the text
	}
	switch {
	case u.Scheme != "https" && u.Scheme != "http":
		return nil, fmt.Errorf("scheme %q: want https (or http on this host or the LAN)", u.Scheme)
	case u.Host == "" || u.Hostname() == "":
		return nil, errors.New("no host")
	case u.User != nil:
		return nil, errors.New("credentials in the URL: give them as keys or key_files")
	case u.RawQuery != "" || u.Fragment != "":
		return nil, errors.New("a base URL takes no query or fragment")
	case u.Scheme == "http" && !localHost(u.Hostname()):
		return nil, fmt.Errorf("plain http to %s: keys would cross the network in clear text; use https (http is allowed for this host or the LAN only)", u.Hostname())
	}
	u.Path = strings.TrimRight(u.Path, "/")
	u.RawPath = ""
	return u, nil
}

// localHost reports whether host is this machine or on the local network:
// localhost, a loopback, private, link-local or unique-local address, or a
// name without dots or under .local, .lan, .internal or .home.arpa.
func localHost(host string) bool {
	if a, err := netip.ParseAddr(host); err == nil {
		a = a.Unmap()
		return a.IsLoopback() || a.IsPrivate() || a.IsLinkLocalUnicast()
	}
	h := strings.ToLower(strings.TrimSuffix(host, "."))
	if h == "localhost" || strings.HasSuffix(h, ".localhost") || !strings.Contains(h, ".") {
		return net.ParseIP(h) == nil
	}
	for _, s := range []string{".local", ".lan", ".internal", ".home.arpa"} {
		if strings.HasSuffix(h, s) {
			return true
		}
	}
	return false
}

// cleanYAMLError turns the decoder's type names into the file's words.
func cleanYAMLError(err error) error {
	msg := err.Error()
	msg = strings.TrimPrefix(msg, "yaml: ")
	msg = strings.ReplaceAll(msg, "unmarshal errors:\n  ", "")
	msg = strings.ReplaceAll(msg, "\n  ", "; ")
	r := strings.NewReplacer("in type relay.endpointSpec", "in an endpoint", "in type relay.agentSpec", "in an agent",
		"in type relay.fileSpec", "at the top level (want endpoints, agents)", "into relay.fileSpec", "into the file's top level",
		"into []relay.endpointSpec", "into endpoints (want a list)", "into []relay.agentSpec", "into agents (want a list)",
		"in type relay.pricesSpec", "in prices (want input, cached_input, output)", "into relay.pricesSpec", "into prices (want a mapping)")
	return errors.New(r.Replace(msg))
}

// fileLines finds line numbers in the parsed document.
type fileLines struct{ root *yaml.Node }

// of returns the line of field in item i of the top-level list named list,
// or of the item itself when the field is absent; 0 if unknown.
func (l fileLines) of(list string, i int, field string) int {
	doc := l.root
	if doc == nil || len(doc.Content) == 0 {
		return 0
	}
	top := doc.Content[0]
	seq := mapValue(top, list)
	if seq == nil || seq.Kind != yaml.SequenceNode || i >= len(seq.Content) {
		return 0
	}
	item := seq.Content[i]
	for j := 0; j+1 < len(item.Content); j += 2 {
		if item.Content[j].Value == field {
			return item.Content[j].Line
		}
	}
	return item.Line
}

// nested returns the line of sub in the mapping field of item i of list,
// or of field itself when sub is absent; 0 if unknown.
func (l fileLines) nested(list string, i int, field, sub string) int {
	doc := l.root
	if doc == nil || len(doc.Content) == 0 {
		return 0
	}
	seq := mapValue(doc.Content[0], list)
	if seq == nil || seq.Kind != yaml.SequenceNode || i >= len(seq.Content) {
		return 0
	}
	m := mapValue(seq.Content[i], field)
	if m == nil {
		return l.of(list, i, field)
	}
	for j := 0; j+1 < len(m.Content); j += 2 {
		if m.Content[j].Value == sub {
			return m.Content[j].Line
		}
	}
	return l.of(list, i, field)
}

func mapValue(m *yaml.Node, key string) *yaml.Node {
	if m == nil || m.Kind != yaml.MappingNode {
		return nil
	}
	for j := 0; j+1 < len(m.Content); j += 2 {
		if m.Content[j].Value == key {
			return m.Content[j+1]
		}
	}
	return nil
}

// readKeyFile reads the keys of key file kf through readFile (nil: key
// files are refused), one per line; where names the field in errors.
func readKeyFile(readFile func(string) ([]byte, error), kf, where string) ([]string, error) {
	if readFile == nil {
		return nil, fmt.Errorf("%s: key files are not allowed here", where)
	}
	kb, err := readFile(kf)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	keys, err := ParseAPIKeys(bytes.NewReader(kb))
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", where, kf, err)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("%s: %s holds no key", where, kf)
	}
	return keys, nil
}
