package bench

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/peer"
)

// floorEngine is an engine for the floor's tests: /echo answers the body it
// got with Content-Length, /stream sends one line, flushed, and its second
// only once release is closed; /hold sends one line and reports on cancelled
// when its request's context ends.
type floorEngine struct {
	url       string
	release   chan struct{}
	cancelled chan struct{}
	srv       *http.Server
}

func startFloorEngine(t *testing.T) *floorEngine {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &floorEngine{url: "http://" + ln.Addr().String(), release: make(chan struct{}), cancelled: make(chan struct{}, 1)}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		w.Header().Set("X-Seen", r.Header.Get("X-Sent"))
		w.Write(b)
	})
	mux.HandleFunc("GET /stream", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-e.release:
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, "data: second\n\n")
	})
	mux.HandleFunc("GET /hold", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		e.cancelled <- struct{}{}
	})
	e.srv = &http.Server{Handler: mux}
	go e.srv.Serve(ln)
	t.Cleanup(func() { e.srv.Close() })
	return e
}

// The floor's two sides, run in this process on loopback, carry a body
// larger than a copy buffer both ways with end-to-end headers, flush a
// stream's first event before the engine sends the next, and pass a
// client's cancellation on to the engine.
func TestStockFloorForwards(t *testing.T) {
	eng := startFloorEngine(t)
	ctx, cancel := context.WithCancel(context.Background())
	port, err := freePort("tcp")
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	addrFile := filepath.Join(t.TempDir(), "floor.addrs")
	var done []chan error
	run := func(f func() error) {
		c := make(chan error, 1)
		done = append(done, c)
		go func() { c <- f() }()
	}
	defer func() {
		cancel()
		for _, c := range done {
			if err := <-c; err != nil {
				t.Errorf("floor side: %v", err)
			}
		}
	}()
	run(func() error { return ServeStockFloorRelay(ctx, addr, addrFile) })
	var relayAddr string
	for deadline := time.Now().Add(20 * time.Second); relayAddr == ""; time.Sleep(20 * time.Millisecond) {
		if b, err := os.ReadFile(addrFile); err == nil {
			relayAddr = strings.SplitN(string(b), "\n", 2)[0]
		} else if time.Now().After(deadline) {
			t.Fatal("relay side wrote no address")
		}
	}
	run(func() error { return ServeStockFloorAgent(ctx, relayAddr, eng.url) })

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 20 * time.Second}
	body := bytes.Repeat([]byte("0123456789abcdef"), 6<<10) // 96 KiB, three copy buffers
	var resp *http.Response
	for deadline := time.Now().Add(20 * time.Second); ; {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/echo", bytes.NewReader(body))
		req.Header.Set("X-Sent", "yes")
		resp, err = c.Do(req)
		if err == nil && resp.StatusCode == http.StatusOK {
			break
		}
		if err == nil {
			resp.Body.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("floor never answered: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !bytes.Equal(got, body) {
		t.Fatalf("echo: %d bytes, %v; want the %d sent", len(got), err, len(body))
	}
	if resp.Header.Get("X-Seen") != "yes" {
		t.Errorf("engine saw X-Sent %q, want yes", resp.Header.Get("X-Seen"))
	}

	// The first event arrives while the engine still holds the second.
	resp, err = c.Get("http://" + addr + "/stream")
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	first, err := br.ReadString('\n')
	if err != nil || first != "data: first\n" {
		t.Fatalf("first line %q, %v", first, err)
	}
	close(eng.release)
	rest, err := io.ReadAll(br)
	resp.Body.Close()
	if err != nil || !strings.Contains(string(rest), "data: second") {
		t.Fatalf("rest of stream %q, %v", rest, err)
	}

	// A client gone mid-answer ends the engine's request.
	hctx, hcancel := context.WithCancel(ctx)
	req, _ := http.NewRequestWithContext(hctx, http.MethodGet, "http://"+addr+"/hold", nil)
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || line != "data: first\n" {
		t.Fatalf("held stream's first line %q, %v", line, err)
	}
	hcancel()
	resp.Body.Close()
	select {
	case <-eng.cancelled:
	case <-time.After(20 * time.Second):
		t.Fatal("the engine's request was not cancelled")
	}
}

// The floor and the reverse proxy serve on loopback only; the floor refuses
// a bad upstream.
func TestStockFloorRefusesBadAddresses(t *testing.T) {
	k, _, err := crypto.GenerateEd25519Key(nil)
	if err != nil {
		t.Fatal(err)
	}
	id, err := peer.IDFromPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	loop := "/ip4/127.0.0.1/udp/9/quic-v1/p2p/" + id.String()
	ctx := context.Background()
	for _, c := range []struct {
		name string
		run  func() error
		want string
	}{
		{"relay on a public address", func() error { return ServeStockFloorRelay(ctx, "198.18.0.1:0", "x") }, "not loopback"},
		{"relay on all addresses", func() error { return ServeStockFloorRelay(ctx, ":0", "x") }, "not loopback"},
		{"reverse proxy on a public address", func() error { return ServeReverseProxy(ctx, "198.18.0.1:0", "http://127.0.0.1:1") }, "not loopback"},
		{"relay without address file", func() error { return ServeStockFloorRelay(ctx, "127.0.0.1:0", "") }, "--addr-file"},
		{"agent dialing a public relay", func() error {
			return ServeStockFloorAgent(ctx, "/ip4/198.18.0.1/udp/9/quic-v1/p2p/"+id.String(), "http://127.0.0.1:1")
		}, "not loopback"},
		{"agent without peer ID", func() error { return ServeStockFloorAgent(ctx, "/ip4/127.0.0.1/udp/9/quic-v1", "http://127.0.0.1:1") }, "relay address"},
		{"agent with https upstream", func() error { return ServeStockFloorAgent(ctx, loop, "https://127.0.0.1:1") }, "--upstream"},
		{"agent with upstream path", func() error { return ServeStockFloorAgent(ctx, loop, "http://127.0.0.1:1/v1") }, "--upstream"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.run()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one saying %q", err, c.want)
			}
		})
	}
	if err := checkLoopbackHostPort("[::1]:80"); err != nil {
		t.Errorf("[::1]:80: %v", err)
	}
	if err := checkLoopbackHostPort("localhost:80"); err != nil {
		t.Errorf("localhost:80: %v", err)
	}
}
