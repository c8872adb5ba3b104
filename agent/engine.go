package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/computeflux/computeflux/transport"
)

// EngineKind names an inference server the agent recognises.
type EngineKind string

// The engines the agent recognises from their own endpoints.
const (
	EngineUnknown  EngineKind = ""                // speaks the OpenAI API, nothing more known
	EngineVLLM     EngineKind = "vllm"            // vLLM: /version, vllm:* metrics
	EngineSGLang   EngineKind = "sglang"          // SGLang: /get_server_info (or /server_info), sglang:* metrics
	EngineTGI      EngineKind = "tgi"             // Text Generation Inference: /info, tgi_* metrics
	EngineLlamaCpp EngineKind = "llamacpp"        // llama.cpp server: /props, /slots, llamacpp:* metrics
	EngineOllama   EngineKind = "ollama"          // Ollama: /api/version, /api/ps
	EngineSim      EngineKind = "computeflux-sim" // computeflux sim-engine (vLLM's metric names)
)

// EngineInfo is what the agent learned about its engine when it identified
// it. The zero value describes an unknown engine served through its OpenAI
// endpoints only.
type EngineInfo struct {
	// Kind is the engine recognised; EngineUnknown when none was.
	Kind EngineKind
	// Version is the engine's own version string, when it reports one.
	Version string
	// KVCapacityTokens is how many tokens the engine's KV cache holds, from
	// its own figures (vLLM num_gpu_blocks × block_size, SGLang
	// max_total_num_tokens, TGI max_batch_total_tokens, llama.cpp the
	// slots' n_ctx, Ollama the loaded models' context_length); 0 when
	// unknown.
	KVCapacityTokens int
	// Batch is the most requests the engine runs at once, where it says:
	// llama.cpp's total_slots, SGLang's max_running_requests, TGI's
	// max_batch_size; 0 when it does not (vLLM, Ollama), and the agent's
	// dispatch limit is measured instead.
	Batch int
	// APIs are the paths beyond chat, completions and embeddings that the
	// engine serves, among optionalAPIs, found in its OpenAPI document or
	// by asking for them.
	APIs []string
	// UnknownAPIs are the optional APIs whose support the engine's answers
	// did not show either way: the agent forwards them, and the engine's
	// first real answer moves each to APIs or drops it (learnAPI).
	UnknownAPIs []string
	// Evidence says what identified the engine, for the log.
	Evidence string

	// missing is the engine's answer to a route it does not have, from
	// identification; the zero value when not learned.
	missing probeAnswer
}

// optionalAPIs are the paths the agent forwards when the engine serves them.
var optionalAPIs = []string{"/v1/responses", "/v1/messages"}

// maxProbeBody bounds what the agent reads of one identification answer.
const maxProbeBody = 4 << 20

// maxMetricsBody bounds what the agent reads of an engine's /metrics, at
// identification and at every load scrape alike (a vLLM with many models and
// histograms can pass 4 MiB).
const maxMetricsBody = 16 << 20

// engineProber asks an engine about itself. It is used by one goroutine.
type engineProber struct {
	client *http.Client
	base   *url.URL
	auth   []string // the Authorization header's value; nil for none
	// unsettled is set when a probe got no answer or one that says "not
	// now" (transientStatus): what it would have told is not known yet.
	unsettled bool
}

// transientStatus reports whether an engine's status says "not now"
// rather than "no such thing": llama.cpp answers 503 on everything but
// /v1/models while it loads its model; 502 and 504 come from a proxy in
// front of an engine that is not up. 501 (llama.cpp's /metrics without
// --metrics) and 404 are lasting answers.
func transientStatus(code int) bool {
	return code == http.StatusServiceUnavailable || code == http.StatusBadGateway || code == http.StatusGatewayTimeout
}

// prober asks the agent's engine, with the agent's client and authorization.
func (a *Agent) prober() *engineProber {
	return &engineProber{client: a.client, base: a.upstream, auth: a.authValue}
}

// get fetches path; ok is false unless it answered 200.
func (p *engineProber) get(ctx context.Context, path string) ([]byte, bool) {
	return p.do(ctx, http.MethodGet, path, nil)
}

// do sends method path and reads the answer, up to maxProbeBody
// (maxMetricsBody for /metrics); ok says whether the answer shows the
// route: 200 for a GET, anything but 404 and 405 for a POST.
func (p *engineProber) do(ctx context.Context, method, path string, body []byte) ([]byte, bool) {
	status, b := p.ask(ctx, method, path, body)
	switch {
	case status == 0 || transientStatus(status):
		return b, false
	case method == http.MethodPost:
		// A route that exists rejects an empty request (400, 422, 500);
		// one that does not answers 404 or 405.
		return b, status != http.StatusNotFound && status != http.StatusMethodNotAllowed
	}
	return b, status == http.StatusOK
}

// ask sends method path and returns the status and the answer, read up to
// maxProbeBody (maxMetricsBody for /metrics); status 0 when no answer
// came. No answer, or a "not now" (transientStatus), leaves the prober
// unsettled.
func (p *engineProber) ask(ctx context.Context, method, path string, body []byte) (int, []byte) {
	limit := int64(maxProbeBody)
	if path == "/metrics" {
		limit = maxMetricsBody
	}
	resp, err := p.send(ctx, method, path, body)
	if err != nil {
		p.unsettled = true
		return 0, nil
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		p.unsettled = true
		return 0, nil
	}
	if transientStatus(resp.StatusCode) {
		p.unsettled = true
	}
	return resp.StatusCode, b
}

// open GETs path for the caller to read as a stream; an answer other than
// 200 is an error. The body is the caller's to close.
func (p *engineProber) open(ctx context.Context, path string) (io.ReadCloser, error) {
	resp, err := p.send(ctx, http.MethodGet, path, nil)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: status %d", path, resp.StatusCode)
	}
	return resp.Body, nil
}

// modelList is an engine's GET /v1/models answer, as far as the agent
// reads it.
type modelList struct {
	Data []struct {
		ID      string `json:"id"`
		OwnedBy string `json:"owned_by"`
	} `json:"data"`
}

// models reads the engine's GET /v1/models, up to 8 MiB.
func (p *engineProber) models(ctx context.Context) (modelList, error) {
	var list modelList
	body, err := p.open(ctx, "/v1/models")
	if err != nil {
		return list, err
	}
	defer body.Close()
	if err := json.NewDecoder(io.LimitReader(body, 8<<20)).Decode(&list); err != nil {
		return list, fmt.Errorf("GET /v1/models: %w", err)
	}
	return list, nil
}

// send is every request the agent makes of its engine outside the proxy:
// method path, with a JSON body when body is not nil, authorized as
// configured (Config.UpstreamAPIKey). The response is the caller's to close.
func (p *engineProber) send(ctx context.Context, method, path string, body []byte) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, p.base.JoinPath(path).String(), rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if p.auth != nil {
		req.Header["Authorization"] = p.auth
	}
	return p.client.Do(req)
}

// identify recognises the engine from its own endpoints: the metric family
// of /metrics first, then each engine's identity endpoint; ownedBy is the
// owned_by of its /v1/models entries. load is that /metrics read as load
// figures (load.Engine empty when it had none, or was cut at maxMetricsBody):
// the first load scrape after identification uses it instead of a second GET.
// settled is false when a probe got no answer or a "not now" (an engine
// still loading its model): the engine is worth identifying again later.
func (p *engineProber) identify(ctx context.Context, ownedBy string) (info EngineInfo, load EngineMetrics, settled bool) {
	p.unsettled = false
	var met EngineMetrics
	if b, ok := p.get(ctx, "/metrics"); ok {
		met, _ = ParseEngineMetrics(bytes.NewReader(b))
		if len(b) < maxMetricsBody {
			load = met
		}
	}
	switch {
	case ownedBy == "computeflux" && met.Engine == "vllm":
		info.Kind, info.Evidence = EngineSim, "/v1/models owned_by computeflux, vLLM metric names"
	case met.Engine == "vllm":
		info.Kind, info.Evidence = EngineVLLM, "vllm:* series in /metrics"
	case met.Engine == "sglang":
		info.Kind, info.Evidence = EngineSGLang, "sglang:* series in /metrics"
	case met.Engine == "tgi":
		info.Kind, info.Evidence = EngineTGI, "tgi_* series in /metrics"
	case met.Engine == "llamacpp":
		info.Kind, info.Evidence = EngineLlamaCpp, "llamacpp:* series in /metrics"
	}
	info.KVCapacityTokens = met.KVCapacityTokens

	// Identity endpoints: they name the engine without metrics and carry
	// its version and capacity.
	if info.Kind == EngineUnknown || info.Kind == EngineOllama {
		if b, ok := p.get(ctx, "/api/version"); ok {
			var v struct {
				Version string `json:"version"`
			}
			if json.Unmarshal(b, &v) == nil && v.Version != "" {
				info.Kind, info.Version, info.Evidence = EngineOllama, v.Version, "/api/version"
			}
		}
	}
	if info.Kind == EngineUnknown || info.Kind == EngineLlamaCpp {
		if b, ok := p.get(ctx, "/props"); ok {
			if pr, ok := ParseLlamaCppProps(b); ok {
				if info.Kind == EngineUnknown {
					info.Kind, info.Evidence = EngineLlamaCpp, "/props"
				}
				info.Version = pr.BuildInfo
				info.KVCapacityTokens = pr.NCtx * max(pr.TotalSlots, 1)
				info.Batch = pr.TotalSlots
			}
		}
		if b, ok := p.get(ctx, "/slots"); ok {
			if sl, ok := ParseLlamaCppSlots(b); ok && sl.NCtx > 0 {
				info.KVCapacityTokens = sl.NCtx
			}
		}
	}
	if info.Kind == EngineUnknown || info.Kind == EngineTGI {
		if b, ok := p.get(ctx, "/info"); ok {
			if ti, ok := ParseTGIInfo(b); ok {
				if info.Kind == EngineUnknown {
					info.Kind, info.Evidence = EngineTGI, "/info"
				}
				info.Version = ti.Version
				info.Batch = ti.MaxBatchSize
				if ti.MaxBatchTotalTokens > 0 {
					info.KVCapacityTokens = ti.MaxBatchTotalTokens
				}
			}
		}
	}
	if info.Kind == EngineUnknown || info.Kind == EngineSGLang {
		for _, path := range []string{"/get_server_info", "/server_info"} {
			b, ok := p.get(ctx, path)
			if !ok {
				continue
			}
			if si, ok := ParseSGLangServerInfo(b); ok {
				if info.Kind == EngineUnknown {
					info.Kind, info.Evidence = EngineSGLang, path
				}
				info.Version = si.Version
				info.Batch = si.MaxRunningRequests
				if si.MaxTotalNumTokens > 0 && info.KVCapacityTokens == 0 {
					info.KVCapacityTokens = si.MaxTotalNumTokens
				}
				break
			}
		}
	}
	if info.Kind == EngineVLLM || info.Kind == EngineSim {
		if b, ok := p.get(ctx, "/version"); ok {
			var v struct {
				Version string `json:"version"`
			}
			if json.Unmarshal(b, &v) == nil {
				info.Version = v.Version
			}
		}
	}
	if info.Kind == EngineOllama {
		if b, ok := p.get(ctx, "/api/ps"); ok {
			if ps, ok := ParseOllamaPS(b); ok {
				info.KVCapacityTokens = ps.ContextTokens
			}
		}
	}
	info.APIs, info.UnknownAPIs, info.missing = p.apis(ctx, info.Kind != EngineUnknown)
	return info, load, !p.unsettled
}

// apis finds which optional APIs the engine serves (served), and those
// whose support its answers did not show (unknown: the first real request
// settles them, see learnAPI): from its OpenAPI document when it has one
// (vLLM and SGLang are FastAPI servers, TGI publishes
// /api-doc/openapi.json, and so do many OpenAI-compatible servers), else
// by asking each path, and a path no engine serves to compare with
// (noSuchAPI). A recognised engine (llama.cpp, Ollama, a vLLM started with
// --disable-fastapi-docs) is sent an empty request, which no engine
// generates for: routeShown reads the answer. An engine not recognised is
// asked as apisByRejection says. missing is the answer the engine gives a
// route it does not have, to read real answers by (classifyAnswer).
func (p *engineProber) apis(ctx context.Context, recognised bool) (served, unknown []string, missing probeAnswer) {
	for _, doc := range []string{"/openapi.json", "/api-doc/openapi.json"} {
		b, ok := p.get(ctx, doc)
		if !ok {
			continue
		}
		if paths, ok := ParseOpenAPIPaths(b); ok {
			for _, a := range optionalAPIs {
				if slices.Contains(paths, a) {
					served = append(served, a)
				}
			}
			return served, nil, probeAnswer{}
		}
	}
	if !recognised {
		return p.apisByRejection(ctx)
	}
	missing = p.probe(ctx, noSuchAPI, []byte("{}"))
	for _, a := range optionalAPIs {
		switch routeShown(p.probe(ctx, a, []byte("{}")), missing) {
		case routeServed:
			served = append(served, a)
		case routeUnknown:
			unknown = append(unknown, a)
		}
	}
	return served, unknown, missing
}

// probeAnswer is an engine's answer to a probe: its status (0 for none)
// and its body with the path asked replaced by pathMark, so that the
// answers of two missing routes compare equal ("no route POST /v1/x").
type probeAnswer struct {
	status int
	body   string
}

// pathMark stands for the probed path in a probeAnswer's body.
const pathMark = "\x00path\x00"

// maxAnswerBody bounds what is kept of a probe's answer.
const maxAnswerBody = 4 << 10

// probe POSTs body to path and returns the answer.
func (p *engineProber) probe(ctx context.Context, path string, body []byte) probeAnswer {
	status, b := p.ask(ctx, http.MethodPost, path, body)
	if transientStatus(status) {
		status = 0
	}
	return answerOf(path, status, b)
}

// answerOf is the probeAnswer of an answer to path.
func answerOf(path string, status int, b []byte) probeAnswer {
	b = b[:min(len(b), maxAnswerBody)]
	return probeAnswer{status: status, body: strings.ReplaceAll(string(bytes.TrimSpace(b)), path, pathMark)}
}

// What an answer shows of a route.
type routeVerdict int

const (
	routeUnknown routeVerdict = iota // the answer does not tell
	routeServed                      // the engine routes the path
	routeMissing                     // it has no such route
)

// routeShown reads an engine's answer a to an empty request ({}) for a
// path, with missing its answer for a path no engine serves. A route that
// exists rejects the request (400, 422, 500) or, as vLLM does for a
// request that names no model it serves, answers 404 with a body about the
// model; one that does not answers 404 or 405 the way it answers for any
// unknown path. A 404 that is neither tells nothing.
func routeShown(a, missing probeAnswer) routeVerdict {
	switch {
	case a.status == 0:
		return routeUnknown
	case a.status != http.StatusNotFound && a.status != http.StatusMethodNotAllowed:
		return routeServed
	case a == missing:
		return routeMissing
	case mentionsModel(a.body):
		return routeServed
	case missing.status == 0 || missing.status != a.status:
		return routeUnknown
	}
	// Both 404 (or 405), unlike bodies, no word of a model: an engine
	// whose not-found page is not the same for every path (a request id
	// in it, say). The real answer will tell.
	return routeUnknown
}

// mentionsModel reports whether an error body speaks of a model: vLLM's
// "The model “ does not exist.", a "model_not_found" code.
func mentionsModel(body string) bool {
	return strings.Contains(strings.ToLower(body), "model")
}

// notJSON is the body an engine not recognised is probed with: it is not
// JSON, so no server can take it for a request, whatever defaults it fills
// in for a missing model or input, and no token is ever generated for it.
var notJSON = []byte(`{"model":`)

// noSuchAPI is a path no engine serves, asked to tell an engine that
// reads bodies before it routes (every path a 400) from one that has the
// routes asked about, and to learn what the engine answers for a route it
// lacks.
const noSuchAPI = "/v1/computeflux-no-such-api"

// apisByRejection finds the optional APIs of an engine not recognised by
// sending each path a body that is not JSON: a route that exists rejects
// it as a bad request (400 or 422); one that does not answers 404 or 405,
// or what the engine answers a path no engine serves (LM Studio: 200 with
// an error). If that path is rejected as a bad request too, the engine
// checks bodies before routes and its answers show nothing: every path is
// unknown, for the first real request to settle.
func (p *engineProber) apisByRejection(ctx context.Context) (served, unknown []string, missing probeAnswer) {
	rejects := func(a probeAnswer) bool {
		return a.status == http.StatusBadRequest || a.status == http.StatusUnprocessableEntity
	}
	missing = p.probe(ctx, noSuchAPI, notJSON)
	for _, path := range optionalAPIs {
		a := p.probe(ctx, path, notJSON)
		switch {
		case rejects(missing) || a.status == 0:
			unknown = append(unknown, path)
		case rejects(a):
			served = append(served, path)
		case a == missing, a.status == http.StatusNotFound, a.status == http.StatusMethodNotAllowed:
		default:
			unknown = append(unknown, path)
		}
	}
	if rejects(missing) {
		missing = probeAnswer{}
	}
	return served, unknown, missing
}

// classifyAnswer reads the engine's answer (status, the first bytes of
// its body) to a real request for path, an optional API whose support was
// unknown: a success or a rejection of the request shows the route; a 404
// or 405 that is the engine's answer for a missing route (missing, from
// identification), or one that does not speak of a model, shows none.
func classifyAnswer(path string, status int, body []byte, missing probeAnswer) routeVerdict {
	switch {
	case status == 0 || transientStatus(status) || status == http.StatusTooManyRequests:
		return routeUnknown
	case status != http.StatusNotFound && status != http.StatusMethodNotAllowed:
		return routeServed
	}
	a := answerOf(path, status, body)
	if missing.status != 0 && a == missing {
		return routeMissing
	}
	if mentionsModel(a.body) {
		return routeUnknown // the route may be there, the model not (yet)
	}
	return routeMissing
}

// ParseOpenAPIPaths returns the paths of an OpenAPI document.
func ParseOpenAPIPaths(b []byte) ([]string, bool) {
	var doc struct {
		Paths map[string]json.RawMessage `json:"paths"`
	}
	if json.Unmarshal(b, &doc) != nil || doc.Paths == nil {
		return nil, false
	}
	paths := make([]string, 0, len(doc.Paths))
	for p := range doc.Paths {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	return paths, true
}

// LlamaCppProps is what the agent reads of llama.cpp's GET /props.
type LlamaCppProps struct {
	NCtx       int    // default_generation_settings.n_ctx: one slot's context
	TotalSlots int    // total_slots
	BuildInfo  string // build_info, e.g. "b6402-..."
}

// ParseLlamaCppProps reads llama.cpp's /props; false unless it has the
// fields only llama.cpp's server sends together.
func ParseLlamaCppProps(b []byte) (LlamaCppProps, bool) {
	var v struct {
		Settings *struct {
			NCtx int `json:"n_ctx"`
		} `json:"default_generation_settings"`
		TotalSlots *int   `json:"total_slots"`
		BuildInfo  string `json:"build_info"`
	}
	if json.Unmarshal(b, &v) != nil || v.Settings == nil || v.TotalSlots == nil {
		return LlamaCppProps{}, false
	}
	return LlamaCppProps{NCtx: max(v.Settings.NCtx, 0), TotalSlots: max(*v.TotalSlots, 0), BuildInfo: v.BuildInfo}, true
}

// LlamaCppSlots sums llama.cpp's GET /slots.
type LlamaCppSlots struct {
	Slots      int // slots
	Processing int // slots with is_processing
	NCtx       int // sum of the slots' n_ctx: the KV capacity in tokens
}

// ParseLlamaCppSlots reads llama.cpp's /slots (an array of slot objects).
func ParseLlamaCppSlots(b []byte) (LlamaCppSlots, bool) {
	var v []struct {
		ID           *int `json:"id"`
		NCtx         int  `json:"n_ctx"`
		IsProcessing bool `json:"is_processing"`
	}
	if json.Unmarshal(b, &v) != nil || len(v) == 0 {
		return LlamaCppSlots{}, false
	}
	var s LlamaCppSlots
	for _, sl := range v {
		if sl.ID == nil {
			return LlamaCppSlots{}, false
		}
		s.Slots++
		s.NCtx += max(sl.NCtx, 0)
		if sl.IsProcessing {
			s.Processing++
		}
	}
	return s, true
}

// TGIInfo is what the agent reads of TGI's GET /info.
type TGIInfo struct {
	ModelID             string
	Version             string
	MaxBatchTotalTokens int // max_batch_total_tokens: tokens the batch (KV cache) holds
	MaxBatchSize        int // max_batch_size: requests in a batch; 0 when unset (null)
}

// ParseTGIInfo reads TGI's /info; false unless it names a model and the
// text-generation router.
func ParseTGIInfo(b []byte) (TGIInfo, bool) {
	var v struct {
		ModelID             string `json:"model_id"`
		Router              string `json:"router"`
		Version             string `json:"version"`
		MaxBatchTotalTokens int    `json:"max_batch_total_tokens"`
		MaxBatchSize        *int   `json:"max_batch_size"`
	}
	if json.Unmarshal(b, &v) != nil || v.ModelID == "" || !strings.Contains(v.Router, "text-generation") {
		return TGIInfo{}, false
	}
	ti := TGIInfo{ModelID: v.ModelID, Version: v.Version, MaxBatchTotalTokens: max(v.MaxBatchTotalTokens, 0)}
	if v.MaxBatchSize != nil {
		ti.MaxBatchSize = max(*v.MaxBatchSize, 0)
	}
	return ti, true
}

// SGLangServerInfo is what the agent reads of SGLang's GET /get_server_info.
type SGLangServerInfo struct {
	Version           string
	MaxTotalNumTokens int // the KV pool's capacity in tokens
	// MaxRunningRequests is the server argument max_running_requests; 0
	// when unset (SGLang then derives it from the KV pool).
	MaxRunningRequests int
}

// ParseSGLangServerInfo reads SGLang's server info: its server arguments
// (model_path, tp_size, ...) with the version and, in internal_states (or
// at the top level in older releases), max_total_num_tokens.
func ParseSGLangServerInfo(b []byte) (SGLangServerInfo, bool) {
	var v struct {
		ModelPath         string `json:"model_path"`
		TPSize            *int   `json:"tp_size"`
		Version           string `json:"version"`
		MaxTotalNumTokens int    `json:"max_total_num_tokens"`
		MaxRunning        *int   `json:"max_running_requests"`
		InternalStates    []struct {
			MaxTotalNumTokens int `json:"max_total_num_tokens"`
		} `json:"internal_states"`
	}
	if json.Unmarshal(b, &v) != nil || v.ModelPath == "" || v.TPSize == nil {
		return SGLangServerInfo{}, false
	}
	si := SGLangServerInfo{Version: v.Version, MaxTotalNumTokens: max(v.MaxTotalNumTokens, 0)}
	if v.MaxRunning != nil {
		si.MaxRunningRequests = max(*v.MaxRunning, 0)
	}
	for _, st := range v.InternalStates {
		si.MaxTotalNumTokens = max(si.MaxTotalNumTokens, st.MaxTotalNumTokens)
	}
	return si, true
}

// OllamaPS sums Ollama's GET /api/ps: the models loaded in memory.
type OllamaPS struct {
	Models        []string
	ContextTokens int // sum of the loaded models' context_length
}

// ParseOllamaPS reads Ollama's /api/ps.
func ParseOllamaPS(b []byte) (OllamaPS, bool) {
	var v struct {
		Models *[]struct {
			Name          string `json:"name"`
			ContextLength int    `json:"context_length"`
		} `json:"models"`
	}
	if json.Unmarshal(b, &v) != nil || v.Models == nil {
		return OllamaPS{}, false
	}
	var ps OllamaPS
	for _, m := range *v.Models {
		ps.Models = append(ps.Models, m.Name)
		ps.ContextTokens += max(m.ContextLength, 0)
	}
	return ps, true
}

// equal reports whether e and o say the same of an engine.
func (e EngineInfo) equal(o EngineInfo) bool {
	return e.Kind == o.Kind && e.Version == o.Version && e.KVCapacityTokens == o.KVCapacityTokens &&
		e.Evidence == o.Evidence && slices.Equal(e.APIs, o.APIs) && slices.Equal(e.UnknownAPIs, o.UnknownAPIs)
}

// orKnown returns e, an identification cut short (a probe unanswered, or
// answered "not now"), completed with what prev, an earlier identification
// of the same engine, found where e found nothing: a probe that got no
// answer this time says nothing new. Without it an engine identified once
// and asked again while it reloads its model (503 on everything but
// /v1/models) was unlearned, kind, version and APIs, until the next ask.
func (e EngineInfo) orKnown(prev EngineInfo) EngineInfo {
	if e.Kind == EngineUnknown {
		return prev
	}
	if e.Kind != prev.Kind {
		return e
	}
	if e.Version == "" {
		e.Version = prev.Version
	}
	if e.KVCapacityTokens == 0 {
		e.KVCapacityTokens = prev.KVCapacityTokens
	}
	if e.Batch == 0 {
		e.Batch = prev.Batch
	}
	if len(e.APIs) == 0 && len(e.UnknownAPIs) == 0 {
		e.APIs, e.UnknownAPIs, e.missing = prev.APIs, prev.UnknownAPIs, prev.missing
	}
	return e
}

// describe is the one log line's summary of what was found.
func (e EngineInfo) describe() string {
	if e.Kind == EngineUnknown {
		return "unknown engine: served through its OpenAI endpoints (models only, no load figures)"
	}
	s := string(e.Kind)
	if e.Version != "" {
		s += " " + e.Version
	}
	if e.KVCapacityTokens > 0 {
		s += ", KV cache " + strconv.Itoa(e.KVCapacityTokens) + " tokens"
	}
	return fmt.Sprintf("%s (from %s)", s, e.Evidence)
}

// scrapeLoad reads the engine's load: its Prometheus /metrics, or what the
// engine offers instead (llama.cpp's /slots when it runs without --metrics,
// Ollama's /api/ps, which has its loaded models but no queue figures).
// eng is the identification just made when fresh; otherwise the stored one
// is used.
func (a *Agent) scrapeLoad(ctx context.Context, eng EngineInfo, fresh bool) (EngineMetrics, error) {
	if !fresh {
		a.mu.Lock()
		eng = a.engine
		a.mu.Unlock()
	}
	p := a.prober()
	switch eng.Kind {
	case EngineOllama:
		ctx, cancel := context.WithTimeout(ctx, a.cfg.UpstreamTimeout)
		defer cancel()
		b, ok := p.get(ctx, "/api/ps")
		if !ok {
			return EngineMetrics{}, fmt.Errorf("GET /api/ps failed")
		}
		ps, ok := ParseOllamaPS(b)
		if !ok {
			return EngineMetrics{}, fmt.Errorf("GET /api/ps: not Ollama's answer")
		}
		return EngineMetrics{Engine: string(EngineOllama), KVCapacityTokens: ps.ContextTokens}, nil
	case EngineLlamaCpp:
		m, err := a.scrapeMetrics(ctx)
		if err == nil && m.Engine != "" {
			return m, nil
		}
		ctx, cancel := context.WithTimeout(ctx, a.cfg.UpstreamTimeout)
		defer cancel()
		b, ok := p.get(ctx, "/slots")
		if !ok {
			return EngineMetrics{}, fmt.Errorf("llama.cpp: neither /metrics (start it with --metrics) nor /slots answered")
		}
		sl, ok := ParseLlamaCppSlots(b)
		if !ok {
			return EngineMetrics{}, fmt.Errorf("GET /slots: not llama.cpp's answer")
		}
		return EngineMetrics{Engine: string(EngineLlamaCpp), Running: sl.Processing, KVCapacityTokens: sl.NCtx}, nil
	}
	return a.scrapeMetrics(ctx)
}

// optionalRoute returns the method path takes when it belongs to an
// optional API the engine serves, or may serve (unknown: its support is
// still to be learned from the answer): POST for the API itself; for a
// stored response (/v1/responses/{id}) GET or DELETE, as asked; POST for
// its /cancel and GET for its /input_items.
func (a *Agent) optionalRoute(path, method string) (m string, unknown, ok bool) {
	a.mu.Lock()
	apis, maybe := a.engine.APIs, a.engine.UnknownAPIs
	a.mu.Unlock()
	if slices.Contains(apis, path) {
		return http.MethodPost, false, true
	}
	if slices.Contains(maybe, path) {
		return http.MethodPost, true, true
	}
	rest, ok := strings.CutPrefix(path, "/v1/responses/")
	if !ok || !slices.Contains(apis, "/v1/responses") {
		return "", false, false
	}
	id, sub, _ := strings.Cut(rest, "/")
	if id == "" || strings.ContainsAny(id, "./") {
		return "", false, false
	}
	switch sub {
	case "":
		if method == http.MethodDelete {
			return http.MethodDelete, false, true
		}
		return http.MethodGet, false, true
	case "cancel":
		return http.MethodPost, false, true
	case "input_items":
		return http.MethodGet, false, true
	}
	return "", false, false
}

// settleAPI learns from res, the engine's answer to a request for path
// (an optional API whose support was unknown), whether the engine serves
// it. A missing route is marked on the answer (transport.HeaderAPIMissing)
// for the relay, which tries elsewhere. The answer's first bytes read to
// tell are put back in front of its body.
func (a *Agent) settleAPI(w http.ResponseWriter, path string, res *http.Response) {
	var head []byte
	if res.StatusCode == http.StatusNotFound || res.StatusCode == http.StatusMethodNotAllowed {
		head, _ = io.ReadAll(io.LimitReader(res.Body, maxAnswerBody))
		res.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(head), res.Body), res.Body}
	}
	a.mu.Lock()
	missing := a.engine.missing
	a.mu.Unlock()
	v := classifyAnswer(path, res.StatusCode, head, missing)
	if v == routeUnknown {
		return
	}
	if v == routeMissing {
		w.Header().Set(transport.HeaderAPIMissing, path)
	}
	a.learnAPI(path, v == routeServed)
}

// learnAPI settles an optional API whose support was unknown: it moves to
// the engine's APIs (served) or goes, and the relays hear of it.
func (a *Agent) learnAPI(path string, served bool) {
	a.mu.Lock()
	i := slices.Index(a.engine.UnknownAPIs, path)
	if i < 0 {
		a.mu.Unlock()
		return // settled already, by another request
	}
	a.engine.UnknownAPIs = slices.Delete(slices.Clone(a.engine.UnknownAPIs), i, i+1)
	if served {
		apis := append(slices.Clone(a.engine.APIs), path)
		slices.SortFunc(apis, func(x, y string) int { return slices.Index(optionalAPIs, x) - slices.Index(optionalAPIs, y) })
		a.engine.APIs = apis
	}
	a.mu.Unlock()
	a.log.Info().Str("api", path).Bool("served", served).Msg("learned from the engine's first answer whether it serves an optional API")
	a.notify()
}
