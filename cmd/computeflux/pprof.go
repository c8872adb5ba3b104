package main

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"

	"github.com/computeflux/computeflux/relay"
)

// envPprof names a loopback address on which any subcommand serves
// net/http/pprof, for profiling a relay or an agent under load (see
// `computeflux bench --overhead --profile`). It is deliberately not a flag:
// profiling is for developers, and a listener is opt-in.
const envPprof = "COMPUTEFLUX_PPROF"

// servePprof serves the pprof handlers on addr, which must be a loopback
// address (port 0 picks one), and says where on stderr; "" serves nothing.
// The listener lives as long as the process.
func servePprof(addr string) error {
	if addr == "" {
		return nil
	}
	if !isLoopbackListen(addr) {
		return errors.New("pprof listens on loopback only (e.g. 127.0.0.1:6060)")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("pprof: %w", err)
	}
	// Said on stderr, where the process's logs go: with port 0 this is the
	// only way to learn it.
	fmt.Fprintf(os.Stderr, "computeflux: pprof on http://%s/debug/pprof/\n", ln.Addr())
	// Our own mux: the relay and the agent never serve http.DefaultServeMux,
	// but nothing here relies on that.
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: relay.DefaultReadHeaderTimeout}
	go srv.Serve(ln) //nolint:errcheck // lives until the process exits
	return nil
}
