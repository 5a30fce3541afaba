#!/usr/bin/env bash
# Installs redis-server from the system's packages when it is missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
"$(dirname "$0")/ensure-tool.sh" redis-server redis-server
# Debian starts the packaged server as a service; Unicron runs its own, so stop that one.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO systemctl stop redis-server || true
fi
