package chaos

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync"
)

// front is a cheating contributor's engine: a proxy that sends what it
// takes for an audit to an engine of the model the agent claims, and
// everything else to one of another model. It takes for an audit what
// docs/audits.md described audits by before audits were sampled (greedy
// decoding with at most 32 tokens, or no user field), and, as a careful
// cheater would add, a prompt it was sent before and a user it never saw.
type front struct {
	url  string
	srv  *http.Server
	ln   net.Listener
	real *httputil.ReverseProxy
	fake *httputil.ReverseProxy

	mu           sync.Mutex // guards the following
	prompts      map[string]bool
	users        map[string]bool
	nReal, nFake int
}

func newFront(realURL, fakeURL string) (*front, error) {
	ru, err := url.Parse(realURL)
	if err != nil {
		return nil, err
	}
	fu, err := url.Parse(fakeURL)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	f := &front{ln: ln, url: "http://" + ln.Addr().String(), real: httputil.NewSingleHostReverseProxy(ru),
		fake: httputil.NewSingleHostReverseProxy(fu), prompts: map[string]bool{}, users: map[string]bool{}}
	f.real.FlushInterval, f.fake.FlushInterval = -1, -1
	f.srv = &http.Server{Handler: f}
	go func() { _ = f.srv.Serve(ln) }()
	return f, nil
}

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/chat/completions" || r.Method != http.MethodPost {
		f.real.ServeHTTP(w, r) // discovery, metrics: the real engine's
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	if f.looksLikeAudit(body) {
		f.real.ServeHTTP(w, r)
		return
	}
	f.fake.ServeHTTP(w, r)
}

// looksLikeAudit is the cheater's guess; it counts where each request
// went.
func (f *front) looksLikeAudit(body []byte) bool {
	var req struct {
		Temperature *float64 `json:"temperature"`
		MaxTokens   int      `json:"max_tokens"`
		User        *string  `json:"user"`
		Messages    json.RawMessage
	}
	_ = json.Unmarshal(body, &req)
	f.mu.Lock()
	defer f.mu.Unlock()
	audit := req.User == nil || (req.Temperature != nil && *req.Temperature == 0 && req.MaxTokens > 0 && req.MaxTokens <= 32)
	prompt := string(req.Messages)
	audit = audit || f.prompts[prompt]
	if req.User != nil {
		audit = audit || (len(f.users) > 0 && !f.users[*req.User])
		f.users[*req.User] = true
	}
	f.prompts[prompt] = true
	if audit {
		f.nReal++
	} else {
		f.nFake++
	}
	return audit
}

// counts returns the requests sent to the claimed model and to the other.
func (f *front) counts() (real, cheap int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.nReal, f.nFake
}

func (f *front) close() { _ = f.srv.Close() }
