package main

import (
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/rs/zerolog"
)

// flagsFromEnv sets every flag not given on the command line from the
// environment variable COMPUTEFLUX_<NAME> (upper case, '-' as '_'), if set.
// It stops at the first value a flag refuses.
func flagsFromEnv(fs *flag.FlagSet, lookupEnv func(string) (string, bool)) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] || err != nil {
			return
		}
		name := "COMPUTEFLUX_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := lookupEnv(name); ok {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("%s: %w", name, e)
			}
		}
	})
	return err
}

// logFlags are the --log-format and --log-level flags of the long-running
// commands.
type logFlags struct{ format, level string }

func (l *logFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&l.format, "log-format", "console", "log format: console or json")
	fs.StringVar(&l.level, "log-level", "info", "log level: debug, info, warn, error")
}

// logger returns the logger the flags ask for, writing to w with
// timestamps.
func (l *logFlags) logger(w io.Writer) (zerolog.Logger, error) {
	level, err := zerolog.ParseLevel(l.level)
	if err != nil {
		return zerolog.Logger{}, fmt.Errorf("--log-level: %w", err)
	}
	switch l.format {
	case "json":
		return zerolog.New(w).Level(level).With().Timestamp().Logger(), nil
	case "console":
		return zerolog.New(zerolog.ConsoleWriter{Out: w, TimeFormat: time.TimeOnly, NoColor: true}).Level(level).With().Timestamp().Logger(), nil
	default:
		return zerolog.Logger{}, fmt.Errorf("--log-format %q: want console or json", l.format)
	}
}
