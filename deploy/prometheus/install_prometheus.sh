#!/usr/bin/env bash
# Installs the `prometheus` server and `promtool` (the Debian package) for the deploy tests. Idempotent:
# does nothing when both are already on PATH. Never leaves the packaged system service running: a temporary
# policy-rc.d forbids service starts during the install (the tests run their own prometheus process).
# Exit codes: 0 installed (or already there), 3 no apt-get on this machine, anything else: the install failed.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prometheus.sh: no apt-get here; install prometheus and promtool yourself" >&2
    exit 3
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo -n)
    else
        echo "install_prometheus.sh: not root and no sudo" >&2
        exit 1
    fi
fi

POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    # 101: "action forbidden", so invoke-rc.d / deb-systemd-invoke start nothing during the install
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$POLICY" >/dev/null
    "${SUDO[@]}" chmod 755 "$POLICY"
    CREATED_POLICY=1
fi
cleanup() {
    if [ "$CREATED_POLICY" -eq 1 ]; then
        "${SUDO[@]}" rm -f "$POLICY"
    fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus

# the packaged binaries live in /usr/bin; a missing one means the package changed, which is an error
command -v prometheus >/dev/null && command -v promtool >/dev/null
