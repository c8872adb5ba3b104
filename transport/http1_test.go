package transport

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"testing"
	"time"
)

// Tests of NewHTTP1RoundTripper against a stock net/http server over TCP.

func http1Post(t *testing.T, rt http.RoundTripper, ctx context.Context, url, body string) (*http.Response, error) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	return rt.RoundTrip(req)
}

func TestHTTP1ReusesConnectionsAndReplacesClosedOnes(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s %s", r.URL.Path, b)
	}))
	defer srv.Close()
	rt := NewHTTP1RoundTripper(nil)
	defer rt.(interface{ CloseIdleConnections() }).CloseIdleConnections()
	reused := 0
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) {
			if i.Reused {
				reused++
			}
		},
	})
	for i := range 6 {
		if i == 3 {
			// The server drops its idle connections (as an engine's
			// keep-alive timeout does): the next request must still work.
			srv.CloseClientConnections()
		}
		resp, err := http1Post(t, rt, ctx, srv.URL+"/v1/x", fmt.Sprint(i))
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(b) != fmt.Sprintf("/v1/x %d", i) {
			t.Fatalf("request %d: %q, %v", i, b, err)
		}
	}
	// Requests 1, 2 reuse; 3 finds its idle connection dead and is sent
	// again on a new one (counted reused once); 4, 5 reuse.
	if reused < 4 {
		t.Fatalf("%d requests reused a connection, want at least 4", reused)
	}
}

func TestHTTP1StreamsEventsAndCancels(t *testing.T) {
	next := make(chan struct{})
	ended := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; ; i++ {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				close(ended)
				return
			}
		}
	}))
	defer srv.Close()
	rt := NewHTTP1RoundTripper(nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, err := http1Post(t, rt, ctx, srv.URL+"/v1/chat/completions", "{}")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := br.ReadString('\n')
		if err != nil || line != fmt.Sprintf("data: %d\n", i) {
			t.Fatalf("event %d: %q, %v", i, line, err)
		}
		br.ReadString('\n')
		next <- struct{}{}
	}
	cancel()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the server's handler did not see the client cancel")
	}
	if _, err := io.ReadAll(br); !errors.Is(err, context.Canceled) {
		t.Fatalf("read after cancel: %v", err)
	}
}

func TestHTTP1RejectsOtherSchemes(t *testing.T) {
	req, _ := http.NewRequest(http.MethodGet, "https://127.0.0.1:1/", nil)
	if _, err := NewHTTP1RoundTripper(nil).RoundTrip(req); err == nil {
		t.Fatal("an https URL was accepted")
	}
}
