// Package relay serves the OpenAI HTTP API on a public host and routes each
// request to an agent.
package relay
