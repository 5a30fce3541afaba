#!/bin/sh
# The image's entry point: `coordinator`, `planner`, `agent`, `otlp-receiver`, `unicron`
# (the CLI) or `certs` (the init step that makes the cluster's certificates, certs.sh),
# then that program's flags. Services are configured by UNICRON_<SERVICE>_<FIELD>
# variables (unicron/config.py). The settings whose defaults point at 127.0.0.1, which in a
# container is nobody, must be given: one missing is named in one line and the container
# exits 2, so the orchestrator shows why instead of a service that looks started.
set -eu

service="${1:-}"
[ $# -gt 0 ] && shift
args=" $* "

# need VARIABLE FLAG WHAT: the variable or the flag must be given, unless a config file is.
need() {
    eval "value=\${$1:-}"
    [ -n "$value" ] && return 0
    case "$args" in *" $2 "* | *" $2="* | *" --config "* | *" --config="*) return 0 ;; esac
    eval "config=\${$config_variable:-}"
    [ -n "$config" ] && return 0
    echo "unicron-$service: $1 is not set ($3; or pass $2)" >&2
    exit 2
}

case "$service" in
coordinator)
    config_variable=UNICRON_COORDINATOR_CONFIG
    need UNICRON_COORDINATOR_BIND --bind "the address to serve on, e.g. 0.0.0.0:50051"
    need UNICRON_COORDINATOR_REDIS_URL --redis-url "the Redis holding the state, e.g. redis://redis:6379/0"
    need UNICRON_COORDINATOR_PLANNERS --planners "the planner replicas, e.g. planner-1:50061,planner-2:50061"
    ;;
planner)
    config_variable=UNICRON_PLANNER_CONFIG
    need UNICRON_PLANNER_BIND --bind "the address to serve on, e.g. 0.0.0.0:50061"
    ;;
agent)
    config_variable=UNICRON_AGENT_CONFIG
    need UNICRON_AGENT_BIND --bind "the address its trainers and health checks reach it on, e.g. 127.0.0.1:50071"
    need UNICRON_AGENT_COORDINATOR --coordinator "the coordinator's address, e.g. coordinator:50051"
    ;;
otlp-receiver) exec python -m unicron.otlp_receiver "$@" ;;
unicron) exec unicron "$@" ;;
certs) exec /bin/sh /usr/local/lib/unicron/certs.sh "$@" ;;
*)
    echo "usage: coordinator|planner|agent|otlp-receiver|unicron|certs [flags]; got '${service}'" >&2
    exit 2
    ;;
esac
exec python -m "services.$service" "$@"
