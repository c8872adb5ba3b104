package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// errNoKVCapacity means the engine publishes no KV-cache capacity the agent
// can read.
var errNoKVCapacity = errors.New("the engine reports no KV-cache capacity")

// engineKVCapacity asks the engine how many tokens its KV cache holds: the
// /metrics series of vLLM (vllm:cache_config_info, num_gpu_blocks x
// block_size; the simulated engine publishes it too), else llama.cpp's
// /props (total_slots x the per-slot context). It is the one place that
// knows engines' capacity figures; add others here.
func (a *Agent) engineKVCapacity(ctx context.Context) (int, error) {
	// What the engine's identification and load figures found (engine.go:
	// vLLM, SGLang, TGI, llama.cpp, Ollama) comes first.
	if n := a.KVCapacityTokens(); n > 0 {
		return n, nil
	}
	ctx, cancel := context.WithTimeout(ctx, a.cfg.UpstreamTimeout)
	defer cancel()
	if body, err := a.engineGet(ctx, "/metrics"); err == nil {
		n, ok := parseKVCapacity(body)
		body.Close()
		if ok {
			return n, nil
		}
	}
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

// parseKVCapacity finds vllm:cache_config_info in a Prometheus exposition
// and returns num_gpu_blocks x block_size, in tokens.
func parseKVCapacity(r io.Reader) (int, bool) {
	sc := bufio.NewScanner(io.LimitReader(r, 16<<20))
	sc.Buffer(make([]byte, 0, 4096), maxMetricLine)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, "vllm:cache_config_info{")
		if !ok {
			continue
		}
		end := labelsEnd("{" + rest)
		if end < 0 {
			continue
		}
		labels := rest[:end-1]
		blocks, bok := labelInt(labels, "num_gpu_blocks")
		size, sok := labelInt(labels, "block_size")
		if bok && sok && blocks > 0 && size > 0 {
			return clampInt(float64(blocks) * float64(size)), true
		}
	}
	return 0, false
}

// labelInt returns the integer value of label name in a label set
// `a="1",b="2"`.
func labelInt(labels, name string) (int, bool) {
	for len(labels) > 0 {
		eq := strings.IndexByte(labels, '=')
		if eq < 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return 0, false
		}
		key := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(labels[:eq]), ","))
		q := closingQuote(labels, eq+2)
		if q < 0 {
			return 0, false
		}
		val := labels[eq+2 : q]
		if key == name {
			v, err := strconv.ParseFloat(val, 64)
			if err != nil || v < 0 || v > math.MaxInt32 || math.IsNaN(v) {
				return 0, false
			}
			return int(v), true
		}
		labels = labels[q+1:]
	}
	return 0, false
}
