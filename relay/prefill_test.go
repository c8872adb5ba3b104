package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/computeflux/computeflux/transport"
)

// A streamed request beyond an agent's prefill limit waits at the relay,
// though the agent has free slots, until the prompt ahead of it begins to
// answer; non-streamed requests are not held by the limit.
func TestPrefillLimitHoldsStreamsAtTheRelay(t *testing.T) {
	tb := newTestbed(t, nil, func(c *Config) { c.PrefillLimit = 256 }) // 4 blocks of 64 tokens
	e := newEngine(t, "a")
	p := peer.ID("peer-a")
	tb.ft.mu.Lock()
	tb.ft.to[p.String()] = mustURL(e.srv.URL)
	tb.ft.mu.Unlock()
	if err := tb.relay.Registry().Joined(p, transport.JoinInfo{Name: "a", Models: []string{"m1"}, Capacity: 8}); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var arrived []string
	begin := make(chan struct{}, 10) // one per request: send the first chunk
	end := make(chan struct{}, 10)   // one per request: finish the answer
	e.set(func(w http.ResponseWriter, r *http.Request, body []byte) {
		var req struct {
			Stream   bool `json:"stream"`
			Messages []struct {
				Content string `json:"content"`
			} `json:"messages"`
		}
		_ = json.Unmarshal(body, &req)
		mu.Lock()
		arrived = append(arrived, req.Messages[0].Content[:1])
		mu.Unlock()
		for _, ch := range []chan struct{}{begin, end} {
			select {
			case <-ch:
			case <-r.Context().Done():
				return
			}
			if ch == begin && req.Stream {
				w.Header().Set("Content-Type", "text/event-stream")
				fmt.Fprint(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":null}]}\n\n")
				w.(http.Flusher).Flush()
			}
		}
		if req.Stream {
			fmt.Fprint(w, "data: [DONE]\n\n")
			return
		}
		defaultEngine(w, r, body, "a")
	})
	got := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), arrived...)
	}
	// Prompts of about 3,000 bytes: some 11 blocks each, past the limit.
	send := func(tag string, stream bool) <-chan int {
		extra := ""
		if stream {
			extra = `,"stream":true`
		}
		return tb.sendPrompt(context.Background(), testKey, tag+strings.Repeat(" word"+tag, 500), extra)
	}

	first := send("a", true)
	waitFor(t, "the first prompt at the engine", func() bool { return len(got()) == 1 })
	second := send("b", true)
	tb.waitQueued(1)
	time.Sleep(100 * time.Millisecond) // two dispatcher ticks: it stays
	if n := len(got()); n != 1 || tb.relay.queue.q.Len() != 1 {
		t.Fatalf("%d at the engine, %d waiting; want the second prompt held at the relay behind the first's prefill", n, tb.relay.queue.q.Len())
	}
	begin <- struct{}{} // the first answer begins: its prompt is prefilled
	waitFor(t, "the second prompt at the engine", func() bool { return len(got()) == 2 })

	begin <- struct{}{} // the second answer begins too

	// Non-streamed requests are not counted: their first byte comes with
	// the whole answer. Two of them reach the engine at once.
	third, fourth := send("c", false), send("d", false)
	waitFor(t, "both non-streamed requests at the engine", func() bool { return len(got()) == 4 })
	for range 2 {
		begin <- struct{}{}
	}
	for range 4 {
		end <- struct{}{}
	}
	for i, d := range []<-chan int{first, second, third, fourth} {
		if st := <-d; st != http.StatusOK {
			t.Fatalf("request %d: status %d", i, st)
		}
	}
	if g := got(); fmt.Sprint(g[:2]) != "[a b]" || len(g) != 4 {
		t.Fatalf("the engine got %v", got())
	}
}
