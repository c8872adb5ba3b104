// Package anthropic serves Anthropic's Messages API (POST /v1/messages)
// through engines that speak only OpenAI's chat completions.
//
// ToChat reads a Messages request into the chat completions request it
// means: the system prompt as a system message, tool_result blocks as
// tool messages, tool_use blocks as tool_calls, custom tools as functions,
// tool_choice, stop_sequences and sampling parameters as their chat
// counterparts. What Anthropic's API refuses (no model, no positive
// max_tokens, no messages, an unknown role or block, a tool that is not a
// custom tool) is a *RequestError naming the field at fault.
//
// Writer turns the chat completions answer back into a Messages answer as
// it comes: a whole message, or the stream of message_start,
// content_block_start, _delta and _stop, message_delta and message_stop
// events, with text, tool_use blocks (their input as input_json_delta) and
// usage in Anthropic's terms (input_tokens without the cached tokens,
// cache_read_input_tokens for them). An engine's error answer becomes an
// error in Anthropic's envelope (ErrorJSON).
//
// The package does no I/O of its own; the relay decides which attempts
// are translated (an engine that lists /v1/messages gets the client's
// request as it is).
package anthropic
