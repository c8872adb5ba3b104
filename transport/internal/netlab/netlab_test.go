package netlab

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// helperEnv makes the test binary act as a small network tool inside a
// namespace instead of running tests.
const helperEnv = "NETLAB_TEST_HELPER"

func TestMain(m *testing.M) {
	if role := os.Getenv(helperEnv); role != "" {
		os.Exit(helper(role, os.Args[len(os.Args)-1]))
	}
	code := m.Run()
	CloseAll()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreAnyFunction("os/signal.signal_recv"),
			goleak.IgnoreAnyFunction("github.com/computeflux/computeflux/transport/internal/netlab.watchSignals.func1")); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

// helper runs one tool:
//
//	udpecho ADDR          answer every datagram with its source address
//	udpprobe LPORT,DST... from local port LPORT, ask each DST for our source address
//	buildlab PREFIX       build a lab with one home, print READY, wait for a signal
func helper(role, arg string) int {
	switch role {
	case "udpecho":
		c, err := net.ListenPacket("udp4", arg)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("READY")
		buf := make([]byte, 1500)
		for {
			_, from, err := c.ReadFrom(buf)
			if err != nil {
				return 1
			}
			_, _ = c.WriteTo([]byte(from.String()), from)
		}
	case "udpprobe":
		parts := strings.Split(arg, ",")
		c, err := net.ListenPacket("udp4", "0.0.0.0:"+parts[0])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		buf := make([]byte, 1500)
		for _, dst := range parts[1:] {
			ua, err := net.ResolveUDPAddr("udp4", dst)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			got := "TIMEOUT"
			for try := 0; try < 5 && got == "TIMEOUT"; try++ {
				_, _ = c.WriteTo([]byte("?"), ua)
				_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
				if n, _, err := c.ReadFrom(buf); err == nil {
					got = string(buf[:n])
				}
			}
			fmt.Println(got)
		}
		return 0
	case "httpok":
		ln, err := net.Listen("tcp", arg)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("READY")
		_ = http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprint(w, r.RemoteAddr)
		}))
		return 1
	case "buildlab":
		l, err := New(Config{Prefix: arg, Homes: []NATKind{EndpointIndependent}})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("READY", l.Prefix)
		select {} // the signal handler closes the lab and exits
	}
	fmt.Fprintln(os.Stderr, "unknown helper", role)
	return 2
}

func self(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

// startEcho runs a UDP echo at addr inside ns and waits until it listens.
func startEcho(t *testing.T, l *Lab, ns, addr string) *Proc {
	t.Helper()
	p, err := l.Start(ns, []string{helperEnv + "=udpecho"}, os.Stderr, self(t), addr)
	if err != nil {
		t.Fatal(err)
	}
	line, err := p.Stdout.ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "READY" {
		t.Fatalf("echo in %s: %q %v", ns, line, err)
	}
	return p
}

// probe asks each destination, from local port lport inside ns, which source
// address it sees.
func probe(t *testing.T, l *Lab, ns string, lport int, dsts ...string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns, self(t), fmt.Sprintf("%d,%s", lport, strings.Join(dsts, ",")))
	cmd.Env = append(os.Environ(), helperEnv+"=udpprobe")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("probe from %s: %v", ns, err)
	}
	return strings.Fields(string(out))
}

func TestTopologyNAT(t *testing.T) {
	l := NewT(t, Config{Homes: []NATKind{EndpointIndependent, Symmetric}})
	startEcho(t, l, l.Relay.NS, RelayIP+":7000")
	startEcho(t, l, l.Relay.NS, RelayIP+":7001")
	startEcho(t, l, l.Client.NS, ClientIP+":7000")

	t.Run("eim keeps port and address for every destination", func(t *testing.T) {
		h := l.Homes[0]
		got := probe(t, l, h.NS, 40000, RelayIP+":7000", RelayIP+":7001", ClientIP+":7000")
		want := h.WANIP + ":40000"
		for i, g := range got {
			if g != want {
				t.Errorf("destination %d saw %s, want %s", i, g, want)
			}
		}
		if len(got) != 3 {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("symmetric maps each destination to a new port", func(t *testing.T) {
		h := l.Homes[1]
		got := probe(t, l, h.NS, 40000, RelayIP+":7000", RelayIP+":7001", ClientIP+":7000")
		if len(got) != 3 {
			t.Fatalf("got %v", got)
		}
		seen := map[string]bool{}
		for _, g := range got {
			if !strings.HasPrefix(g, h.WANIP+":") {
				t.Errorf("saw %s, want the router's address %s", g, h.WANIP)
			}
			seen[g] = true
		}
		if len(seen) != 3 {
			t.Errorf("mappings %v: want three different ports", got)
		}
	})
	t.Run("router drops unsolicited input from the WAN", func(t *testing.T) {
		startEcho(t, l, l.Homes[0].Router, "0.0.0.0:7100")
		if got := probe(t, l, l.Client.NS, 40001, l.Homes[0].WANIP+":7100"); len(got) != 1 || got[0] != "TIMEOUT" {
			t.Errorf("unsolicited datagram to the router was answered: %v", got)
		}
		// The LAN side still reaches the router: only the WAN is closed.
		if got := probe(t, l, l.Homes[0].NS, 40002, "198.19.0.1:7100"); len(got) != 1 || got[0] == "TIMEOUT" {
			t.Errorf("router unreachable from its LAN: %v", got)
		}
	})
	t.Run("routers count packets by peer", func(t *testing.T) {
		// Home 0 already talked to the relay; now it sends to home 1's WAN
		// address, where the router drops the unsolicited datagram.
		if got := probe(t, l, l.Homes[0].NS, 40005, l.Homes[1].WANIP+":7200"); len(got) != 1 || got[0] != "TIMEOUT" {
			t.Errorf("unsolicited datagram to home 1 was answered: %v", got)
		}
		c0, err := l.Counters(0)
		if err != nil {
			t.Fatal(err)
		}
		c1, err := l.Counters(1)
		if err != nil {
			t.Fatal(err)
		}
		if c0["to_relay"].Packets < 2 || c0["from_relay"].Packets < 2 {
			t.Errorf("home 0 relay counters %+v %+v, want the probes and their answers", c0["to_relay"], c0["from_relay"])
		}
		if c0["to_h1"].Packets == 0 {
			t.Errorf("home 0 -> home 1 not counted: %+v", c0["to_h1"])
		}
		// The probes are a few bytes: not data.
		if c0["to_h1_data"].Packets != 0 || c0["to_relay_data"].Packets != 0 {
			t.Errorf("small probes counted as data: %+v %+v", c0["to_h1_data"], c0["to_relay_data"])
		}
		if _, ok := c0["from_relay_data"]; !ok {
			t.Errorf("no data counters: %v", c0)
		}
		// Unsolicited: dropped on input, never forwarded into home 1.
		if c1["from_h0"].Packets != 0 {
			t.Errorf("home 1 forwarded %d unsolicited packets from home 0", c1["from_h0"].Packets)
		}
		if c1["to_h0"].Packets != 0 {
			t.Errorf("home 1 sent %d packets to home 0", c1["to_h0"].Packets)
		}
		if _, err := l.Counters(2); err == nil {
			t.Error("counters of a home that does not exist")
		}
	})
	t.Run("cut and heal", func(t *testing.T) {
		if err := l.Cut(0); err != nil {
			t.Fatal(err)
		}
		if got := probe(t, l, l.Homes[0].NS, 40003, RelayIP+":7000"); got[0] != "TIMEOUT" {
			t.Errorf("cut home still reaches the relay: %v", got)
		}
		if got := probe(t, l, l.Homes[1].NS, 40003, RelayIP+":7000"); got[0] == "TIMEOUT" {
			t.Errorf("other home lost the relay during the cut")
		}
		if err := l.Heal(0); err != nil {
			t.Fatal(err)
		}
		if got := probe(t, l, l.Homes[0].NS, 40004, RelayIP+":7000"); got[0] == "TIMEOUT" {
			t.Errorf("healed home does not reach the relay")
		}
	})

	nss := l.Namespaces()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	for _, ns := range nss {
		if err := exec.Command("ip", "netns", "exec", ns, "true").Run(); err == nil {
			t.Errorf("namespace %s survived Close", ns)
		}
	}
	if left := ListNamespaces(strings.SplitN(l.Prefix, "-", 2)[0]); containsAny(left, nss) {
		t.Errorf("namespaces left after Close: %v", left)
	}
}

func containsAny(have, want []string) bool {
	for _, h := range have {
		for _, w := range want {
			if h == w {
				return true
			}
		}
	}
	return false
}

// TestCleanupOnInterruptAndKill builds labs in child processes, interrupts
// one and kills the other outright, and checks that nothing is left.
func TestCleanupOnInterruptAndKill(t *testing.T) {
	if err := Available(); err != nil {
		t.Skipf("skipping NAT lab: %v", err)
	}
	start := func(prefix string) *exec.Cmd {
		cmd := exec.Command(self(t), prefix)
		cmd.Env = append(os.Environ(), helperEnv+"=buildlab")
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 128)
		n, err := out.Read(buf)
		if err != nil || !strings.HasPrefix(string(buf[:n]), "READY") {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("child lab: %q %v", buf[:n], err)
		}
		if got := ListNamespaces(prefix); len(got) != 5 {
			t.Errorf("child lab %s has namespaces %v, want 5", prefix, got)
		}
		return cmd
	}

	intr := start("cfltint")
	_ = intr.Process.Signal(syscall.SIGINT)
	_ = intr.Wait()
	if left := ListNamespaces("cfltint"); len(left) != 0 {
		t.Errorf("interrupted run left %v", left)
		for _, ns := range left {
			_ = removeNS(ns)
		}
	}

	killed := start("cfltkill")
	_ = killed.Process.Kill()
	_ = killed.Wait()
	Sweep()
	if left := ListNamespaces("cfltkill"); len(left) != 0 {
		t.Errorf("sweep after a killed run left %v", left)
		for _, ns := range left {
			_ = removeNS(ns)
		}
	}
}

func TestPrefixValidated(t *testing.T) {
	if err := Available(); err != nil {
		t.Skipf("skipping NAT lab: %v", err)
	}
	if _, err := New(Config{Prefix: "Bad-Prefix"}); err == nil {
		t.Fatal("a prefix with a dash was accepted")
	}
}

func TestNATKindString(t *testing.T) {
	if EndpointIndependent.String() != "eim" || Symmetric.String() != "symmetric" {
		t.Fatal(EndpointIndependent.String(), Symmetric.String())
	}
}

// TestHTTPClientInNamespace talks HTTP from the client namespace to a server
// in the relay namespace, from this process, many times, and checks that
// processes the lab started survive it (their parent thread must live on)
// and that this process stays in its own namespace.
func TestHTTPClientInNamespace(t *testing.T) {
	l := NewT(t, Config{})
	srv, err := l.Start(l.Relay.NS, []string{helperEnv + "=httpok"}, os.Stderr, self(t), RelayIP+":8080")
	if err != nil {
		t.Fatal(err)
	}
	if line, err := srv.Stdout.ReadString('\n'); err != nil || strings.TrimSpace(line) != "READY" {
		t.Fatalf("server: %q %v", line, err)
	}
	c := l.HTTPClient(l.Client.NS)
	defer c.CloseIdleConnections()
	c.Transport.(*http.Transport).DisableKeepAlives = true // a dial per request
	for i := 0; i < 50; i++ {
		resp, err := c.Get("http://" + RelayIP + ":8080/")
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || !strings.HasPrefix(string(b), ClientIP+":") {
			t.Fatalf("request %d: server saw %q (%v), want the client's address", i, b, err)
		}
	}
	select {
	case <-srv.Done():
		t.Fatalf("server in the relay namespace died: %v", srv.Err())
	default:
	}
	// No thread of this process was left in a lab namespace.
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	own, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		ns, err := os.Readlink("/proc/self/task/" + task.Name() + "/ns/net")
		if err == nil && ns != own {
			t.Errorf("thread %s is in %s, the process in %s", task.Name(), ns, own)
		}
	}
}
