package agent

import (
	"context"
	"errors"
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
	b, ok := a.prober().get(ctx, "/props")
	if !ok {
		return 0, errNoKVCapacity
	}
	pr, ok := ParseLlamaCppProps(b)
	if !ok || pr.TotalSlots <= 0 || pr.NCtx <= 0 {
		return 0, errNoKVCapacity
	}
	return clampInt(float64(pr.TotalSlots) * float64(pr.NCtx)), nil
}

// prober asks the agent's engine, with the agent's client and authorization.
func (a *Agent) prober() *engineProber {
	return &engineProber{client: a.client, base: a.upstream, authorize: a.authorize}
}
