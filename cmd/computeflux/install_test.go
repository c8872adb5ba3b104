package main

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// installScript is scripts/install.sh, from this package's directory.
var installScript = filepath.Join("..", "..", "scripts", "install.sh")

func runInstall(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("bash", append([]string{installScript}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("install.sh %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// treeState lists every file under root with its mode, content hash and
// modification time.
func treeState(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		line := fmt.Sprintf("%s %v %d", strings.TrimPrefix(p, root), info.Mode(), info.ModTime().UnixNano())
		if d.Type().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			h := sha256.Sum256(b)
			line += " " + hex.EncodeToString(h[:8])
		}
		out = append(out, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

// envLookup reads an installed env file as the service would see it, with
// /etc/computeflux moved under root.
func envLookup(t *testing.T, root, file string) func(string) (string, bool) {
	t.Helper()
	f, err := os.Open(filepath.Join(root, "etc", "computeflux", file))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || !strings.HasPrefix(k, "COMPUTEFLUX_") {
			t.Fatalf("%s: line %q is not COMPUTEFLUX_NAME=value", file, line)
		}
		env[k] = strings.ReplaceAll(v, "/etc/computeflux", filepath.Join(root, "etc", "computeflux"))
	}
	return func(k string) (string, bool) { v, ok := env[k]; return v, ok }
}

// TestInstallScript installs into a temporary root twice (the second run
// changes nothing), checks the units' hardening and, where systemd-analyze
// is installed, verifies them; checks that the env files are settings both
// commands accept; then uninstalls.
func TestInstallScript(t *testing.T) {
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("bash is not installed")
	}
	root := t.TempDir()
	bin := filepath.Join(t.TempDir(), "computeflux")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\necho computeflux\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	first := runInstall(t, "--root", root, "--binary", bin)
	before := treeState(t, root)
	second := runInstall(t, "--root", root, "--binary", bin)
	if after := treeState(t, root); strings.Join(after, "\n") != strings.Join(before, "\n") {
		t.Fatalf("the second run changed the tree:\nbefore\n%s\nafter\n%s", strings.Join(before, "\n"), strings.Join(after, "\n"))
	}
	if !strings.Contains(second, "nothing to change") || strings.Contains(second, "installed ") || strings.Contains(second, "created ") {
		t.Fatalf("second run:\n%s", second)
	}
	for _, f := range []string{"usr/local/bin/computeflux", "usr/lib/sysusers.d/computeflux.conf", "etc/computeflux/api-keys", "etc/computeflux/join-token"} {
		if !strings.Contains(first, "/"+f) {
			t.Errorf("first run did not report %s:\n%s", f, first)
		}
	}
	for _, f := range []string{"etc/computeflux/api-keys", "etc/computeflux/join-token", "etc/computeflux/relay.env"} {
		if st, err := os.Stat(filepath.Join(root, f)); err != nil || st.Mode().Perm()&0o007 != 0 {
			t.Errorf("%s: readable by others or missing (%v)", f, err)
		}
	}
	for _, u := range []string{"computeflux-relay.service", "computeflux-agent.service"} {
		b, err := os.ReadFile(filepath.Join(root, "etc", "systemd", "system", u))
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"NoNewPrivileges=yes", "ProtectSystem=strict", "StateDirectory=computeflux", "Restart=on-failure",
			"User=computeflux", "EnvironmentFile=/etc/computeflux/", "ExecStart=/usr/local/bin/computeflux "} {
			if !strings.Contains(string(b), want) {
				t.Errorf("%s lacks %s", u, want)
			}
		}
		// Only the relay may bind :80 and :443 (--domain); the agent gets no capability.
		caps := ""
		if u == "computeflux-relay.service" {
			caps = "CAP_NET_BIND_SERVICE"
		}
		for _, want := range []string{"\nAmbientCapabilities=" + caps + "\n", "\nCapabilityBoundingSet=" + caps + "\n"} {
			if !strings.Contains(string(b), want) {
				t.Errorf("%s lacks %q", u, strings.TrimSpace(want))
			}
		}
	}

	// The settings are what the commands accept.
	if _, files, err := relayConfig(nil, envLookup(t, root, "relay.env"), io.Discard); err != nil || files.ledger != "/var/lib/computeflux/relay-usage.db" {
		t.Errorf("relay.env: %v (usage ledger %q, want it in the unit's state directory)", err, files.ledger)
	}
	agentEnv := envLookup(t, root, "agent.env")
	cfg, err := agentConfig(nil, agentEnv, io.Discard)
	if err != nil || cfg.IdentityFile != "/var/lib/computeflux/agent.key" {
		t.Errorf("agent.env: %v (identity %q)", err, cfg.IdentityFile)
	}

	if sa, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Log("systemd-analyze is not installed: the units were not verified (Debian's systemd package provides it)")
	} else {
		// verify --root needs the system's own units (sysinit.target, ...).
		sys := filepath.Join(root, "usr", "lib", "systemd", "system")
		if err := os.MkdirAll(filepath.Dir(sys), 0o755); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("cp", "-a", "/usr/lib/systemd/system", sys).CombinedOutput(); err != nil {
			t.Fatalf("copy system units: %v %s", err, out)
		}
		out, err := exec.Command(sa, "verify", "--man=no", "--root="+root,
			filepath.Join(root, "etc", "systemd", "system", "computeflux-relay.service"),
			filepath.Join(root, "etc", "systemd", "system", "computeflux-agent.service")).CombinedOutput()
		if err != nil || len(strings.TrimSpace(string(out))) > 0 {
			t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
		}
		t.Log("systemd-analyze verify: both units pass")
	}

	out := runInstall(t, "--root", root, "--uninstall")
	for _, gone := range []string{"usr/local/bin/computeflux", "etc/systemd/system/computeflux-relay.service", "etc/systemd/system/computeflux-agent.service"} {
		if _, err := os.Stat(filepath.Join(root, gone)); err == nil {
			t.Errorf("%s left after --uninstall:\n%s", gone, out)
		}
	}
	if _, err := os.Stat(filepath.Join(root, "etc", "computeflux", "join-token")); err != nil {
		t.Errorf("--uninstall removed the settings: %v", err)
	}
}

// TestInstallLive installs into the running system as root (CI sets
// COMPUTEFLUX_INSTALL_LIVE=1), twice, then uninstalls and removes what the
// test created. It starts no service. It is skipped unless root, or when a
// computeflux installation or user is already there.
func TestInstallLive(t *testing.T) {
	if os.Getenv("COMPUTEFLUX_INSTALL_LIVE") != "1" || os.Geteuid() != 0 {
		t.Skip("installs into / as root: set COMPUTEFLUX_INSTALL_LIVE=1 and run as root")
	}
	if _, err := exec.Command("getent", "passwd", "computeflux").Output(); err == nil {
		t.Skip("a computeflux user exists already; not touching this system")
	}
	for _, p := range []string{"/usr/local/bin/computeflux", "/etc/computeflux", "/etc/systemd/system/computeflux-relay.service"} {
		if _, err := os.Stat(p); err == nil {
			t.Skipf("%s exists already; not touching this system", p)
		}
	}
	t.Cleanup(func() {
		_ = exec.Command("bash", installScript, "--uninstall").Run()
		_ = exec.Command("userdel", "computeflux").Run()
		_ = exec.Command("groupdel", "computeflux").Run()
		_ = os.RemoveAll("/etc/computeflux")
	})
	bin := filepath.Join(t.TempDir(), "computeflux")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\necho computeflux\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	runInstall(t, "--binary", bin)
	if out, err := exec.Command("getent", "passwd", "computeflux").Output(); err != nil || !strings.Contains(string(out), "/var/lib/computeflux") {
		t.Fatalf("user not created: %v %s", err, out)
	}
	if out, _ := exec.Command("stat", "-c", "%G %a", "/etc/computeflux/join-token").Output(); strings.TrimSpace(string(out)) != "computeflux 640" {
		t.Fatalf("join-token owner and mode: %s", out)
	}
	if second := runInstall(t, "--binary", bin); !strings.Contains(second, "nothing to change") {
		t.Fatalf("second run:\n%s", second)
	}
	runInstall(t, "--uninstall")
	if _, err := os.Stat("/usr/local/bin/computeflux"); err == nil {
		t.Fatal("binary left after --uninstall")
	}
}
