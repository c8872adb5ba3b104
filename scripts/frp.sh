#!/usr/bin/env bash
# Builds frp's frps and frpc from the Go module proxy, for the relay path
# benchmark's frp rows (computeflux bench --overhead):
#
#   scripts/frp.sh [DIR]     # writes DIR/frps and DIR/frpc (default /tmp/frp)
#   COMPUTEFLUX_FRPS=DIR/frps COMPUTEFLUX_FRPC=DIR/frpc computeflux bench --overhead
#
# frp's release archives come from GitHub; its module comes from the proxy
# like any Go dependency. The dashboards' web assets are not in the module,
# so they are built empty (the benchmark does not use them).
set -euo pipefail

version=v0.70.1
out=${1:-/tmp/frp}
mkdir -p "$out"
out=$(cd "$out" && pwd)
src=$(go mod download -json "github.com/fatedier/frp@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$src" ] || { echo "frp.sh: module github.com/fatedier/frp@$version not downloaded" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$src/." "$work"
chmod -R u+w "$work"
for d in web/frps web/frpc; do
  mkdir -p "$work/$d/dist"
  echo '<!doctype html><title>frp</title>' >"$work/$d/dist/index.html"
done
cd "$work"
GOFLAGS=-mod=mod go build -trimpath -o "$out/frps" ./cmd/frps
GOFLAGS=-mod=mod go build -trimpath -o "$out/frpc" ./cmd/frpc
echo "frp $version: $out/frps $out/frpc"
