// Package ports gives tests loopback ports to hand to a process or server
// that binds them later.
//
// A port the kernel picked (listen on port 0, then close) comes from the
// ephemeral range, which every other test's listeners and outgoing
// connections draw from too: on a busy machine one of them can take it in
// the window before it is bound again. Free picks below that range, where
// nothing takes a port unasked.
package ports

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// lowest is the lowest port Free hands out: above the well-known and the
// commonly configured service ports.
const lowest = 10000

// Free returns "127.0.0.1:PORT" with a port below the ephemeral range that
// network ("tcp" or "udp") could bind just now.
func Free(t testing.TB, network string) string {
	t.Helper()
	hi := ephemeralLow()
	for range 200 {
		addr := "127.0.0.1:" + strconv.Itoa(lowest+rand.IntN(hi-lowest))
		if bindable(network, addr) {
			return addr
		}
	}
	t.Fatalf("ports: no free %s port in %d..%d", network, lowest, hi-1)
	return ""
}

// QUIC returns a loopback QUIC multiaddr on a port from Free.
func QUIC(t testing.TB) string {
	t.Helper()
	_, port, _ := net.SplitHostPort(Free(t, "udp"))
	return fmt.Sprintf("/ip4/127.0.0.1/udp/%s/quic-v1", port)
}

func bindable(network, addr string) bool {
	if network == "udp" {
		pc, err := net.ListenPacket("udp4", addr)
		if err != nil {
			return false
		}
		return pc.Close() == nil
	}
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		return false
	}
	return ln.Close() == nil
}

// ephemeralLow is the bottom of the kernel's ephemeral port range (32768
// where it cannot be read, Linux's default).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if lo, err := strconv.Atoi(f[0]); err == nil && lo > lowest+1000 {
				return lo
			}
		}
	}
	return 32768
}
