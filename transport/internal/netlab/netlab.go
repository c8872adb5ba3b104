// Package netlab builds throw-away network topologies out of Linux network
// namespaces, veth pairs and nftables NAT, for integration tests of NAT
// traversal: a public segment with a relay and a client, and homes, each a
// host namespace behind its own NAT router namespace. It needs root, ip
// (iproute2) and nft (nftables); Available says why a lab cannot be built.
//
// Addresses: the public segment is 198.18.0.0/24 (relay .10, client .11,
// home i's router WAN side .100+i); home i's LAN is 198.19.i.0/24 (router .1,
// host .2). Nothing leaves the namespaces: the public segment is a bridge in
// a namespace of its own, not connected to the machine's network.
//
// Every lab is torn down by Close (processes killed by PID, then namespaces
// deleted), by SIGINT/SIGTERM while a lab is open, and, for a run killed
// outright, by Sweep in a later run: namespace names carry the creating
// process's PID, and Sweep removes labs whose creator is gone.
package netlab

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// NATKind is the mapping behaviour of a home router.
type NATKind int

const (
	// EndpointIndependent is plain masquerade: Linux keeps the source port
	// when it is free, so a host's outside address is the same towards every
	// destination, and hole punching can work.
	EndpointIndependent NATKind = iota
	// Symmetric is masquerade with fully random ports: every new destination
	// sees a different outside port, so the address the relay observed is
	// useless to a peer and hole punching fails.
	Symmetric
)

// String returns "eim" or "symmetric".
func (k NATKind) String() string {
	if k == Symmetric {
		return "symmetric"
	}
	return "eim"
}

// Public segment and home addressing (see the package comment).
const (
	// PublicPrefix is the public segment's subnet.
	PublicPrefix = "198.18.0.0/24"
	// RelayIP is the relay namespace's address on the public segment.
	RelayIP = "198.18.0.10"
	// ClientIP is the client namespace's address on the public segment.
	ClientIP = "198.18.0.11"
	// PublicCIDR is the range to count as public in the lab (the "internet"):
	// pass it to transport's PublicCIDRs settings. Home LANs (198.19.x) stay
	// outside it, as private ranges are outside the real internet.
	PublicCIDR = "198.18.0.0/16"
)

// Config describes a topology. The zero value is a public segment with a
// relay and a client and no homes.
type Config struct {
	// Homes lists one NAT kind per home.
	Homes []NATKind
	// Prefix starts every namespace name ("cfl" when empty); letters and
	// digits only. Scripts set it to find their own labs.
	Prefix string
	// Logf, when set, receives every command the lab runs.
	Logf func(format string, args ...any)
}

// Node is one namespace with one address.
type Node struct {
	NS string // namespace name
	IP string // its address (LAN address for a home host)
}

// Home is a host behind a NAT router.
type Home struct {
	Node          // the home host
	Router string // router namespace
	WANIP  string // router's outside address
	Kind   NATKind
	index  int
}

// Lab is a built topology. Its methods are safe for concurrent use.
type Lab struct {
	Prefix string  // starts every namespace name of this lab: prefix-pid-rand
	Public string  // namespace holding the public bridge
	Relay  Node    // relay namespace on the public segment
	Client Node    // client namespace on the public segment
	Homes  []*Home // in Config.Homes order

	logf func(string, ...any)

	mu     sync.Mutex // guards the following fields
	procs  map[int]*Proc
	nss    []string // created namespaces, in creation order
	closed bool
}

// Available returns nil when labs can be built here, else an error that says
// what is missing (root, ip, nft, or network namespace support).
func Available() error {
	if os.Geteuid() != 0 {
		return errors.New("netlab needs root (network namespaces and nftables)")
	}
	for _, bin := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(bin); err != nil {
			return fmt.Errorf("netlab needs %q (apt-get install iproute2 nftables): %w", bin, err)
		}
	}
	return nil
}

// NewT builds a lab for a test, skips the test with the reason when labs
// cannot be built here, and closes the lab when the test ends.
func NewT(t testing.TB, cfg Config) *Lab {
	t.Helper()
	if err := Available(); err != nil {
		t.Skipf("skipping NAT lab: %v", err)
	}
	if cfg.Logf == nil {
		cfg.Logf = t.Logf
	}
	l, err := New(cfg)
	if err != nil {
		t.Fatalf("netlab: %v", err)
	}
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Errorf("netlab close: %v", err)
		}
	})
	return l
}

var (
	openMu   sync.Mutex // guards openLabs and sigOnce's handler state
	openLabs = map[*Lab]struct{}{}
	sigOnce  sync.Once
)

// watchSignals closes every open lab on SIGINT or SIGTERM, then exits.
func watchSignals() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		sig := <-ch
		CloseAll()
		fmt.Fprintf(os.Stderr, "netlab: %v: labs removed\n", sig)
		os.Exit(130)
	}()
}

// CloseAll closes every lab this process has open. Test mains call it after
// the tests, so a test that lost track of a lab still leaves nothing behind.
func CloseAll() {
	openMu.Lock()
	labs := make([]*Lab, 0, len(openLabs))
	for l := range openLabs {
		labs = append(labs, l)
	}
	openMu.Unlock()
	for _, l := range labs {
		_ = l.Close()
	}
}

var prefixRE = regexp.MustCompile(`^[a-z0-9]{1,12}$`)

// New builds the topology in cfg. On error nothing is left behind.
func New(cfg Config) (*Lab, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "cfl"
	}
	if !prefixRE.MatchString(cfg.Prefix) {
		return nil, fmt.Errorf("netlab: prefix %q: want 1 to 12 lower-case letters or digits", cfg.Prefix)
	}
	if len(cfg.Homes) > 100 {
		return nil, errors.New("netlab: at most 100 homes")
	}
	Sweep()
	var rnd [2]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, err
	}
	base := fmt.Sprintf("%s-%d-%s", cfg.Prefix, os.Getpid(), hex.EncodeToString(rnd[:]))
	l := &Lab{
		Prefix: base,
		Public: base + "-pub",
		Relay:  Node{NS: base + "-relay", IP: RelayIP},
		Client: Node{NS: base + "-client", IP: ClientIP},
		logf:   cfg.Logf,
		procs:  map[int]*Proc{},
	}
	if l.logf == nil {
		l.logf = func(string, ...any) {}
	}
	sigOnce.Do(watchSignals)
	openMu.Lock()
	openLabs[l] = struct{}{}
	openMu.Unlock()
	if err := l.build(cfg.Homes); err != nil {
		_ = l.Close()
		return nil, err
	}
	return l, nil
}

func (l *Lab) build(homes []NATKind) error {
	if err := l.addNS(l.Public); err != nil {
		return err
	}
	if err := l.ip("-n", l.Public, "link", "add", "br0", "type", "bridge"); err != nil {
		return err
	}
	if err := l.ip("-n", l.Public, "link", "set", "br0", "up"); err != nil {
		return err
	}
	for _, n := range []struct {
		node Node
		port string
	}{{l.Relay, "relay"}, {l.Client, "client"}} {
		if err := l.addNS(n.node.NS); err != nil {
			return err
		}
		if err := l.plug(n.port, n.node.NS, "eth0", n.node.IP+"/24"); err != nil {
			return err
		}
	}
	for i, kind := range homes {
		h := &Home{
			Node:   Node{NS: fmt.Sprintf("%s-h%d", l.Prefix, i), IP: fmt.Sprintf("198.19.%d.2", i)},
			Router: fmt.Sprintf("%s-r%d", l.Prefix, i),
			WANIP:  homeWANIP(i),
			Kind:   kind,
			index:  i,
		}
		if err := l.buildHome(h, len(homes)); err != nil {
			return err
		}
		l.Homes = append(l.Homes, h)
	}
	return nil
}

// plug connects namespace ns to the public bridge through a veth pair: port
// on the bridge side, dev with addr on the ns side.
func (l *Lab) plug(port, ns, dev, addr string) error {
	steps := [][]string{
		{"-n", l.Public, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns},
		{"-n", l.Public, "link", "set", port, "master", "br0", "up"},
		{"-n", ns, "addr", "add", addr, "dev", dev},
		{"-n", ns, "link", "set", dev, "up"},
	}
	for _, s := range steps {
		if err := l.ip(s...); err != nil {
			return err
		}
	}
	return nil
}

// natRules is a home router's ruleset: masquerade out of the WAN side, and
// nothing unsolicited in from it. The input drop matters for hole punching:
// without it, a peer's punch packet that arrives before our own outgoing one
// is recorded by conntrack as a flow to the router itself, and our packet is
// then remapped to another port.
//
// The forward chain also counts the packets the router forwards to and from
// the relay and every other home's WAN address (see Lab.Counters): traffic
// between two homes' WAN addresses is the direct (hole-punched) path, since
// relayed traffic goes to the relay's address.
func natRules(kind NATKind, self, homes int) string {
	masq := "masquerade"
	if kind == Symmetric {
		masq = "masquerade fully-random"
	}
	var decl, count strings.Builder
	peers := []struct{ name, ip string }{{"relay", RelayIP}}
	for j := 0; j < homes; j++ {
		if j != self {
			peers = append(peers, struct{ name, ip string }{fmt.Sprintf("h%d", j), homeWANIP(j)})
		}
	}
	for _, p := range peers {
		for _, dir := range []struct{ name, match string }{{"to_", `oifname "wan" ip daddr`}, {"from_", `iifname "wan" ip saddr`}} {
			fmt.Fprintf(&decl, "\tcounter %s%s { }\n\tcounter %s%s_data { }\n", dir.name, p.name, dir.name, p.name)
			fmt.Fprintf(&count, "\t\t%s %s counter name \"%s%s\"\n", dir.match, p.ip, dir.name, p.name)
			fmt.Fprintf(&count, "\t\t%s %s ip length >= %d counter name \"%s%s_data\"\n", dir.match, p.ip, DataPacketMin, dir.name, p.name)
		}
	}
	return `table ip nat {
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		oifname "wan" ` + masq + `
	}
}
table ip filter {
` + decl.String() + `	chain input {
		type filter hook input priority filter; policy accept;
		iifname "wan" ct state established,related accept
		iifname "wan" drop
	}
	chain forward {
		type filter hook forward priority filter; policy accept;
` + count.String() + `		iifname "wan" ct state established,related accept
		iifname "wan" drop
	}
}
`
}

// DataPacketMin is the smallest IP packet the "_data" counters count (see
// Lab.Counters). QUIC's own control packets (ACK, keep-alive PING) are
// around 60 bytes on the wire; a memberlist probe or ack, carrying two peer
// IDs, is well over 150.
const DataPacketMin = 120

// homeWANIP is home i's router address on the public segment.
func homeWANIP(i int) string { return fmt.Sprintf("198.18.0.%d", 100+i) }

// Counter is a packet and byte count.
type Counter struct {
	Packets uint64 `json:"packets"`
	Bytes   uint64 `json:"bytes"`
}

// Counters returns what home i's router has forwarded so far, by direction
// and peer: "to_relay", "from_relay", and "to_hJ", "from_hJ" for every other
// home J; and the same with "_data" appended, counting only packets of at
// least DataPacketMin bytes (payload, not transport chatter). Packets to and
// from another home's WAN address take the direct path. "from_" counts packets forwarded into the home, i.e. those that
// matched one of its NAT mappings (answers, or a punched path); unsolicited
// packets end at the router and are not counted.
func (l *Lab) Counters(i int) (map[string]Counter, error) {
	if i < 0 || i >= len(l.Homes) {
		return nil, fmt.Errorf("netlab: no home %d", i)
	}
	out, err := l.Exec(context.Background(), l.Homes[i].Router, nil, "nft", "-j", "list", "counters", "table", "ip", "filter")
	if err != nil {
		return nil, err
	}
	var doc struct {
		Nftables []struct {
			Counter *struct {
				Name string `json:"name"`
				Counter
			} `json:"counter"`
		} `json:"nftables"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return nil, fmt.Errorf("netlab: nft counters of home %d: %w", i, err)
	}
	m := make(map[string]Counter)
	for _, o := range doc.Nftables {
		if o.Counter != nil {
			m[o.Counter.Name] = o.Counter.Counter
		}
	}
	return m, nil
}

func (l *Lab) buildHome(h *Home, homes int) error {
	if err := l.addNS(h.Router); err != nil {
		return err
	}
	if err := l.addNS(h.NS); err != nil {
		return err
	}
	if err := l.plug(fmt.Sprintf("w%d", h.index), h.Router, "wan", h.WANIP+"/24"); err != nil {
		return err
	}
	lan := fmt.Sprintf("198.19.%d.1", h.index)
	steps := [][]string{
		{"-n", h.Router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", h.NS},
		{"-n", h.Router, "addr", "add", lan + "/24", "dev", "lan"},
		{"-n", h.Router, "link", "set", "lan", "up"},
		{"-n", h.NS, "addr", "add", h.IP + "/24", "dev", "eth0"},
		{"-n", h.NS, "link", "set", "eth0", "up"},
		{"-n", h.NS, "route", "add", "default", "via", lan},
	}
	for _, s := range steps {
		if err := l.ip(s...); err != nil {
			return err
		}
	}
	if _, err := l.Exec(context.Background(), h.Router, nil, "sysctl", "-qw", "net.ipv4.ip_forward=1"); err != nil {
		return err
	}
	if _, err := l.Exec(context.Background(), h.Router, strings.NewReader(natRules(h.Kind, h.index, homes)), "nft", "-f", "-"); err != nil {
		return err
	}
	return nil
}

// addNS creates a namespace and records it, under the lock so that a
// concurrent Close (an interrupt while building) either sees it or prevents it.
func (l *Lab) addNS(name string) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return errors.New("netlab: lab closed")
	}
	err := l.ip("netns", "add", name)
	if err == nil {
		l.nss = append(l.nss, name)
	}
	l.mu.Unlock()
	if err != nil {
		return err
	}
	return l.ip("-n", name, "link", "set", "lo", "up")
}

func (l *Lab) ip(args ...string) error {
	l.logf("ip %s", strings.Join(args, " "))
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// Exec runs a command to completion inside namespace ns and returns its
// combined output.
func (l *Lab) Exec(ctx context.Context, ns string, stdin io.Reader, argv ...string) ([]byte, error) {
	l.logf("[%s] %s", ns, strings.Join(argv, " "))
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns}, argv...)...)
	cmd.Stdin = stdin
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("[%s] %s: %w: %s", ns, strings.Join(argv, " "), err, bytes.TrimSpace(out))
	}
	return out, nil
}

// Proc is a process started in a namespace by Start.
type Proc struct {
	// PID is the process's ID (ip netns exec replaces itself with the command).
	PID int
	// Stdin writes to the process; Stdout reads its standard output by line.
	Stdin  io.WriteCloser
	Stdout *bufio.Reader

	lab  *Lab
	cmd  *exec.Cmd
	done chan struct{}
	err  error // set before done is closed
}

// Start runs argv inside namespace ns with env added to this process's
// environment. Its standard error goes to stderr (nil discards it). The lab
// kills it, if still running, on Close.
func (l *Lab) Start(ns string, env []string, stderr io.Writer, argv ...string) (*Proc, error) {
	l.logf("[%s] start %s", ns, strings.Join(argv, " "))
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns}, argv...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = stderr
	// Its own process group, so Kill reaches its children too; and killed
	// with us if this process dies without cleaning up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	// Started and recorded under the lock: a concurrent Close either kills
	// it or prevents it.
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, errors.New("netlab: lab closed")
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("[%s] start %s: %w", ns, argv[0], err)
	}
	p := &Proc{PID: cmd.Process.Pid, Stdin: stdin, Stdout: bufio.NewReader(stdout), lab: l, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	l.procs[p.PID] = p
	return p, nil
}

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Err is the process's exit error, valid after Done is closed.
func (p *Proc) Err() error { <-p.done; return p.err }

// Stop asks the process to end (SIGTERM to its group), kills it (SIGKILL)
// if it has not within grace, and waits for it.
func (p *Proc) Stop(grace time.Duration) {
	_ = syscall.Kill(-p.PID, syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		_ = syscall.Kill(-p.PID, syscall.SIGKILL)
		<-p.done
	}
	p.lab.mu.Lock()
	delete(p.lab.procs, p.PID)
	p.lab.mu.Unlock()
}

// Kill kills the process (SIGKILL to its group, no chance to clean up, as
// in a crash) and waits for it.
func (p *Proc) Kill() {
	_ = syscall.Kill(-p.PID, syscall.SIGKILL)
	<-p.done
	p.lab.mu.Lock()
	delete(p.lab.procs, p.PID)
	p.lab.mu.Unlock()
}

// Cut takes home i's WAN link down: the home is partitioned from the public
// segment (and from every other home) until Heal.
func (l *Lab) Cut(i int) error {
	if i < 0 || i >= len(l.Homes) {
		return fmt.Errorf("netlab: no home %d", i)
	}
	return l.ip("-n", l.Public, "link", "set", fmt.Sprintf("w%d", i), "down")
}

// Heal brings home i's WAN link back up.
func (l *Lab) Heal(i int) error {
	if i < 0 || i >= len(l.Homes) {
		return fmt.Errorf("netlab: no home %d", i)
	}
	return l.ip("-n", l.Public, "link", "set", fmt.Sprintf("w%d", i), "up")
}

// Namespaces returns the lab's namespace names.
func (l *Lab) Namespaces() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.nss...)
}

// Close kills the lab's processes and deletes its namespaces. It is safe to
// call more than once; later calls do nothing.
func (l *Lab) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	procs := make([]*Proc, 0, len(l.procs))
	for _, p := range l.procs {
		procs = append(procs, p)
	}
	nss := append([]string(nil), l.nss...)
	l.mu.Unlock()

	// All at once: a process may take its whole grace to stop (an agent
	// draining), and an interrupted run should not wait for each in turn.
	var wg sync.WaitGroup
	for _, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.Stop(2 * time.Second)
		}()
	}
	wg.Wait()
	var errs []error
	for i := len(nss) - 1; i >= 0; i-- {
		if err := removeNS(nss[i]); err != nil {
			errs = append(errs, err)
		}
	}
	openMu.Lock()
	delete(openLabs, l)
	openMu.Unlock()
	return errors.Join(errs...)
}

// removeNS kills whatever still runs in ns (processes not started through
// Start, e.g. children that escaped their group) and deletes it.
func removeNS(ns string) error {
	if out, err := exec.Command("ip", "netns", "pids", ns).Output(); err == nil {
		for _, f := range strings.Fields(string(out)) {
			if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	out, err := exec.Command("ip", "netns", "del", ns).CombinedOutput()
	if err != nil && !bytes.Contains(out, []byte("No such file")) {
		return fmt.Errorf("ip netns del %s: %w: %s", ns, err, bytes.TrimSpace(out))
	}
	return nil
}

// nsNameRE matches lab namespace names: prefix-pid-rand-role.
var nsNameRE = regexp.MustCompile(`^([a-z0-9]{1,12})-([0-9]+)-([0-9a-f]{4})-[a-z0-9]+$`)

// ListNamespaces returns the names of lab namespaces present on the machine
// whose prefix is prefix ("" means any prefix).
func ListNamespaces(prefix string) []string {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return nil
	}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		m := nsNameRE.FindStringSubmatch(f[0])
		if m == nil || (prefix != "" && m[1] != prefix) {
			continue
		}
		names = append(names, f[0])
	}
	return names
}

// Sweep deletes lab namespaces left by processes that no longer exist (a
// run killed outright). Labs of live processes are left alone.
func Sweep() {
	for _, ns := range ListNamespaces("") {
		m := nsNameRE.FindStringSubmatch(ns)
		pid, err := strconv.Atoi(m[2])
		if err != nil || pid == os.Getpid() {
			continue
		}
		if err := syscall.Kill(pid, 0); err == nil || errors.Is(err, syscall.EPERM) {
			continue // creator alive
		}
		_ = removeNS(ns)
	}
}
