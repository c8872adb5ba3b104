package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/computeflux/computeflux/agent/simengine"
)

// runSimEngine serves a simulated OpenAI-compatible engine with a prefix
// cache until ctx ends.
func runSimEngine(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := simEngineConfig(args, stderr)
	if err != nil {
		return err
	}
	srv, err := simengine.New(cfg)
	if err != nil {
		return err
	}
	if _, err := srv.Listen(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "sim-engine listening on %s (models: %s)\n", srv.URL(), strings.Join(srv.Config().Models, ", "))
	return srv.Run(ctx)
}

// simEngineConfig turns the command line into a simengine.Config.
func simEngineConfig(args []string, stderr io.Writer) (simengine.Config, error) {
	var cfg simengine.Config
	var models stringList
	var decodeMs, decodeSeqMs float64
	var seed uint64
	var logs logFlags
	fs := flag.NewFlagSet("sim-engine", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Listen, "listen", simengine.DefaultListen, "HTTP listen `address`")
	fs.Var(&models, "model", "model `name` to serve (repeatable; all names share one engine; default "+simengine.DefaultModel+")")
	fs.Float64Var(&cfg.TimeScale, "time-scale", simengine.DefaultTimeScale, "run the model this many times faster than real time")
	fs.IntVar(&cfg.Engine.CacheBlocks, "cache-blocks", simengine.DefaultCacheBlocks, "prefix cache capacity in blocks")
	fs.IntVar(&cfg.Engine.BlockSize, "block-size", simengine.DefaultBlockSize, "tokens per KV-cache block")
	fs.Float64Var(&cfg.Engine.PrefillTokensPerSec, "prefill-tokens-per-sec", simengine.DefaultPrefillTokensPerSec, "prompt tokens computed per second")
	fs.Float64Var(&decodeMs, "decode-ms-per-token", float64(simengine.DefaultDecodeTimePerToken)/1e6, "decode step time in ms with one running sequence")
	fs.Float64Var(&decodeSeqMs, "decode-ms-per-seq", float64(simengine.DefaultDecodeTimePerSeq)/1e6, "ms added to each decode step per extra running sequence")
	fs.IntVar(&cfg.Engine.MaxRunning, "max-running", simengine.DefaultMaxRunning, "maximum sequences in the batch")
	fs.IntVar(&cfg.Engine.MaxQueue, "max-queue", simengine.DefaultMaxQueue, "maximum waiting requests (negative: unbounded)")
	fs.IntVar(&cfg.Engine.MaxModelLen, "max-model-len", simengine.DefaultMaxModelLen, "maximum prompt plus completion tokens")
	fs.IntVar(&cfg.DefaultMaxTokens, "default-max-tokens", simengine.DefaultMaxTokens, "answer length when a request sets no max_tokens")
	fs.Uint64Var(&seed, "seed", 0, "seed of the generated answers")
	fs.BoolVar(&cfg.AdminRemote, "admin-remote", false, "let non-loopback clients use /admin/ endpoints")
	logs.register(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("sim-engine: unexpected arguments %q", fs.Args())
	}
	cfg.Models = models
	cfg.Engine.Seed = seed
	cfg.Engine.DecodeTimePerToken = time.Duration(decodeMs * float64(time.Millisecond))
	cfg.Engine.DecodeTimePerSeq = time.Duration(decodeSeqMs * float64(time.Millisecond))
	if decodeSeqMs == 0 {
		cfg.Engine.DecodeTimePerSeq = -1 // zero means the default in Config; the flag's 0 means none
	}
	var err error
	if cfg.Logger, err = logs.logger(stderr); err != nil {
		return cfg, fmt.Errorf("sim-engine: %w", err)
	}
	return cfg, nil
}

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(v string) error {
	if v == "" {
		return fmt.Errorf("empty value")
	}
	*l = append(*l, v)
	return nil
}
