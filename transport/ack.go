package transport

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
)

// AckStatus is the informational status (102 Processing) an InferProtocol
// server sends as soon as it has read a request's header, before the
// request's body is read and long before an engine answers. It tells the
// client that the peer is alive and holds the request, whatever the engine's
// speed, so that a client can bound the wait for it by the path's round trip
// time instead of by the engine's time to first token. It costs a few bytes
// on the request's own stream and no round trip: the response follows on the
// same stream.
const AckStatus = http.StatusProcessing

// WithAck returns a context for an outgoing request on which onAck is called
// (from the transport's reader goroutine, so it must not block) when the
// server's AckStatus arrives. Other informational responses are ignored.
func WithAck(ctx context.Context, onAck func()) context.Context {
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
			if code == AckStatus {
				onAck()
			}
			return nil
		},
	})
}

// ack sends AckStatus on w at once.
func ack(w http.ResponseWriter) {
	w.WriteHeader(AckStatus)
}
