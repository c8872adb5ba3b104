package main

import (
	"context"
	"errors"
	"io"
)

func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return errors.New("relay: not built yet")
}
