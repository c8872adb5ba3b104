package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/computeflux/computeflux/transport"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	ma "github.com/multiformats/go-multiaddr"
	manet "github.com/multiformats/go-multiaddr/net"
)

// The stock floor is the overhead benchmark's baseline for what the relay
// path's parts cost on their own: the same two hops as relay and agent
// (client HTTP into a net/http server, HTTP/1.1 over a libp2p QUIC stream
// with transport.NewRoundTripper and transport.ServeHTTP, HTTP/1.1 to the
// engine with transport.NewHTTP1RoundTripper), in two processes, with
// nothing of the product between them: no token or join, no routing fields
// read from the body, no scheduler, no session index, no usage accounting,
// no metrics, no logging, no retries. It is not an agent and serves nothing
// but the benchmark: it has no auth and listens on loopback only. It exists
// because a target for the path's cost means little without what its parts
// cost used plainly: the product's row minus this one is about what our own
// logic costs, and a target below this row needs other parts, not leaner
// logic. (The product tunes some of the same steps, such as building the
// upstream request without parsing a URL, so it can come out a little below
// the floor on one side.)

// floorListen is the QUIC address of both floor hosts: loopback, any port.
const floorListen = "/ip4/127.0.0.1/udp/0/quic-v1"

// floorConnectTimeout bounds the floor agent's dial to the floor relay.
const floorConnectTimeout = 10 * time.Second

// floorHopHeaders are not forwarded (RFC 9110 section 7.6.1). Tokens that a
// Connection header names are not looked up: the benchmark's client and
// engine send none.
var floorHopHeaders = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Connection": true,
	"Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
}

// floorBuffers are the copy buffers of the floor's answers.
var floorBuffers = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// ServeStockFloorRelay is the relay side of the stock floor (see above):
// a net/http server on addr (a loopback host:port) whose handler reads the
// request's body and forwards the request with transport.NewRoundTripper to
// the one peer connected to its libp2p QUIC host, then copies the answer
// back. It writes the host's full loopback multiaddr to addrFile, for
// ServeStockFloorAgent to dial, and serves until ctx ends. Until a peer has
// connected it answers 503.
func ServeStockFloorRelay(ctx context.Context, addr, addrFile string) error {
	if err := checkLoopbackHostPort(addr); err != nil {
		return fmt.Errorf("stock floor relay: %w", err)
	}
	if addrFile == "" {
		return errors.New("stock floor relay: --addr-file is required")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	defer ln.Close()
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{floorListen}})
	if err != nil {
		return err
	}
	defer h.Close()
	fr := &floorRelay{rt: transport.NewRoundTripper(h)}
	defer closeIdle(fr.rt)
	h.Network().Notify(&network.NotifyBundle{ConnectedF: fr.connected, DisconnectedF: fr.disconnected})
	var b bytes.Buffer
	for _, a := range transport.FullAddrs(h) {
		fmt.Fprintln(&b, a)
	}
	if err := writeFileAtomic(addrFile, b.Bytes()); err != nil {
		return err
	}
	srv := &http.Server{Handler: fr, ReadHeaderTimeout: 10 * time.Second, ErrorLog: log.New(io.Discard, "", 0)}
	stop := context.AfterFunc(ctx, func() { _ = srv.Close() })
	defer stop()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// floorRelay is ServeStockFloorRelay's handler.
type floorRelay struct {
	rt http.RoundTripper

	mu       sync.Mutex // guards the following fields
	agent    peer.ID    // the connected peer requests go to; "" for none
	agentStr string     // agent.String(), encoded once
}

// connected takes the first peer to connect as the agent (a libp2p
// notifiee: it records and returns).
func (fr *floorRelay) connected(_ network.Network, c network.Conn) {
	fr.mu.Lock()
	defer fr.mu.Unlock()
	if fr.agent == "" {
		fr.agent, fr.agentStr = c.RemotePeer(), c.RemotePeer().String()
	}
}

// disconnected forgets the agent once its last connection is gone.
func (fr *floorRelay) disconnected(n network.Network, c network.Conn) {
	fr.mu.Lock()
	defer fr.mu.Unlock()
	if p := c.RemotePeer(); p == fr.agent && n.Connectedness(p) != network.Connected {
		fr.agent, fr.agentStr = "", ""
	}
}

func (fr *floorRelay) agentHost() string {
	fr.mu.Lock()
	defer fr.mu.Unlock()
	return fr.agentStr
}

// ServeHTTP reads the body whole (as the product's relay must, to route by
// it) and forwards the request on a libp2p stream.
func (fr *floorRelay) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	agent := fr.agentHost()
	if agent == "" {
		http.Error(w, "stock floor: no agent connected", http.StatusServiceUnavailable)
		return
	}
	body, err := readFloorBody(w, r)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			http.Error(w, "request body too large", http.StatusRequestEntityTooLarge)
		} else {
			http.Error(w, "reading request body failed", http.StatusBadRequest)
		}
		return
	}
	var rb io.Reader = http.NoBody
	if len(body) > 0 {
		rb = bytes.NewReader(body)
	}
	out, err := http.NewRequestWithContext(r.Context(), r.Method, "http://"+agent+r.URL.RequestURI(), rb)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	copyFloorHeader(out.Header, r.Header)
	forwardFloor(w, fr.rt, out)
}

// readFloorBody reads r's body whole: into one buffer of the declared length
// when it is given and at most 1 MiB, growing one (bounded by
// transport.MaxRequestBody) otherwise.
func readFloorBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	if n := r.ContentLength; n >= 0 && n <= 1<<20 {
		b := make([]byte, n)
		if _, err := io.ReadFull(r.Body, b); err != nil {
			return nil, err
		}
		return b, nil
	}
	return io.ReadAll(http.MaxBytesReader(w, r.Body, transport.MaxRequestBody))
}

// ServeStockFloorAgent is the agent side of the stock floor (see above): a
// libp2p QUIC host on loopback that dials the floor relay at relayAddr (a
// loopback multiaddr with /p2p/<ID>), serves transport.ServeHTTP to that
// peer alone, and forwards each request with transport.NewHTTP1RoundTripper
// to the engine at upstream (an http:// URL), copying the answer back. It
// serves until ctx ends. It is a baseline for the benchmark, not an agent:
// it joins nothing and reports nothing.
func ServeStockFloorAgent(ctx context.Context, relayAddr, upstream string) error {
	a, err := ma.NewMultiaddr(relayAddr)
	if err != nil {
		return fmt.Errorf("stock floor agent: relay address %q: %w", relayAddr, err)
	}
	if !manet.IsIPLoopback(a) {
		return fmt.Errorf("stock floor agent: relay address %q is not loopback", relayAddr)
	}
	relay, err := peer.AddrInfoFromP2pAddr(a)
	if err != nil {
		return fmt.Errorf("stock floor agent: relay address %q: %w", relayAddr, err)
	}
	u, err := url.Parse(upstream)
	if err != nil || u.Scheme != "http" || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return fmt.Errorf("stock floor agent: --upstream %q: want http://host:port", upstream)
	}
	base := "http://" + u.Host
	h, err := transport.NewHost(transport.HostConfig{ListenAddrs: []string{floorListen}})
	if err != nil {
		return err
	}
	defer h.Close()
	rt := transport.NewHTTP1RoundTripper(nil)
	defer closeIdle(rt)
	// Serve before dialing: the relay forwards as soon as it sees the
	// connection.
	srv, err := transport.ServeHTTP(h, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// ServeHTTP has read the body whole and set ContentLength.
		out, err := http.NewRequestWithContext(r.Context(), r.Method, base+r.URL.RequestURI(), r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		out.ContentLength = r.ContentLength
		if out.ContentLength == 0 {
			out.Body = http.NoBody
		}
		copyFloorHeader(out.Header, r.Header)
		forwardFloor(w, rt, out)
	}), func(p peer.ID) bool { return p == relay.ID })
	if err != nil {
		return err
	}
	defer srv.Close()
	cctx, cancel := context.WithTimeout(ctx, floorConnectTimeout)
	err = h.Connect(cctx, *relay)
	cancel()
	if err != nil {
		return fmt.Errorf("stock floor agent: connect to %s: %w", relayAddr, err)
	}
	<-ctx.Done()
	return nil
}

// forwardFloor sends out with rt and copies the answer to w through a
// pooled buffer, flushing after every write when the answer's length is
// unknown (a stream), as httputil.ReverseProxy does. A failure after the
// head went out aborts the response, so the client sees it cut.
func forwardFloor(w http.ResponseWriter, rt http.RoundTripper, out *http.Request) {
	res, err := rt.RoundTrip(out)
	if err != nil {
		if out.Context().Err() == nil {
			http.Error(w, "stock floor: "+err.Error(), http.StatusBadGateway)
		}
		return
	}
	defer res.Body.Close()
	copyFloorHeader(w.Header(), res.Header)
	w.WriteHeader(res.StatusCode)
	flusher, _ := w.(http.Flusher)
	flush := res.ContentLength < 0 && flusher != nil
	bp := floorBuffers.Get().(*[]byte)
	defer floorBuffers.Put(bp)
	buf := *bp
	for {
		n, rerr := res.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return // the client is gone; closing the body resets upstream
			}
			if flush {
				flusher.Flush()
			}
		}
		if rerr == io.EOF {
			return
		}
		if rerr != nil {
			panic(http.ErrAbortHandler)
		}
	}
}

// copyFloorHeader adds src's end-to-end headers to dst.
func copyFloorHeader(dst, src http.Header) {
	for k, vv := range src {
		if !floorHopHeaders[k] {
			dst[k] = append(dst[k], vv...)
		}
	}
}

// closeIdle closes rt's idle connections or streams.
func closeIdle(rt http.RoundTripper) {
	if c, ok := rt.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// checkLoopbackHostPort accepts host:port with a loopback IP or localhost:
// the benchmark's baselines have no auth and serve nothing but it.
func checkLoopbackHostPort(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("listen address %q: %w", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("listen address %q is not loopback", addr)
	}
	return nil
}

// writeFileAtomic writes b to path through a temporary file and a rename, so
// that a reader polling path sees all of it or nothing.
func writeFileAtomic(path string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// startStockFloor runs ServeStockFloorRelay and ServeStockFloorAgent as
// processes of cfg.Binary in front of the engine and waits until the relay
// side answers through the agent side.
func startStockFloor(ctx context.Context, cfg OverheadConfig, dir, engineURL string) (*target, []*proc, error) {
	port, err := freePort("tcp")
	if err != nil {
		return nil, nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	addrFile := filepath.Join(dir, "floor-relay.addrs")
	r, err := startProc(ctx, "floor-relay", dir, nil, cfg.Binary, "bench", "--overhead",
		"--serve-stock-floor-relay", addr, "--addr-file", addrFile)
	if err != nil {
		return nil, nil, err
	}
	procs := []*proc{r}
	relayAddr, err := waitAddrFile(ctx, addrFile, r)
	if err != nil {
		return nil, procs, err
	}
	a, err := startProc(ctx, "floor-agent", dir, nil, cfg.Binary, "bench", "--overhead",
		"--serve-stock-floor-agent", relayAddr, "--upstream", engineURL)
	if err != nil {
		return nil, procs, err
	}
	procs = append(procs, a)
	if err := waitReady(ctx, "http://"+addr+"/v1/models", `"m1"`, procs); err != nil {
		return nil, procs, err
	}
	// The CPU column names the processes as in the computeflux row, so
	// that the two read side by side (their logs keep the floor- names).
	t := &target{name: "stock-floor", url: "http://" + addr, procs: []*proc{
		{name: "relay", cmd: r.cmd, log: r.log, done: r.done},
		{name: "agent", cmd: a.cmd, log: a.log, done: a.done},
	}}
	return t, procs, nil
}
