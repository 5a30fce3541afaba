#!/usr/bin/env bash
# Installs a command from the system's packages when it is missing:
#   scripts/ensure-tool.sh COMMAND PACKAGE [VERSION_REGEX]
# PACKAGE is the Debian name (dnf and brew are tried with the same name). With
# VERSION_REGEX, only a COMMAND on the PATH whose `COMMAND version` matches counts (the
# venv's docker-compose is Compose v2; Compose v1 is another program of the same name).
# Recommended packages are left out: docker-compose would otherwise bring a Docker engine.
set -euo pipefail
cmd="$1"
pkg="$2"
want="${3:-}"
found() {
  local path version
  for path in $(type -a -P "$1" 2>/dev/null); do
    [ -z "$want" ] && return 0
    # Read whole, then matched: piped into `grep -q`, which exits at its first match, the
    # program could die of SIGPIPE writing the rest, and pipefail would call it not found.
    version="$("$path" version 2>/dev/null || true)"
    if grep -Eq "$want" <<<"$version"; then
      return 0
    fi
  done
  return 1
}
if found "$cmd"; then
  exit 0
fi
echo "$cmd${want:+ ($want)} not found: installing $pkg from the system's packages" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "error: $cmd is missing and this user cannot install packages; install $pkg and retry" >&2
    exit 1
  fi
fi
if command -v apt-get >/dev/null 2>&1; then
  apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$pkg")
  $SUDO "${apt[@]}" >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO "${apt[@]}" >/dev/null; }
elif command -v dnf >/dev/null 2>&1; then
  $SUDO dnf install -y "$pkg"
elif command -v brew >/dev/null 2>&1; then
  brew install "$pkg"
else
  echo "error: no known package manager; install $pkg and retry" >&2
  exit 1
fi
found "$cmd"
