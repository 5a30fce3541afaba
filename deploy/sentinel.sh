#!/bin/sh
# A Redis sentinel for compose.yaml: writes its config file once (a sentinel rewrites that
# file with what it learns of the group, and must find it again after a restart), then runs.
#   SENTINEL_ANNOUNCE  the name the others reach it at (empty: its address)
#   SENTINEL_BIND      the address it listens on (default: every address)
#   SENTINEL_PORT      its port (default 26379)
#   SENTINEL_PRIMARY   the primary to watch at first, "host port" (default "redis 6379")
#   SENTINEL_QUORUM    sentinels that must agree the primary is down (default 2)
#   SENTINEL_TLS       1 (default): mutual TLS alone, to clients, to the servers and to the
#                      other sentinels, with the certificates in SENTINEL_CERTS
#   SENTINEL_DIR       where its config file lives (default /data, its volume)
#   SENTINEL_CERTS     its certificate share (default /var/lib/unicron/certs)
set -eu
dir=${SENTINEL_DIR:-/data}
conf=$dir/sentinel.conf
certs=${SENTINEL_CERTS:-/var/lib/unicron/certs}
if [ ! -s "$conf" ]; then
  {
    [ -n "${SENTINEL_BIND:-}" ] && echo "bind $SENTINEL_BIND"
    if [ "${SENTINEL_TLS:-1}" = 1 ]; then
      echo "port 0"
      echo "tls-port ${SENTINEL_PORT:-26379}"
      echo "tls-cert-file $certs/redis.pem"
      echo "tls-key-file $certs/redis-key.pem"
      echo "tls-ca-cert-file $certs/ca.pem"
      echo "tls-auth-clients yes"
      echo "tls-replication yes"
    else
      echo "port ${SENTINEL_PORT:-26379}"
    fi
    echo "dir $dir"
    echo "protected-mode no"
    if [ -n "${SENTINEL_ANNOUNCE:-}" ]; then
      # Names, not container addresses: the certificates name the services.
      echo "sentinel resolve-hostnames yes"
      echo "sentinel announce-hostnames yes"
      echo "sentinel announce-ip $SENTINEL_ANNOUNCE"
    fi
    echo "sentinel monitor unicron ${SENTINEL_PRIMARY:-redis 6379} ${SENTINEL_QUORUM:-2}"
    echo "sentinel down-after-milliseconds unicron 5000"
    echo "sentinel failover-timeout unicron 60000"
    echo "sentinel parallel-syncs unicron 1"
  } > "$conf"
fi
exec redis-server "$conf" --sentinel
