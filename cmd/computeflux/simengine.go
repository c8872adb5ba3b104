package main

import (
	"context"
	"errors"
	"io"
)

func runSimEngine(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return errors.New("sim-engine: not built yet")
}
