package agent

import (
	"context"
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
	p := &engineProber{client: a.client, base: a.upstream, authorize: a.authorize}
	b, ok := p.get(ctx, "/props")
	if !ok {
		return 0, errNoKVCapacity
	}
	pr, ok := ParseLlamaCppProps(b)
	if !ok || pr.TotalSlots <= 0 || pr.NCtx <= 0 {
		return 0, errNoKVCapacity
	}
	return clampInt(float64(pr.TotalSlots) * float64(pr.NCtx)), nil
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
