package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// errNoKVCapacity means the engine publishes no KV-cache capacity the agent
// can read.
var errNoKVCapacity = errors.New("the engine reports no KV-cache capacity")

// engineKVCapacity returns how many tokens the engine's KV cache holds: what
// its identification and load figures found (engine.go: vLLM's
// vllm:cache_config_info and SGLang's pool in /metrics, TGI, llama.cpp,
// Ollama), else llama.cpp's /props (total_slots x the per-slot context).
// /metrics is not read again here: the load scrape just parsed it.
func (a *Agent) engineKVCapacity(ctx context.Context) (int, error) {
	if n := a.KVCapacityTokens(); n > 0 {
		return n, nil
	}
	ctx, cancel := context.WithTimeout(ctx, a.cfg.UpstreamTimeout)
	defer cancel()
	body, err := a.engineGet(ctx, "/props")
	if err != nil {
		return 0, errNoKVCapacity
	}
	defer body.Close()
	var props struct {
		TotalSlots int `json:"total_slots"`
		Settings   struct {
			NCtx int `json:"n_ctx"`
		} `json:"default_generation_settings"`
	}
	if err := json.NewDecoder(io.LimitReader(body, 1<<20)).Decode(&props); err != nil ||
		props.TotalSlots <= 0 || props.Settings.NCtx <= 0 {
		return 0, errNoKVCapacity
	}
	return clampInt(float64(props.TotalSlots) * float64(props.Settings.NCtx)), nil
}

// engineGet GETs path from the engine; the body is the caller's to close.
func (a *Agent) engineGet(ctx context.Context, path string) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.upstream.JoinPath(path).String(), nil)
	if err != nil {
		return nil, err
	}
	a.authorize(req.Header)
	resp, err := a.client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: status %d", path, resp.StatusCode)
	}
	return resp.Body, nil
}
