// Package transport builds the libp2p hosts that carry ComputeFlux traffic
// over QUIC and defines the protocols spoken on them.
package transport
