package main

import (
	"context"
	"errors"
	"io"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return errors.New("demo: not built yet")
}
