// Package simengine is an OpenAI-compatible inference engine simulator with a
// prefix cache, so that routing effects on KV-cache hits and latency can be
// measured on a laptop without a GPU.
//
// It has two layers:
//
//   - Engine, a pure model in model time: deterministic tokenisation
//     (Tokenize), a prefix cache of 16-token blocks hashed as a chain
//     (BlockHashes) with LRU eviction, and a continuous-batching timing
//     model (prefill of the uncached tokens first come, first served;
//     decode steps that slow down as more sequences run; a bounded FIFO
//     queue). It reads no clock and starts no goroutine, so a
//     discrete-event simulation can drive thousands of engines in virtual
//     time through Submit, Cancel, Next and Advance.
//   - Server, an HTTP server that runs one Engine against the real clock
//     scaled by Config.TimeScale and speaks the OpenAI API:
//     /v1/chat/completions and /v1/completions (streamed as server-sent
//     events or not), /v1/embeddings, /v1/models, /metrics with vLLM's
//     metric names, and /admin/slowdown.
//
// Every response carries usage.prompt_tokens_details.cached_tokens, the
// prompt tokens served from the prefix cache. Streams always end with a
// usage chunk (choices empty), as OpenAI sends with
// stream_options.include_usage, whether or not the client asked for it.
//
// Chat requests are rendered with a ChatML template,
// "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message followed by
// "<|im_start|>assistant\n", and answers are words joined by single
// spaces. Together with the tokeniser's rule (whitespace belongs to the
// token before it), a follow-up turn that re-sends the history plus the
// previous answer tokenizes to the previous prompt plus the previous
// answer's tokens, so it hits every full block of both, as on a real engine.
//
// The generated text is a deterministic function of the engine's seed, the
// prompt and the number of tokens: the simulated model always generates
// exactly max_tokens tokens (finish_reason "length"), or
// Config.DefaultMaxTokens when the request sets no limit (finish_reason
// "stop").
package simengine
