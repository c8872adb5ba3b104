package relay

import (
	"math"
	"sync"
)

// DefaultMaxAgentWeight caps the weight an agent declares when it joins
// (Config.MaxAgentWeight): any holder of the join secret can claim any
// weight, and a weight is a multiplier on the agent's score, so an uncapped
// claim of 10^6 would take all traffic. 4 lets a box with a few GPUs ask
// for a few times the traffic of a single-GPU box; anything beyond that is
// the operator's to grant, in the endpoints file or the admin API.
const DefaultMaxAgentWeight = 4

// Where an endpoint's effective weight comes from.
const (
	weightDeclared = "declared" // the agent's (or the file's, for a provider)
	weightCapped   = "capped"   // the agent's, capped at MaxAgentWeight
	weightFile     = "file"     // the endpoints file's agents section
	weightAdmin    = "admin"    // set through the admin API
)

// operator holds the operator's settings that win over what agents declare:
// the endpoints file's agents section and the admin API's overrides. Admin
// overrides are kept across reloads of the file. Safe for concurrent use;
// its lock is taken after the registry's, never before.
type operator struct {
	maxAgentWeight float64

	mu       sync.Mutex // guards the fields below
	file     map[string]AgentSetting
	admin    map[string]*override
	reserved map[string]bool // provider endpoint names: no agent may join as one
}

// override is what the admin API set for one endpoint, by name.
type override struct {
	disabled *bool   // nil: the file's (or nobody's) word stands
	draining bool    // no new requests; in-flight ones finish
	weight   float64 // 0: not set
}

func newOperator(maxAgentWeight float64) *operator {
	return &operator{
		maxAgentWeight: maxAgentWeight,
		file:           map[string]AgentSetting{},
		admin:          map[string]*override{},
		reserved:       map[string]bool{},
	}
}

// setFile replaces the file's settings and the reserved names.
func (o *operator) setFile(agents []AgentSetting, providerNames []string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.file = make(map[string]AgentSetting, len(agents))
	for _, a := range agents {
		o.file[a.Name] = a
	}
	o.reserved = make(map[string]bool, len(providerNames))
	for _, n := range providerNames {
		o.reserved[n] = true
	}
}

// isReserved reports whether name belongs to a provider endpoint.
func (o *operator) isReserved(name string) bool {
	if o == nil {
		return false
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.reserved[name]
}

// edit applies fn to the admin override of name, creating it.
func (o *operator) edit(name string, fn func(*override)) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ov := o.admin[name]
	if ov == nil {
		ov = &override{}
		o.admin[name] = ov
	}
	fn(ov)
	if ov.disabled == nil && !ov.draining && ov.weight == 0 {
		delete(o.admin, name)
	}
}

// settings is the operator's view of one endpoint, for the table.
type settings struct {
	weight       float64 // effective weight (0: 1)
	weightSource string
	priority     int
	disabled     bool
	draining     bool // by the admin API
}

// agent returns the settings for an agent that declared weight.
func (o *operator) agent(name string, declared float64) settings {
	st := settings{weight: declared, weightSource: weightDeclared}
	if o == nil {
		return st
	}
	if !(declared > 0) || math.IsInf(declared, 0) {
		st.weight = 0
	}
	if st.weight > o.maxAgentWeight {
		st.weight, st.weightSource = o.maxAgentWeight, weightCapped
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if f, ok := o.file[name]; ok {
		if f.Weight > 0 {
			st.weight, st.weightSource = f.Weight, weightFile
		}
		if f.Priority != nil {
			st.priority = *f.Priority
		}
		st.disabled = f.Disabled
	}
	o.applyAdmin(name, &st)
	return st
}

// provider returns the settings for a provider endpoint.
func (o *operator) provider(p ProviderSpec) settings {
	st := settings{weight: p.Weight, weightSource: weightDeclared, priority: p.Priority, disabled: p.Disabled}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.applyAdmin(p.Name, &st)
	return st
}

func (o *operator) applyAdmin(name string, st *settings) {
	ov := o.admin[name]
	if ov == nil {
		return
	}
	if ov.weight > 0 {
		st.weight, st.weightSource = ov.weight, weightAdmin
	}
	if ov.disabled != nil {
		st.disabled = *ov.disabled
	}
	st.draining = ov.draining
}

// has reports whether an agent holds name.
func (g *Registry) has(name string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, ok := g.byName[name]
	return ok
}
