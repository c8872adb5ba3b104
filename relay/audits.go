package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"sync"

	"github.com/computeflux/computeflux/relay/auditor"
	"github.com/computeflux/computeflux/relay/liveness"
	"github.com/computeflux/computeflux/scheduler"
	"github.com/computeflux/computeflux/transport"
)

// The relay's side of the audits (package auditor runs them): what the
// auditor sees of the fleet, and how its requests go out, as client
// requests do.

// AuditConfig configures the audits; see auditor.Settings. The zero value
// audits at the defaults.
type AuditConfig = auditor.Settings

// newAuditor builds the auditor from what it needs of r.
func newAuditor(r *Relay) *auditor.Auditor {
	cfg := auditor.Config{
		Settings:      r.cfg.Audit,
		Clock:         r.cfg.Clock,
		Logger:        r.log,
		Metrics:       r.metrics.reg,
		Fleet:         r.auditFleet,
		Send:          r.sendAudit,
		SetWeight:     r.sched.SetModelWeight,
		Seed:          seedBytes,
		Pseudonym:     r.pseudo.of,
		EngineHeaders: engineHeaders,
		Loads:         r.auditLoads,
	}
	return auditor.New(cfg)
}

// engineHeaders returns the headers of a client's request that its engine
// gets (canonical keys, as copyRequestHeaders reads them), the session's
// excepted.
func engineHeaders(h http.Header) http.Header {
	out := make(http.Header, len(forwardedHeaders))
	for _, fh := range forwardedHeaders {
		if v := h[fh.canon]; len(v) > 0 && fh.canon != headerSessionCanon {
			out[fh.canon] = append([]string(nil), v...)
		}
	}
	return out
}

// auditRefs holds the operator's references (the endpoints file), by
// name.
type auditRefs struct {
	mu    sync.Mutex
	names map[string]bool
}

func (a *auditRefs) set(names []string) {
	m := make(map[string]bool, len(names))
	for _, n := range names {
		m[n] = true
	}
	a.mu.Lock()
	a.names = m
	a.mu.Unlock()
}

func (a *auditRefs) get() map[string]bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.names
}

// auditFleet returns the agents and provider endpoints routable now, as
// the auditor sees them: joined agents neither dead nor draining, with the
// address of their connection, and the provider endpoints serving models.
func (r *Relay) auditFleet() []auditor.Member {
	refs := r.auditRefs.get()
	var out []auditor.Member
	for _, ag := range r.reg.Agents() {
		if ag.Dead || ag.Draining || ag.Health.Draining {
			continue
		}
		out = append(out, auditor.Member{Name: ag.Name, Models: ag.Models, Kind: ag.Engine,
			Addr: r.agentAddr(ag), Trusted: refs[ag.Name]})
	}
	for _, p := range r.providers.table.Load().list {
		if len(p.models) == 0 || p.spec.Disabled {
			continue
		}
		out = append(out, auditor.Member{Name: p.spec.Name, Models: p.models, Kind: p.spec.Engine,
			Provider: true, Trusted: refs[p.spec.Name]})
	}
	return out
}

// agentAddr returns the IP address of ag's connection to the relay, or
// the zero Addr; Config.auditAddr, in tests, stands in for it.
func (r *Relay) agentAddr(ag AgentInfo) netip.Addr {
	if r.cfg.auditAddr != nil {
		return r.cfg.auditAddr(ag.Name)
	}
	if r.host == nil {
		return netip.Addr{}
	}
	for _, c := range r.host.Network().ConnsToPeer(ag.Peer) {
		if ip := transport.RemoteIP(c.RemoteMultiaddr()); ip.IsValid() {
			return ip
		}
	}
	return netip.Addr{}
}

// auditLoads returns every agent's published load beside this relay's
// requests in flight on it; nil without gossip.
func (r *Relay) auditLoads() []auditor.Load {
	if r.gossip == nil {
		return nil
	}
	var out []auditor.Load
	for _, st := range r.sched.Snapshot() {
		if r.providers.get(st.ID) != nil || st.InFlight == 0 {
			continue
		}
		out = append(out, auditor.Load{Agent: st.ID, Models: st.Models, Published: st.Health.Running + st.Health.Waiting, InFlight: st.InFlight})
	}
	return out
}

// auditFlowID is the fair queue's flow of audit requests: their cost is
// the audits', not the client's whose flow their header names.
const auditFlowID = "\x00audit"

// sendAudit sends an audit request the way a client's request to that
// endpoint goes: it takes a slot on the endpoint (waiting in the fair
// queue, like the client's request whose flow it names), runs under the
// liveness flight of an agent's attempt, with the headers an attempt
// sets. The slot is given back, and the outcome reported to the
// scheduler, when the answer's body is closed.
func (r *Relay) sendAudit(ctx context.Context, req auditor.Request) (*http.Response, error) {
	att := r.sched.Begin(scheduler.Request{Model: req.Model, Audit: true, Wait: r.queue != nil,
		Allow: func(id string) bool { return id == req.Endpoint }})
	fl := flowOf{id: req.Client, weight: 1, cost: float64(req.Cost)}
	if c := r.clients.byName(req.Client); c != nil {
		fl.weight, fl.band = c.Weight, c.Class
	}
	qfl := fl
	qfl.id = auditFlowID
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, pathChat, nil)
	if err != nil {
		return nil, err
	}
	var c scheduler.Choice
	if r.queue != nil {
		c, err = r.queue.pick(hreq, att, qfl)
	} else {
		c, err = att.Pick()
	}
	if err != nil {
		return nil, err
	}
	done := func(o scheduler.Outcome) {
		att.Report(c, o)
		if r.queue != nil {
			r.queue.finished(qfl)
		}
	}
	tgt, ok := r.target(c, pathChat)
	if !ok {
		done(scheduler.Outcome{Err: ErrAgentGone})
		return nil, ErrAgentGone
	}
	actx, cancel := context.WithCancelCause(ctx)
	upCtx := actx
	var fli *liveness.Flight
	if tgt.peer != "" && r.live != nil {
		fli, upCtx = r.live.Begin(actx, cancel, tgt.peer, c.EndpointID)
	}
	end := func(o scheduler.Outcome) {
		if fli != nil {
			fli.End()
		}
		cancel(nil)
		done(o)
	}
	up, err := http.NewRequestWithContext(upCtx, http.MethodPost, "", bytes.NewReader(req.Body))
	if err != nil {
		end(scheduler.Outcome{Err: err})
		return nil, err
	}
	*up.URL = tgt.u
	up.Host = tgt.u.Host
	up.ContentLength = int64(len(req.Body))
	copyRequestHeaders(up.Header, req.Header)
	tgt.authorize(up.Header)
	if tgt.peer != "" {
		if fl.id != "" {
			up.Header[transport.HeaderFlow] = []string{fl.header()}
		}
		if isStream(req.Body) {
			up.Header[transport.HeaderUsage] = usageKeep
		}
	}
	start := r.cfg.Clock.Now()
	resp, err := tgt.rt.RoundTrip(up)
	if err != nil {
		end(scheduler.Outcome{Err: err, Latency: r.cfg.Clock.Now().Sub(start)})
		return nil, err
	}
	if fli != nil {
		fli.Acked()
	}
	o := scheduler.Outcome{Status: resp.StatusCode, Latency: r.cfg.Clock.Now().Sub(start),
		RetryAfter: parseRetryAfter(resp.Header.Get("Retry-After"), start)}
	resp.Body = &reportingBody{ReadCloser: resp.Body, done: func() { end(o) }}
	return resp, nil
}

// reportingBody calls done once, when the body is closed.
type reportingBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *reportingBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(b.done)
	return err
}

// isStream reports whether a chat request body asks for a stream.
func isStream(body []byte) bool {
	var f struct {
		Stream bool `json:"stream"`
	}
	return json.Unmarshal(body, &f) == nil && f.Stream
}

// serveAuditAction serves POST /admin/v1/audits/{action}: quarantine or
// release an agent for a model by hand.
func (r *Relay) serveAuditAction(w http.ResponseWriter, req *http.Request) {
	if r.audits == nil {
		writeError(w, errBadRequest("audits_disabled", "Audits are disabled on this relay.", nil))
		return
	}
	var act struct {
		Agent  string `json:"agent"`
		Model  string `json:"model"`
		Reason string `json:"reason"`
	}
	if err := json.NewDecoder(io.LimitReader(req.Body, 64<<10)).Decode(&act); err != nil {
		writeError(w, errBadRequest("invalid_json", `The body must be JSON: {"agent": NAME, "model": MODEL, "reason": TEXT}.`, err))
		return
	}
	if act.Agent == "" || act.Model == "" || len(act.Agent) > maxNameLen || len(act.Model) > 256 || len(act.Reason) > 1024 {
		writeError(w, errBadRequest("invalid_value", "agent and model are required (reason is optional, at most 1024 bytes).", nil))
		return
	}
	switch req.PathValue("action") {
	case "quarantine":
		if act.Reason == "" {
			act.Reason = "no reason given"
		}
		r.audits.Quarantine(act.Agent, act.Model, act.Reason)
	case "release":
		if !r.audits.Release(act.Agent, act.Model) {
			writeError(w, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "not_quarantined",
				Message: fmt.Sprintf("%s is not quarantined for %s.", act.Agent, act.Model)})
			return
		}
	default:
		writeError(w, errNotFound(req.URL.Path))
		return
	}
	r.log.Info().Str("agent", act.Agent).Str("model", act.Model).Str("action", req.PathValue("action")).Str("reason", act.Reason).Msg("admin audit action")
	st, _ := r.audits.Standing(act.Agent, act.Model)
	writeJSON(w, http.StatusOK, st)
}
