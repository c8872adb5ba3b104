package main

import (
	"context"
	"errors"
	"io"
)

func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return errors.New("agent: not built yet")
}
