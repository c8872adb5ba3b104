package relay

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/computeflux/computeflux/relay/relaytest/slow"
)

// cdp drives a headless Chromium over the DevTools protocol on a pipe
// (--remote-debugging-pipe: commands on fd 3, answers on fd 4, each message
// ending in a NUL byte), so no library and no port is needed.
type cdp struct {
	t      *testing.T
	cmd    *exec.Cmd
	in     *os.File // we write commands
	mu     sync.Mutex
	nextID int
	wait   map[int]chan json.RawMessage
	errs   map[int]string
	done   chan struct{}
}

func findChromium() string {
	for _, n := range []string{"chromium", "chromium-browser", "google-chrome", "chrome"} {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	return ""
}

func startChromium(t *testing.T) *cdp {
	t.Helper()
	bin := findChromium()
	if bin == "" {
		t.Skip("no chromium on PATH (Debian: apt-get install chromium); the status page browser test needs it")
	}
	cmdR, cmdW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	resR, resW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
		"--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
		"--hide-scrollbars", "--window-size=1480,560", "--remote-debugging-pipe",
		"--user-data-dir="+t.TempDir(), "about:blank")
	cmd.ExtraFiles = []*os.File{cmdR, resW}
	// Its own process group: Chromium's helpers (zygote, renderers) die
	// with it, so none writes to the profile while the test removes it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmdR.Close()
	resW.Close()
	c := &cdp{t: t, cmd: cmd, in: cmdW, wait: map[int]chan json.RawMessage{}, errs: map[int]string{}, done: make(chan struct{})}
	go c.read(resR)
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
		cmdW.Close()
		<-c.done
		resR.Close()
	})
	return c
}

func (c *cdp) read(r *os.File) {
	defer close(c.done)
	br := bufio.NewReader(r)
	for {
		msg, err := br.ReadBytes(0)
		if err != nil {
			return
		}
		var m struct {
			ID     int             `json:"id"`
			Result json.RawMessage `json:"result"`
			Error  *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(msg[:len(msg)-1], &m) != nil || m.ID == 0 {
			continue // events
		}
		c.mu.Lock()
		ch := c.wait[m.ID]
		if m.Error != nil {
			c.errs[m.ID] = m.Error.Message
		}
		c.mu.Unlock()
		if ch != nil {
			ch <- m.Result
		}
	}
}

// call sends a command (to a page session when session is set) and returns
// its result.
func (c *cdp) call(session, method string, params any, out any) {
	c.t.Helper()
	c.mu.Lock()
	c.nextID++
	id := c.nextID
	ch := make(chan json.RawMessage, 1)
	c.wait[id] = ch
	c.mu.Unlock()
	msg := map[string]any{"id": id, "method": method, "params": params}
	if session != "" {
		msg["sessionId"] = session
	}
	b, _ := json.Marshal(msg)
	if _, err := c.in.Write(append(b, 0)); err != nil {
		c.t.Fatalf("%s: %v", method, err)
	}
	select {
	case res := <-ch:
		c.mu.Lock()
		e := c.errs[id]
		c.mu.Unlock()
		if e != "" {
			c.t.Fatalf("%s: %s", method, e)
		}
		if out != nil {
			if err := json.Unmarshal(res, out); err != nil {
				c.t.Fatalf("%s: %v", method, err)
			}
		}
	case <-c.done:
		c.t.Fatalf("%s: chromium exited", method)
	case <-time.After(30 * time.Second):
		c.t.Fatalf("%s: no answer in 30 s", method)
	}
}

// open loads url in a new tab and returns its session.
func (c *cdp) open(url string) string {
	var tgt struct{ TargetID string }
	c.call("", "Target.createTarget", map[string]any{"url": url}, &tgt)
	var att struct{ SessionID string }
	c.call("", "Target.attachToTarget", map[string]any{"targetId": tgt.TargetID, "flatten": true}, &att)
	return att.SessionID
}

// eval evaluates a JavaScript expression in the page and returns its value
// as a string.
func (c *cdp) eval(session, expr string) string {
	var res struct {
		Result struct {
			Value any `json:"value"`
		} `json:"result"`
	}
	c.call(session, "Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true}, &res)
	return fmt.Sprint(res.Result.Value)
}

func (c *cdp) waitEval(session, what, expr, want string) {
	c.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := c.eval(session, expr)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("page never showed %s: %s = %q, want %q", what, expr, got, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// The status page in a real headless browser: it asks for the admin key,
// then shows every joined agent and the provider, and updates itself as
// requests come. With COMPUTEFLUX_SCREENSHOT=FILE it saves a screenshot
// (the README's).
func TestStatusPageBrowser(t *testing.T) {
	slow.Gate(t, "drives headless chromium")
	fp := newFakeProvider(t, "cloud-api", []string{"m1"}, "k1", "k2")
	tb, _ := providerBed(t, []string{"gpu-attic", "gpu-desk", "gpu-garage"},
		fmt.Sprintf("endpoints:\n  - {name: cloud-api, url: %s, keys: [k1, k2], models: [m1], max_concurrency: 64}\n", fp.url()),
		func(c *Config) { c.AdminKey = adminKey })
	srv := adminServer(t, tb.relay)
	br := startChromium(t)

	page := br.open(srv.URL + "/status")
	br.waitEval(page, "the key form", `document.getElementById("keyform").style.display`, "block")
	br.eval(page, fmt.Sprintf(`sessionStorage.setItem("computeflux-admin-key", %q); refresh(); "ok"`, adminKey))
	names := `Array.from(document.querySelectorAll("#rows tr")).map(r => r.dataset.name).join(",")`
	br.waitEval(page, "every endpoint", names, "gpu-attic,gpu-desk,gpu-garage,cloud-api")
	before := br.eval(page, `document.body.dataset.updates`)

	fp.set("k1", answerStatus(429, "60"))
	for i := range 40 {
		tb.chat(fmt.Sprintf("chat-%d", i%12))
	}
	// The provider takes the overflow when home is disabled.
	if err := tb.relay.SetAdmin("gpu-garage", "disable", 0); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"gpu-attic", "gpu-desk"} {
		if err := tb.relay.SetAdmin(n, "drain", 0); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 6 {
		tb.chat(fmt.Sprintf("over-%d", i))
	}
	for _, n := range []string{"gpu-attic", "gpu-desk"} {
		if err := tb.relay.SetAdmin(n, "undrain", 0); err != nil {
			t.Fatal(err)
		}
	}
	br.waitEval(page, "the sessions", `document.getElementById("sessions").textContent`, "18")
	br.waitEval(page, "the disabled agent", `document.querySelector('#rows tr[data-name="gpu-garage"] td:nth-child(3)').textContent`, "disabled")
	br.waitEval(page, "the limited key", `document.querySelector('#rows tr[data-name="cloud-api"] td:nth-child(12)').textContent`, "#1 open, #2 closed")
	// A quarantine shows with its evidence (here the operator's words).
	if br.eval(page, `String(document.getElementById("quarantine").hidden)`) != "true" {
		t.Error("the quarantine table shows with nobody in quarantine")
	}
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/admin/v1/audits/quarantine",
		strings.NewReader(`{"agent":"gpu-desk","model":"m1","reason":"wrong answers reported"}`))
	req.Header.Set("Authorization", "Bearer "+adminKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("quarantine by hand: %s", resp.Status)
	}
	quarantined := `(() => { const c = Array.from(document.querySelectorAll('#qrows tr[data-agent="gpu-desk"] td')).map(c => c.textContent);
		return [c[0], c[1], c[3], c[4]].join("|"); })()`
	br.waitEval(page, "the quarantine", quarantined, "gpu-desk|m1|operator|by the operator: wrong answers reported")
	after := br.eval(page, `document.body.dataset.updates`)
	if after == before {
		t.Fatalf("the page did not refresh (%s updates)", after)
	}
	if got := br.eval(page, `document.getElementById("hit").textContent`); !strings.HasSuffix(got, "%") {
		t.Fatalf("hit ratio shows %q", got)
	}
	if out := os.Getenv("COMPUTEFLUX_SCREENSHOT"); out != "" {
		var shot struct{ Data string }
		br.call(page, "Page.captureScreenshot", map[string]any{"format": "png"}, &shot)
		png, err := base64.StdEncoding.DecodeString(shot.Data)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(out, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot written to %s", out)
	}
}

// The status page shows who waits for room: a heavy client's backlog and
// a light client's request behind the one request the agent can take.
func TestStatusPageShowsQueue(t *testing.T) {
	slow.Gate(t, "drives headless chromium")
	tb, g := queueBed(t, func(c *Config) { c.AdminKey = adminKey }, queueClients)
	srv := adminServer(t, tb.relay)
	br := startChromium(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := []<-chan int{tb.send(ctx, "sk-heavy", "")}
	waitFor(t, "the first request at the engine", func() bool { return len(g.arrived()) == 1 })
	for i := range 3 {
		done = append(done, tb.send(ctx, "sk-heavy", ""))
		tb.waitQueued(i + 1)
	}
	done = append(done, tb.send(ctx, "sk-light", ""))
	tb.waitQueued(4)

	page := br.open(srv.URL + "/status")
	br.waitEval(page, "the key form", `document.getElementById("keyform").style.display`, "block")
	br.eval(page, fmt.Sprintf(`sessionStorage.setItem("computeflux-admin-key", %q); refresh(); "ok"`, adminKey))
	br.waitEval(page, "the requests waiting", `document.getElementById("waiting").textContent`, "4")
	br.waitEval(page, "the waiting clients", `Array.from(document.querySelectorAll("#queue tr")).map(r => r.dataset.client + ":" + r.children[3].textContent).join(",")`, "heavy:3,light:1")
	for range len(done) {
		g.release <- struct{}{}
	}
	for i, d := range done {
		if st := <-d; st != http.StatusOK {
			t.Fatalf("request %d: status %d", i, st)
		}
	}
	br.waitEval(page, "the queue emptied", `document.getElementById("waiting").textContent`, "0")
}

// The status page shows the ledger's last day by client and by agent, with
// the share of prompt tokens the cache served.
func TestStatusPageShowsUsage(t *testing.T) {
	slow.Gate(t, "drives headless chromium")
	l := openLedger(t, filepath.Join(t.TempDir(), "ledger.db"))
	tb, _ := providerBed(t, []string{"gpu-attic"}, "endpoints: []\n", func(c *Config) {
		c.AdminKey = adminKey
		c.Ledger = l
	})
	for i := range 5 {
		if st, _, body := tb.chat(fmt.Sprintf("u-%d", i)); st != http.StatusOK {
			t.Fatalf("chat: %d %s", st, body)
		}
	}
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	srv := adminServer(t, tb.relay)
	br := startChromium(t)
	page := br.open(srv.URL + "/status")
	br.waitEval(page, "the key form", `document.getElementById("keyform").style.display`, "block")
	br.eval(page, fmt.Sprintf(`sessionStorage.setItem("computeflux-admin-key", %q); refresh(); "ok"`, adminKey))
	client := keyClientName(sha256.Sum256([]byte(testKey)))
	// The fake engine's answers say 3 prompt and 3 completion tokens.
	br.waitEval(page, "the client's day", `Array.from(document.querySelectorAll("#usageClients tr")).map(r => r.dataset.key + ":" + r.children[1].textContent + ":" + r.children[2].textContent).join(",")`, client+":5:15")
	br.waitEval(page, "the agent's day", `Array.from(document.querySelectorAll("#usageAgents tr")).map(r => r.dataset.key + ":" + r.children[1].textContent + ":" + r.children[4].textContent).join(",")`, "gpu-attic:5:15")
}
