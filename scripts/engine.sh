#!/usr/bin/env bash
# A Docker engine of the project's own, for `make image`, compose and tests/deploy on a
# machine without one (as root): Debian's docker.io dockerd on its own data root, exec root
# and socket, so it never touches a system engine.
#
#   scripts/engine.sh start    start it unless it answers already; prints DOCKER_HOST=...
#   scripts/engine.sh stop     stop the dockerd this script started (containers stop with it)
#   scripts/engine.sh status   exit 0 when it answers
#   scripts/engine.sh host     print its DOCKER_HOST value
#
# Settings that run on these machines (see deploy/README.md, "Offline machines"): the vfs
# storage driver (no overlay on overlay), no default bridge and no iptables rules (the host's
# firewall is left alone; builds use --network host, compose publishes ports through
# docker-proxy). Images stay in the data root between runs: delete it to start afresh.
set -euo pipefail

DATA_ROOT=${PALISADE_ENGINE_DATA:-/var/lib/palisade-engine}
RUN_ROOT=${PALISADE_ENGINE_RUN:-/run/palisade-engine}
SOCKET="$RUN_ROOT/docker.sock"
HOST="unix://$SOCKET"
PIDFILE="$RUN_ROOT/dockerd.pid"
LOG="$DATA_ROOT/dockerd.log"
say() { printf '\033[1m[engine]\033[0m %s\n' "$*" >&2; }

answers() { DOCKER_HOST="$HOST" docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

install_engine() {
    command -v dockerd >/dev/null && command -v docker >/dev/null && return 0
    if [ "$(id -u)" != 0 ]; then
        say "dockerd is not installed and only root can install it: apt-get install docker.io"
        exit 1
    fi
    say "installing Debian's docker.io"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
}

start() {
    if answers; then
        echo "DOCKER_HOST=$HOST"
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        say "starting dockerd needs root (or point DOCKER_HOST at an engine you run)"
        exit 1
    fi
    install_engine
    mkdir -p "$DATA_ROOT" "$RUN_ROOT"
    say "starting dockerd (data root $DATA_ROOT, socket $SOCKET, log $LOG)"
    # setsid: the engine outlives the shell that started it; `stop` ends it by its pid file.
    setsid dockerd \
        --data-root "$DATA_ROOT" \
        --exec-root "$RUN_ROOT/exec" \
        --pidfile "$PIDFILE" \
        -H "$HOST" \
        --storage-driver=vfs \
        --bridge=none \
        --iptables=false \
        --ip6tables=false \
        >>"$LOG" 2>&1 </dev/null &
    for _ in $(seq 1 120); do
        if answers; then
            echo "DOCKER_HOST=$HOST"
            return 0
        fi
        sleep 0.5
    done
    say "dockerd did not answer on $SOCKET within 60 s; the end of $LOG:"
    tail -n 20 "$LOG" >&2
    exit 1
}

stop() {
    [ -f "$PIDFILE" ] || return 0
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping dockerd ($pid)"
        kill -TERM "$pid"
        for _ in $(seq 1 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
    fi
    rm -f "$PIDFILE"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) answers ;;
    host) echo "$HOST" ;;
    *)
        echo "usage: $0 start|stop|status|host" >&2
        exit 2
        ;;
esac
