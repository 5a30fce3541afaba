#!/usr/bin/env bash
# What the network-namespace cluster tests need (make test-cluster): root, iproute2's ip and
# tc, and iptables (its rules are only ever added inside the tests' own namespaces).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "error: the cluster tests make network namespaces and need root" >&2
  exit 1
fi
missing=""
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
command -v tc >/dev/null 2>&1 || missing="$missing iproute2"
command -v iptables >/dev/null 2>&1 || missing="$missing iptables"
if [ -n "$missing" ]; then
  echo "installing$missing from the system's packages" >&2
  # shellcheck disable=SC2086
  env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null \
    || { apt-get update -q >/dev/null && env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null; }
fi
command -v iptables >/dev/null
