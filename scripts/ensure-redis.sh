#!/usr/bin/env bash
# Installs redis-server from the system's packages when it is missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
echo "redis-server not found: installing it from the system's packages" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "error: redis-server is missing and this user cannot install packages; install redis-server and retry" >&2
    exit 1
  fi
fi
if command -v apt-get >/dev/null 2>&1; then
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }
elif command -v dnf >/dev/null 2>&1; then
  $SUDO dnf install -y redis
elif command -v brew >/dev/null 2>&1; then
  brew install redis
else
  echo "error: no known package manager; install redis-server and retry" >&2
  exit 1
fi
# Debian starts the packaged server as a service; Unicron runs its own, so stop that one.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null; then
  $SUDO systemctl stop redis-server || true
fi
command -v redis-server >/dev/null
