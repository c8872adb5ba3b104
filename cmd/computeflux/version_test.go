package main

import (
	"context"
	"io"
	"strings"
	"testing"
)

func TestVersion(t *testing.T) {
	var out strings.Builder
	if err := dispatch(context.Background(), []string{"version"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "computeflux ") || !strings.Contains(out.String(), "(commit ") {
		t.Fatalf("version printed %q", out.String())
	}
	old := commit
	commit = "abc123"
	defer func() { commit = old }()
	if _, rev := buildVersion(); rev != "abc123" {
		t.Fatalf("commit set at build time not used: %q", rev)
	}
	if err := dispatch(context.Background(), []string{"version", "x"}, io.Discard, io.Discard); err == nil {
		t.Fatal("extra argument accepted")
	}
}
