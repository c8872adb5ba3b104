package relay

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Response headers that tell a client how its request was routed.
const (
	HeaderAgent    = "X-ComputeFlux-Agent"    // name of the agent that served
	HeaderAffinity = "X-ComputeFlux-Affinity" // hit, miss or none
	HeaderSession  = "X-Session-ID"           // the client's session key
)

// errAbort asks serveHTTP to abort the response (after logging), so that a
// client of a truncated non-streamed body sees a broken response rather than
// a short one that looks whole.
var errAbort = errors.New("response aborted")

// errClientGone marks a request whose client went away.
var errClientGone = errors.New("client went away")

// statusClientClosed is logged and counted for requests whose client left
// before the response ended (nginx's convention).
const statusClientClosed = 499

// reqLog collects what the per-request log line and metrics report.
type reqLog struct {
	method   string // set when not POST
	path     string
	model    string
	stream   bool
	session  bool
	agent    string
	affinity string
	attempts int
	status   int
	ttfb     time.Duration
	err      error
	client   *Client // the key's client; nil without auth
	flow     flowOf  // who the request is for, in the queue's terms
	// For the usage ledger (usage.go): what the answer said about its
	// tokens, whether the endpoint answered with success, a guess at its
	// completion tokens for when it said nothing, and how long the
	// endpoint took from the request to the answer's end.
	usage    tokenUsage
	answered bool
	guess    int64
	serving  time.Duration
}

// serveHTTP dispatches by path and method; every error response goes through
// writeError.
func (r *Relay) serveHTTP(w http.ResponseWriter, req *http.Request) {
	switch req.URL.Path {
	case "/v1/chat/completions", "/v1/completions", "/v1/embeddings", pathResponses, pathMessages:
		if req.Method != http.MethodPost {
			writeErrorFor(req.URL.Path, w, errMethod(req.Method, "POST"))
			return
		}
		r.serveProxied(w, req, "", req.URL.Path, "") // proxy.go
	case "/v1/models":
		if !r.get(w, req) || !r.auth(w, req) {
			return
		}
		r.serveModels(w)
	case "/healthz":
		if r.get(w, req) {
			r.serveHealth(w)
		}
	case "/metrics":
		if r.get(w, req) && r.authMetrics(w, req) {
			promhttp.HandlerFor(r.metrics.reg, promhttp.HandlerOpts{}).ServeHTTP(w, req)
		}
	default:
		if id, ok := strings.CutPrefix(req.URL.Path, "/v1/models/"); ok && id != "" {
			if !r.get(w, req) || !r.auth(w, req) {
				return
			}
			r.serveModel(w, id)
			return
		}
		if rest, ok := strings.CutPrefix(req.URL.Path, pathResponses+"/"); ok && rest != "" {
			r.serveStoredResponse(w, req, rest) // responses.go
			return
		}
		writeError(w, errNotFound(req.URL.Path))
	}
}

// get answers 405 unless req is a GET or HEAD.
func (r *Relay) get(w http.ResponseWriter, req *http.Request) bool {
	if req.Method == http.MethodGet || req.Method == http.MethodHead {
		return true
	}
	writeError(w, errMethod(req.Method, "GET, HEAD"))
	return false
}

// auth answers 401 unless req carries a known key (or auth is off).
func (r *Relay) auth(w http.ResponseWriter, req *http.Request) bool {
	if r.cfg.NoAuth || r.clients.lookup(keyID(req, false)) != nil {
		return true
	}
	writeError(w, errUnauthorized())
	return false
}

// authMetrics answers 401 unless /metrics is public (no MetricsKey) or
// req carries the metrics key. Client API keys do not open it.
func (r *Relay) authMetrics(w http.ResponseWriter, req *http.Request) bool {
	if r.cfg.MetricsKey == "" {
		return true
	}
	want := sha256.Sum256([]byte(r.cfg.MetricsKey))
	got := keyID(req, false)
	if subtle.ConstantTimeCompare(want[:], got[:]) == 1 {
		return true
	}
	writeError(w, errUnauthorized())
	return false
}

// modelObject is one entry of OpenAI's model list.
type modelObject struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

func (r *Relay) serveModels(w http.ResponseWriter) {
	models := r.sched.Models()
	list := struct {
		Object string        `json:"object"`
		Data   []modelObject `json:"data"`
	}{Object: "list", Data: make([]modelObject, 0, len(models))}
	for _, m := range models {
		list.Data = append(list.Data, modelObject{ID: m, Object: "model", OwnedBy: "computeflux"})
	}
	writeJSON(w, http.StatusOK, list)
}

func (r *Relay) serveModel(w http.ResponseWriter, id string) {
	for _, m := range r.sched.Models() {
		if m == id {
			writeJSON(w, http.StatusOK, modelObject{ID: m, Object: "model", OwnedBy: "computeflux"})
			return
		}
	}
	writeError(w, errModelNotFound(id, nil))
}

func (r *Relay) serveHealth(w http.ResponseWriter) {
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "agents_routable": r.reg.routable()})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}
