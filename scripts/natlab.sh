#!/usr/bin/env bash
# natlab.sh: run ComputeFlux's NAT scenarios in a network-namespace lab.
#
# Usage (as root, from anywhere in the repository):
#   scripts/natlab.sh                 # every scenario, 20 runs per NAT pairing
#   NATLAB_RUNS=5 scripts/natlab.sh   # fewer runs
#   NATLAB_RUN='holepunch-eim-eim' scripts/natlab.sh   # scenarios matching a regexp
#   NATLAB_RUN='partition' scripts/natlab.sh
#   NATLAB_ACCEPT=direct-gossip scripts/natlab.sh   # accept a known issue (see below)
#
# Scenarios:
#   holepunch-A-B       libp2p hosts of the test binary: DCUtR between NAT kinds
#                       A and B (eim, symmetric), NATLAB_RUNS fresh labs each
#   gossip-path-A-B     the computeflux binary (relay, sim-engines, agents):
#                       which path the agents' gossip takes, NATLAB_RUNS labs
#   completions-sticky  client -> relay -> agents in three homes (eim, eim,
#   partition           symmetric), streamed and not, sticky sessions; cut and
#   relay-restart       heal a home's WAN link; restart the relay (SIGTERM)
#   relay-crash         and again after SIGKILL
#
# Needs: go, ip (iproute2), nft (nftables). Addresses come only from
# 198.18.0.0/15, inside namespaces this script creates; nothing touches the
# machine's own network.
#
# Prints one line per scenario: its name, PASS or FAIL, and its figures; the
# full log goes to $NATLAB_LOG (default: a file under /tmp, kept on failure).
# Exits non-zero when any scenario fails. Whatever happens (failure, Ctrl-C,
# SIGTERM), the processes it started are killed by PID and every namespace
# carrying this run's prefix is deleted.
#
# Scenarios are Go tests run from a compiled test binary; each prints a line
# "SCENARIO <name> PASS|FAIL key=value ...". The binary scenarios drive the
# computeflux binary built below inside the lab's namespaces: its path is
# passed to the tests in CF_NATLAB_BIN. NATLAB_KEEP_LOGS=1 keeps every
# process's log (the directories are named in the log). Known product
# issues (see "known" in the scenario tests) fail like any other error,
# here and under `go test`. One that truly cannot be fixed may be accepted
# by name, e.g. NATLAB_ACCEPT=relay-crash-detection (comma separated): its
# scenario line then says KNOWN instead of FAIL and does not fail the run.
set -euo pipefail

runs=${NATLAB_RUNS:-20}
filter=${NATLAB_RUN:-.}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prefix="cfs$$"                    # namespace prefix of this run (netlab: [a-z0-9]{1,12})
work=$(mktemp -d /tmp/natlab.XXXXXX)
log=${NATLAB_LOG:-$work/natlab.log}
testpid=""
failed=0

cleanup() {
	local rc=$?
	trap - EXIT INT TERM HUP
	if [[ -n "$testpid" ]] && kill -0 "$testpid" 2>/dev/null; then
		kill -TERM -- "-$testpid" 2>/dev/null || kill -TERM "$testpid" 2>/dev/null || true
		for _ in 1 2 3 4 5 6 7 8 9 10; do
			kill -0 "$testpid" 2>/dev/null || break
			sleep 0.2
		done
		kill -KILL -- "-$testpid" 2>/dev/null || kill -KILL "$testpid" 2>/dev/null || true
	fi
	# Namespaces of this run: kill what still runs inside, then delete.
	for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${prefix}-" || true); do
		for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
			kill -KILL "$pid" 2>/dev/null || true
		done
		ip netns del "$ns" 2>/dev/null || true
	done
	left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -c "^${prefix}-" || true)
	if [[ "$left" != "0" ]]; then
		echo "natlab: $left namespaces of this run could not be removed" >&2
		rc=1
	fi
	if [[ $rc -eq 0 && -z "${NATLAB_LOG:-}" ]]; then
		rm -rf "$work"
	else
		echo "natlab: log kept at $log" >&2
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

if [[ $(id -u) -ne 0 ]]; then
	echo "natlab: needs root (network namespaces and nftables)" >&2
	exit 2
fi
for bin in go ip nft; do
	if ! command -v "$bin" >/dev/null; then
		echo "natlab: needs $bin (apt-get install iproute2 nftables; Go from go.dev)" >&2
		exit 2
	fi
done

cd "$root"
line() { printf '%-34s %s %s\n' "$1" "$2" "${3:-}"; }

# The binary later scenarios run inside the namespaces.
if go build -o "$work/computeflux" ./cmd/computeflux >>"$log" 2>&1; then
	line build PASS "bin=$work/computeflux"
else
	line build FAIL "see $log"
	failed=1
fi

# The scenario runner: a test binary that re-executes itself as the relay and
# the peers inside the namespaces.
if ! go test -c -o "$work/scenario.test" ./transport/internal/netlab/scenario >>"$log" 2>&1; then
	line scenarios FAIL "test binary did not build; see $log"
	exit 1
fi

set +e
CF_NATLAB_RUNS=$runs CF_NATLAB_PREFIX=$prefix CF_NATLAB_BIN="$work/computeflux" \
	CF_NATLAB_KEEP_LOGS=${NATLAB_KEEP_LOGS:-} CF_NATLAB_ACCEPT=${NATLAB_ACCEPT:-} \
	setsid "$work/scenario.test" -test.run "^(TestHolePunch|TestGossipPath|TestCluster)\$/($filter)" \
	-test.v -test.timeout 60m \
	>"$work/out" 2>>"$log" &
testpid=$!
wait "$testpid"
status=$?
testpid=""
set -e
cat "$work/out" >>"$log"

seen=0
while read -r _ name verdict figures; do
	seen=$((seen + 1))
	line "$name" "$verdict" "$figures"
	[[ "$verdict" == PASS || "$verdict" == KNOWN ]] || failed=1
done < <(grep '^SCENARIO ' "$work/out" || true)

if [[ $status -ne 0 || $seen -eq 0 ]]; then
	[[ $seen -eq 0 ]] && line scenarios FAIL "no scenario ran (exit $status); see $log"
	failed=1
fi
exit "$failed"
