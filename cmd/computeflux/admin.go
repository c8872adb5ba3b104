package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/computeflux/computeflux/relay"
)

// operatorFlags are the relay's flags for provider endpoints and the
// operator's controls.
type operatorFlags struct {
	endpointsFile, adminKeyFile, adminListen string
	statusPublic                             bool
	maxAgentWeight                           float64
}

func (o *operatorFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&o.endpointsFile, "endpoints-file", "", "YAML (or JSON) `file` of provider endpoints and agent settings; reloaded on SIGHUP")
	fs.StringVar(&o.adminKeyFile, "admin-key-file", "", "`file` holding the admin API's key (none: no admin API)")
	fs.StringVar(&o.adminListen, "admin-listen", relay.DefaultAdminListen, "listen `address` of the admin API and status page")
	fs.BoolVar(&o.statusPublic, "status-public", false, "serve the status page and its data without the admin key")
	fs.Float64Var(&o.maxAgentWeight, "max-agent-weight", relay.DefaultMaxAgentWeight, "cap on the weight an agent declares")
}

func (o *operatorFlags) apply(cfg *relay.Config) error {
	cfg.EndpointsFile, cfg.AdminListen, cfg.StatusPublic, cfg.MaxAgentWeight = o.endpointsFile, o.adminListen, o.statusPublic, o.maxAgentWeight
	if o.adminKeyFile != "" {
		k, err := readKeyFile(o.adminKeyFile)
		if err != nil {
			return fmt.Errorf("--admin-key-file: %w", err)
		}
		cfg.AdminKey = k
	}
	return nil
}

// readKeyFile reads a one-key file (surrounding white space trimmed).
func readKeyFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	k := strings.TrimSpace(string(b))
	if k == "" || strings.ContainsAny(k, " \t\r\n") {
		return "", fmt.Errorf("%s must hold one key on one line", path)
	}
	return k, nil
}

// reloadOnHangup reloads the relay's endpoints file on every SIGHUP until
// ctx ends or the returned function is called. A failed reload leaves the
// table in force (the relay logs why).
func reloadOnHangup(ctx context.Context, r *relay.Relay) (stop func()) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGHUP)
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case <-ch:
				_ = r.ReloadEndpoints(ctx)
			}
		}
	}()
	return func() {
		signal.Stop(ch)
		cancel()
		wg.Wait()
	}
}

// adminClient calls a relay's admin API.
type adminClient struct {
	base string
	key  string
	hc   *http.Client
}

// adminClientFlags returns the flag set of the commands that call the admin
// API: --admin-url and --admin-key-file (or COMPUTEFLUX_ADMIN_URL and
// COMPUTEFLUX_ADMIN_KEY_FILE).
func adminClientFlags(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.String("admin-url", "http://"+relay.DefaultAdminListen, "the relay admin API's base `URL`")
	fs.String("admin-key-file", "", "`file` holding the admin key")
	return fs
}

// newAdminClient builds the client from parsed flags and the environment.
func newAdminClient(fs *flag.FlagSet) (*adminClient, error) {
	if err := flagsFromEnv(fs, os.LookupEnv); err != nil {
		return nil, err
	}
	keyFile := fs.Lookup("admin-key-file").Value.String()
	if keyFile == "" {
		return nil, errors.New("--admin-key-file is required")
	}
	k, err := readKeyFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("--admin-key-file: %w", err)
	}
	base := fs.Lookup("admin-url").Value.String()
	return &adminClient{base: strings.TrimRight(base, "/"), key: k, hc: &http.Client{Timeout: 10 * time.Second}}, nil
}

func (c *adminClient) do(ctx context.Context, method, path string, body any, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+c.key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		var e struct {
			Error struct{ Message string } `json:"error"`
		}
		if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
			return fmt.Errorf("%s %s: %d: %s", method, path, resp.StatusCode, e.Error.Message)
		}
		return fmt.Errorf("%s %s: %d", method, path, resp.StatusCode)
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// runStatus prints the relay's routing table.
func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := adminClientFlags("status", stderr)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("status: unexpected arguments %q", fs.Args())
	}
	c, err := newAdminClient(fs)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	var out struct {
		Endpoints []relay.TableRow `json:"endpoints"`
	}
	if err := c.do(ctx, http.MethodGet, "/admin/v1/endpoints", nil, &out); err != nil {
		return fmt.Errorf("status: %w", err)
	}
	printTable(stdout, out.Endpoints, time.Now())
	return nil
}

// printTable writes the routing table for a terminal.
func printTable(w io.Writer, rows []relay.TableRow, now time.Time) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tKIND\tSTATE\tTIER\tWEIGHT\tBREAKER\tEWMA TTFT\tSUCCESS\tIN FLIGHT\tSESSIONS\tCOLD\tKEYS\tMODELS\tPATH\tRTT")
	for _, r := range rows {
		weight := strconv.FormatFloat(r.Weight, 'g', 4, 64)
		if r.WeightSource != "declared" {
			weight += " (" + r.WeightSource + ")"
		}
		breaker := r.Breaker
		if breaker == "" {
			breaker = "-"
		}
		if r.BreakerUntil != nil {
			breaker += fmt.Sprintf(" %.0fs", r.BreakerUntil.Sub(now).Seconds())
		}
		ttft := "-"
		if r.EWMATTFTMillis > 0 {
			ttft = fmt.Sprintf("%.1fms", r.EWMATTFTMillis)
		}
		inflight := strconv.Itoa(r.InFlight)
		if r.Capacity > 0 {
			inflight += "/" + strconv.Itoa(r.Capacity)
		}
		var keys []string
		for _, k := range r.Keys {
			s := fmt.Sprintf("#%d %s", k.N, k.State)
			if k.BreakerUntil != nil {
				s += fmt.Sprintf(" %.0fs", k.BreakerUntil.Sub(now).Seconds())
			}
			keys = append(keys, s)
		}
		rtt, path := "-", r.Path
		if r.RTTMillis > 0 {
			rtt = fmt.Sprintf("%.2fms", r.RTTMillis)
		}
		if path == "" {
			path = "-"
		}
		ks := strings.Join(keys, ", ")
		if ks == "" {
			ks = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%.0f%%\t%s\t%d\t%d\t%s\t%s\t%s\t%s\n",
			r.Name, r.Kind, r.State, r.Tier, weight, breaker, ttft, 100*r.SuccessRate, inflight, r.Sessions,
			r.ColdStartLeft, ks, strings.Join(r.Models, ","), path, rtt)
	}
	_ = tw.Flush()
}

// runAdmin calls one admin action: disable, enable, drain, undrain NAME, or
// weight NAME W.
func runAdmin(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := adminClientFlags("admin", stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: computeflux admin [flags] disable|enable|drain|undrain NAME")
		fmt.Fprintln(stderr, "       computeflux admin [flags] weight NAME W   (W = 0: back to the declared weight)")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	rest := fs.Args()
	if len(rest) < 2 {
		fs.Usage()
		return errUsage
	}
	action, name := rest[0], rest[1]
	var body any
	switch action {
	case "disable", "enable", "drain", "undrain":
		if len(rest) != 2 {
			fs.Usage()
			return errUsage
		}
	case "weight":
		if len(rest) != 3 {
			fs.Usage()
			return errUsage
		}
		w, err := strconv.ParseFloat(rest[2], 64)
		if err != nil {
			return fmt.Errorf("admin: weight %q: %w", rest[2], err)
		}
		body = map[string]float64{"weight": w}
	default:
		fs.Usage()
		return errUsage
	}
	c, err := newAdminClient(fs)
	if err != nil {
		return fmt.Errorf("admin: %w", err)
	}
	var row relay.TableRow
	if err := c.do(ctx, http.MethodPost, "/admin/v1/endpoints/"+url.PathEscape(name)+"/"+action, body, &row); err != nil {
		return fmt.Errorf("admin: %w", err)
	}
	printTable(stdout, []relay.TableRow{row}, time.Now())
	return nil
}
