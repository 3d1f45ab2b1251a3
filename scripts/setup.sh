#!/usr/bin/env bash
# One-command setup for a fresh Debian 12 machine (as root) or a developer box.
# Idempotent: every step checks before it acts, so running it again is cheap.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

apt_install() {
    # Installs the named Debian packages that are missing; needs root.
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ]; then
        say "not root: skipping Debian packages ${missing[*]} (the kernel tests will be skipped)"
        return 0
    fi
    say "installing Debian packages: ${missing[*]}"
    if [ -z "${APT_UPDATED:-}" ]; then
        apt-get update -qq
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# 1. System packages: bcc, the tools the datapath and its tests use, a container runtime for the
#    CNI tests, and a venv-capable Python.
if command -v dpkg-query >/dev/null; then
    apt_install python3-bpfcc bpfcc-tools iproute2 iptables nftables iperf3 kmod procps
    # A real runtime in kubelet's place for the CNI tests: containerd (CRI), runc, the reference
    # CNI plugins to chain after, and gcc to build the sandbox ("pause") image locally.
    apt_install containerd runc containernetworking-plugins gcc libc6-dev
    # The image and the compose stack (make image, tests/deploy/test_stack.py): Debian's Docker
    # engine (started by scripts/engine.sh, not as a system service), Compose 1.29 (no Compose v2
    # plugin is packaged) and debootstrap for the local base image of offline machines.
    apt_install docker.io docker-compose debootstrap
    command -v "$PYTHON" >/dev/null || apt_install python3
    "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv python3-pip
fi

# 2. Kernel headers where bcc looks for them, when the running kernel ships none.
KDIR=/lib/modules/$(uname -r)
if [ "$(id -u)" = 0 ] && [ ! -e "$KDIR/build/include/generated" ]; then
    apt_install linux-headers-amd64
    build=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$build" ] && [ -n "$common" ]; then
        mkdir -p "$KDIR"
        ln -sfn "$build" "$KDIR/build"
        ln -sfn "$common" "$KDIR/source"
        say "linked $build and $common into $KDIR for bcc"
    fi
fi

# 3. The project's virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    say "installing Palisade and its dependencies into $VENV"
    log="$VENV/pip-install.log"
    if ! { "$VENV/bin/python" -m pip install --upgrade pip &&
           "$VENV/bin/python" -m pip install -e '.[test,dev,bench]'; } >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        say "pip install failed; the full log is $log"
        exit 1
    fi
    rm -f "$VENV"/.installed-* && touch "$stamp"
fi

# 4. Debian's bcc (pure Python over libbcc) made importable inside the venv.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/bcc ] && [ ! -e "$site/bcc" ]; then
    ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
    say "linked Debian's bcc into $VENV"
fi

# 5. Generated protobuf/gRPC code.
make --no-print-directory proto VENV="$VENV" >/dev/null

# 6. The CNI plugin executable (services/cni/shim.c) beside the Python plugin it hands to
#    ($VENV/bin/palisade-cni-python, from pyproject.toml), as the node installer puts them.
shim="$VENV/bin/palisade-cni"
if [ ! -x "$shim" ] || [ services/cni/shim.c -nt "$shim" ] || [ "$(head -c4 "$shim" | tr -d '\177')" != ELF ]; then
    gcc -O2 -Wall -Wextra -Werror -static -o "$shim.new" services/cni/shim.c && mv -f "$shim.new" "$shim"
    say "built the CNI plugin executable $shim"
fi
say "ready ($("$VENV/bin/python" -c 'import bcc' 2>/dev/null && echo 'bcc importable' || echo 'bcc NOT importable: kernel tests will skip'))"
