#!/usr/bin/env bash
# Installs computeflux as a system service: the binary, a system user,
# hardened systemd units for the relay and the agent, and their settings.
#
#   scripts/install.sh [--root DIR] [--binary FILE] [--uninstall]
#
#   --root DIR     install under DIR instead of / (staging for packages and
#                  tests; no user is created, nothing is reloaded there)
#   --binary FILE  install FILE instead of building the binary from this
#                  checkout (go build, with version and commit stamped in)
#   --uninstall    remove the binary, the units and the sysusers entry; the
#                  settings in /etc/computeflux and the state in
#                  /var/lib/computeflux are kept (remove them by hand)
#
# Idempotent: a second run changes nothing. Files are replaced only when
# their content differs; settings and secrets that exist are never
# overwritten. It never enables or starts a service: it says how.
set -euo pipefail

root=/
binary=
uninstall=0
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root="${2:?--root needs a directory}"; shift 2 ;;
    --root=*) root="${1#--root=}"; shift ;;
    --binary) binary="${2:?--binary needs a file}"; shift 2 ;;
    --binary=*) binary="${1#--binary=}"; shift ;;
    --uninstall) uninstall=1; shift ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
root="${root%/}"
live=0
[ -z "$root" ] && live=1 # installing into the running system
[ -n "$root" ] && mkdir -p "$root"

user=computeflux
bindir="$root/usr/local/bin"
unitdir="$root/etc/systemd/system"
confdir="$root/etc/computeflux"
sysusersdir="$root/usr/lib/sysusers.d"
units=(computeflux-relay.service computeflux-agent.service)

say() { printf '%s\n' "$*"; }

# put SRC DEST MODE: installs SRC as DEST unless DEST already has that content.
put() {
  local src=$1 dest=$2 mode=$3
  mkdir -p "$(dirname "$dest")"
  if [ -f "$dest" ] && cmp -s "$src" "$dest"; then
    say "unchanged  ${dest#"$root"}"
    [ "$(stat -c %a "$dest")" = "$mode" ] || chmod "$mode" "$dest"
    return 0
  fi
  local tmp
  tmp=$(mktemp "$(dirname "$dest")/.install.XXXXXX")
  cat "$src" >"$tmp"
  chmod "$mode" "$tmp"
  mv -f "$tmp" "$dest"
  say "installed  ${dest#"$root"}"
  changed=1
}

# put_new DEST MODE: writes stdin to DEST only if DEST does not exist.
put_new() {
  local dest=$1 mode=$2
  mkdir -p "$(dirname "$dest")"
  if [ -e "$dest" ]; then
    cat >/dev/null
    say "kept       ${dest#"$root"}"
    return 0
  fi
  local tmp
  tmp=$(mktemp "$(dirname "$dest")/.install.XXXXXX")
  cat >"$tmp"
  chmod "$mode" "$tmp"
  if [ "$live" = 1 ] && getent group "$user" >/dev/null; then
    chgrp "$user" "$tmp"
  fi
  mv -f "$tmp" "$dest"
  say "created    ${dest#"$root"}"
  changed=1
}

systemd_live() { [ "$live" = 1 ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }

if [ "$uninstall" = 1 ]; then
  if systemd_live; then
    for u in "${units[@]}"; do
      systemctl disable --now "$u" 2>/dev/null || true
    done
  fi
  for f in "$bindir/computeflux" "${units[@]/#/$unitdir/}" "$sysusersdir/computeflux.conf"; do
    if [ -e "$f" ]; then rm -f "$f"; say "removed    ${f#"$root"}"; fi
  done
  systemd_live && systemctl daemon-reload
  say "kept       ${confdir#"$root"} and /var/lib/computeflux (settings, secrets, identities) and the user $user"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
changed=0

# The binary.
if [ -z "$binary" ]; then
  checkout=$(cd "$(dirname "$0")/.." && pwd)
  command -v go >/dev/null || { echo "install.sh: go is not installed; build elsewhere and pass --binary FILE" >&2; exit 1; }
  ver=$(git -C "$checkout" describe --tags --always --dirty 2>/dev/null || echo dev)
  rev=$(git -C "$checkout" rev-parse HEAD 2>/dev/null || echo unknown)
  say "building   computeflux $ver ($rev)"
  (cd "$checkout" && CGO_ENABLED=0 go build -trimpath -buildvcs=false \
    -ldflags "-s -w -X main.version=$ver -X main.commit=$rev" -o "$work/computeflux" ./cmd/computeflux)
  binary="$work/computeflux"
fi
[ -f "$binary" ] && [ -x "$binary" ] || { echo "install.sh: $binary is not an executable file" >&2; exit 1; }
put "$binary" "$bindir/computeflux" 755

# The system user, declared for systemd-sysusers (packagers ship this file)
# and created now when installing into the running system.
cat >"$work/sysusers" <<EOF
# computeflux: the relay's and the agent's service user
u $user - "ComputeFlux relay and agent" /var/lib/computeflux
EOF
put "$work/sysusers" "$sysusersdir/computeflux.conf" 644
if [ "$live" = 1 ] && ! getent passwd "$user" >/dev/null; then
  if command -v systemd-sysusers >/dev/null; then
    systemd-sysusers "$sysusersdir/computeflux.conf"
  else
    useradd --system --home-dir /var/lib/computeflux --no-create-home --shell /usr/sbin/nologin "$user"
  fi
  say "created    user $user"
  changed=1
fi

# Units: hardened, restarted on failure, state in /var/lib/computeflux.
unit() { # unit NAME DESCRIPTION [CAPABILITIES]
  cat <<EOF
[Unit]
Description=$2
Documentation=https://github.com/computeflux/computeflux#readme
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User=$user
Group=$user
EnvironmentFile=/etc/computeflux/$1.env
ExecStart=/usr/local/bin/computeflux $1 --log-format json
Restart=on-failure
RestartSec=5s
# SIGTERM drains: in-flight requests finish (up to --drain-timeout).
TimeoutStopSec=45s
StateDirectory=computeflux
StateDirectoryMode=0750
WorkingDirectory=/var/lib/computeflux
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
SystemCallArchitectures=native
CapabilityBoundingSet=${3:-}
AmbientCapabilities=${3:-}
UMask=0027
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
EOF
}
# The relay may bind ports below 1024 (:80 and :443 with --domain), nothing else.
unit relay "ComputeFlux relay: the OpenAI API for clients, the join point for agents" CAP_NET_BIND_SERVICE >"$work/relay.unit"
unit agent "ComputeFlux agent: serves the local inference engine to a relay" >"$work/agent.unit"
put "$work/relay.unit" "$unitdir/computeflux-relay.service" 644
put "$work/agent.unit" "$unitdir/computeflux-agent.service" 644

# Settings: every flag as COMPUTEFLUX_<FLAG>; kept once written.
put_new "$confdir/relay.env" 640 <<'EOF'
# computeflux relay settings (computeflux relay -h lists every flag; each is
# COMPUTEFLUX_<FLAG> here, upper case, dashes as underscores).
COMPUTEFLUX_LISTEN=:8080
COMPUTEFLUX_P2P_LISTEN=/ip4/0.0.0.0/udp/4001/quic-v1,/ip6/::/udp/4001/quic-v1
COMPUTEFLUX_API_KEYS_FILE=/etc/computeflux/api-keys
COMPUTEFLUX_TOKEN_FILE=/etc/computeflux/join-token
COMPUTEFLUX_IDENTITY=/var/lib/computeflux/relay.key
COMPUTEFLUX_ADDR_FILE=/var/lib/computeflux/relay.addrs
# The usage ledger is on: /var/lib/computeflux/relay-usage.db, beside the
# identity (computeflux usage reads it through the admin API). To keep none:
#COMPUTEFLUX_LEDGER_FILE=none
# A public relay must use TLS (clients send API keys): a certificate by
# ACME (Let's Encrypt; the API then on :443, the CA's http-01 checks and
# redirects on :80, certificates in /var/lib/computeflux/acme; comment out
# COMPUTEFLUX_LISTEN above or set it to :443)...
#COMPUTEFLUX_DOMAIN=relay.example.com
#COMPUTEFLUX_ACME_EMAIL=ops@example.com
# ...or certificate files:
#COMPUTEFLUX_TLS_CERT=/etc/computeflux/tls.crt
#COMPUTEFLUX_TLS_KEY=/etc/computeflux/tls.key
EOF
put_new "$confdir/agent.env" 640 <<'EOF'
# computeflux agent settings (computeflux agent -h lists every flag; each is
# COMPUTEFLUX_<FLAG> here, upper case, dashes as underscores).
# Required: the relay's address (a line of its relay.addrs), and its join
# secret copied to /etc/computeflux/join-token.
#COMPUTEFLUX_RELAY=/ip4/203.0.113.7/udp/4001/quic-v1/p2p/12D3KooW...
COMPUTEFLUX_TOKEN_FILE=/etc/computeflux/join-token
COMPUTEFLUX_IDENTITY=/var/lib/computeflux/agent.key
# Without an upstream the agent looks on 127.0.0.1 ports 8000, 30000, 8080,
# 3000 and 11434 and logs which engine it found.
#COMPUTEFLUX_UPSTREAM=http://127.0.0.1:8000
#COMPUTEFLUX_NAME=gpu1
EOF
# Secrets for a relay: a client API key and the agents' join secret.
rand_hex() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }
put_new "$confdir/api-keys" 640 < <(printf 'sk-%s\n' "$(rand_hex 16)")
put_new "$confdir/join-token" 640 < <(rand_hex 32; echo)

if systemd_live && [ "$changed" = 1 ]; then
  systemctl daemon-reload
fi
if [ "$changed" = 0 ]; then
  say "nothing to change"
fi
say ""
say "Next: relay host: systemctl enable --now computeflux-relay"
say "      GPU box: set COMPUTEFLUX_RELAY in /etc/computeflux/agent.env, copy the relay's"
say "      /etc/computeflux/join-token, then systemctl enable --now computeflux-agent"
