// Package agent runs next to a local inference engine, joins relays over
// libp2p and serves their inference requests.
package agent
