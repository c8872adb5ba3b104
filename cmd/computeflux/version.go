package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// version and commit are set at build time (scripts/install.sh does):
// -ldflags "-X main.version=v1.2.3 -X main.commit=abc123". Empty version
// means the module's version from the build information, or "dev"; empty
// commit means the one Go recorded (vcs.revision), if any.
var version, commit string

// buildVersion returns the version and the commit the binary was built
// from ("unknown" when the build recorded none; "-dirty" when the tree had
// changes).
func buildVersion() (ver, rev string) {
	ver, rev = version, "unknown"
	bi, ok := debug.ReadBuildInfo()
	if ver == "" {
		ver = "dev"
		if ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			ver = bi.Main.Version
		}
	}
	if commit != "" {
		return ver, commit
	}
	if !ok {
		return ver, rev
	}
	dirty := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if dirty && rev != "unknown" {
		rev += "-dirty"
	}
	return ver, rev
}

func runVersion(_ context.Context, args []string, stdout, _ io.Writer) error {
	if len(args) > 0 {
		return fmt.Errorf("version: unexpected arguments %q", args)
	}
	ver, rev := buildVersion()
	fmt.Fprintf(stdout, "computeflux %s (commit %s, %s, %s/%s)\n", ver, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return nil
}
