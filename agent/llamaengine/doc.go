// Package llamaengine runs real llama.cpp inference on CPU for tests and
// benchmarks: it writes tiny random-weight llama models as GGUF files, and
// starts an OpenAI-compatible HTTP server on loopback (a Node script over
// node-llama-cpp, the npm package that ships llama.cpp prebuilt) that
// serves one of them at temperature 0.
//
// Two models written from different seeds are two different models with
// the same shape and vocabulary; one file served twice is the same model.
package llamaengine
