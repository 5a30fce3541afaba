#!/bin/sh
# The image's `certs` mode: the init step that makes a cluster's certificates for mutual TLS
# (compose.yaml's `certs` service, the Kubernetes Job `certs` and each agent's init
# container). Not for production: a development CA (unicron/certs.py).
#
#   certs OUT [FLAGS...] [-- DIR=FILE[:NAME],...[@UID:GID] ...]
#
# runs `python -m unicron.cli certs --out OUT FLAGS...` (a CA, a certificate per service,
# node, backend and user, the users' and the join tokens; a CA and tokens already in OUT
# are kept, the certificates are issued again), then copies each share: the listed files of
# OUT into DIR (as NAME), so that a container mounts its own certificate and key and the
# CA's certificate, never the CA's key nor another's. Run as root (compose, whose named
# volumes are root's), it gives what it wrote to the image's user, uid 10001, or to the
# share's @UID:GID: the keys are 0600, and another image's program (Redis's, uid 999) must
# own its own to read it.
#
# UNICRON_CA_FROM=DIR: the CA is DIR's (ca.pem and ca-key.pem, waited for until they are
# there), and OUT is removed once shared: an agent pod issuing its own node certificate.
set -eu
umask 077

out="${1:?usage: certs OUT [unicron certs flags...] [-- DIR=FILE[:NAME],...]}"
shift
# The flags stay in "$@"; the shares after "--" go to $shares (they hold no spaces).
shares=""
after=0
for arg in "$@"; do
    shift
    if [ "$after" = 1 ]; then
        shares="$shares $arg"
    elif [ "$arg" = "--" ]; then
        after=1
    else
        set -- "$@" "$arg"
    fi
done

owner=""
[ "$(id -u)" = 0 ] && owner=10001:10001

ca_from="${UNICRON_CA_FROM:-}"
if [ -n "$ca_from" ]; then
    waited=0
    until [ -s "$ca_from/ca.pem" ] && [ -s "$ca_from/ca-key.pem" ]; do
        [ "$waited" = 0 ] && echo "unicron-certs: waiting for the cluster's CA in $ca_from" >&2
        waited=1
        sleep 2
    done
    mkdir -p "$out"
    cp "$ca_from/ca.pem" "$ca_from/ca-key.pem" "$out/"
fi

python -m unicron.cli certs --out "$out" "$@"
echo "unicron-certs: certificates in $out" >&2

for share in $shares; do
    share_owner="$owner"
    case "$share" in
    *@*)
        [ -n "$owner" ] && share_owner="${share##*@}"
        share="${share%@*}"
        ;;
    esac
    dir="${share%%=*}"
    files="${share#*=}"
    mkdir -p "$dir"
    old_ifs="$IFS"
    IFS=,
    for item in $files; do
        file="${item%%:*}"
        name="${item#*:}"
        cp "$out/$file" "$dir/.$name.tmp"
        mv "$dir/.$name.tmp" "$dir/$name"
    done
    IFS="$old_ifs"
    [ -n "$share_owner" ] && chown -R "$share_owner" "$dir"
    echo "unicron-certs: shared $files in $dir${share_owner:+ (owner $share_owner)}" >&2
done

[ -n "$owner" ] && chown -R "$owner" "$out"
if [ -n "$ca_from" ]; then
    rm -rf "$out"
fi
exit 0
