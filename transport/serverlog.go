package transport

import (
	"bytes"
	"log"

	"github.com/rs/zerolog"
)

// ServerLog returns a logger for an http.Server's ErrorLog that writes into
// l. net/http recovers a handler's panic (but for http.ErrAbortHandler, a
// deliberate abort), aborts the connection and reports it there as
// "http: panic serving ADDR: VALUE" (http2: for HTTP/2) followed by the
// handler goroutine's stack: that becomes an error-level line with the
// panic's value and stack, after onPanic (nil: none) counted it. Anything
// else the server reports (a failed accept, a TLS handshake error, a
// handler's misuse of its ResponseWriter) is logged as it comes, without a
// level.
func ServerLog(l zerolog.Logger, onPanic func()) *log.Logger {
	return log.New(serverLogWriter{l: l, onPanic: onPanic}, "", 0)
}

type serverLogWriter struct {
	l       zerolog.Logger
	onPanic func()
}

var panicPrefixes = [][]byte{[]byte("http: panic serving "), []byte("http2: panic serving ")}

// Write implements io.Writer; log.Logger calls it once per message.
func (w serverLogWriter) Write(p []byte) (int, error) {
	msg := bytes.TrimRight(p, "\n")
	for _, pre := range panicPrefixes {
		rest, ok := bytes.CutPrefix(msg, pre)
		if !ok {
			continue
		}
		if w.onPanic != nil {
			w.onPanic()
		}
		// "ADDR: VALUE\nSTACK"; an address has no ": " (IP:port, [v6]:port
		// or a peer ID).
		head, stack, _ := bytes.Cut(rest, []byte("\n"))
		remote, value, _ := bytes.Cut(head, []byte(": "))
		w.l.Error().Bytes("remote", remote).Bytes("panic", value).Bytes("stack", stack).
			Msg("recovered a panic serving a request")
		return len(p), nil
	}
	w.l.Log().Msg(string(msg))
	return len(p), nil
}

// ServeOption configures ServeHTTP.
type ServeOption func(*serveOptions)

type serveOptions struct {
	errorLog *log.Logger
}

// WithServerLog gives ServeHTTP's http.Server an ErrorLog (see ServerLog).
// Without it what net/http reports, recovered panics included, is dropped.
func WithServerLog(l *log.Logger) ServeOption {
	return func(o *serveOptions) { o.errorLog = l }
}
