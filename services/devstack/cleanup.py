"""What a stopped dev stack leaves in the kernel: removed, and whatever could not be, named.

The datapath deletes endpoints when asked, but a stack may stop while the datapath is
down (killed, or restarted by hand outside the stack), so the stack cleans up itself
from what the datapath saved: each endpoint's record names its namespace, host veth
(its routes go with it) and addresses; the pins live under the bpffs directory. Then
it looks again, so "nothing left behind" is a finding, never an assumption.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from services.common.log import get_logger
from services.datapath import dnsrouting
from services.datapath import netns as netns_mod
from services.datapath.datapath import teardown_all
from services.datapath.endpoint import link_of
from services.datapath.state import EndpointStore

log = get_logger("devstack")


def clean(bpffs: str, state_dir: Path, netns_paths: Iterable[str] = (), *, dns_routing: bool = False) -> list[str]:
    """Remove the stack's pods, veths, routes and pins; returns what is still there (empty: nothing).

    ``dns_routing``: the node is this namespace (the single dev node): its DNS proxy's policy
    routing goes too (a dev cluster's nodes take theirs with their namespaces)."""
    records, broken = EndpointStore(state_dir).load_all() if state_dir.is_dir() else ([], [])
    for err in broken:
        log.warning("endpoint record unreadable; its pod is cleaned by name if known", error=str(err))
    links = [link_of(r) for r in records]
    owned = {link.netns for link in links if link.netns_owned} | set(netns_paths)
    for link in links:
        try:
            netns_mod.delete_pod(link)
        except OSError as exc:
            log.warning("pod network not removed", netns=link.netns, error=str(exc))
    for path in owned:
        try:
            netns_mod.delete_netns(netns_mod.name_of(path))
        except (OSError, ValueError) as exc:
            log.warning("network namespace not removed", netns=path, error=str(exc))
    try:
        teardown_all(bpffs)
    except OSError as exc:
        log.warning("pinned maps not removed", bpffs=bpffs, error=str(exc))
    if dns_routing:
        try:
            dnsrouting.remove()
        except OSError as exc:
            log.warning("DNS proxy routing not removed", error=str(exc))
    shutil.rmtree(state_dir, ignore_errors=True)
    return left_behind(bpffs, owned, [link.host_ifname for link in links])


def left_behind(bpffs: str, netns_paths: Iterable[str], host_ifnames: Iterable[str]) -> list[str]:
    """What of these still exists, each with the command that removes it."""
    from pyroute2 import IPRoute

    left = [f"network namespace {p} (ip netns del {os.path.basename(p)})" for p in sorted(netns_paths)]
    left = [text for text, p in zip(left, sorted(netns_paths), strict=True) if os.path.exists(p)]
    with IPRoute() as ipr:
        left += [f"veth {name} (ip link del {name})" for name in sorted(host_ifnames) if ipr.link_lookup(ifname=name)]
    if os.path.exists(bpffs):
        left.append(f"pinned maps under {bpffs} (rm -r {bpffs})")
    return left


def main(argv: list[str] | None = None) -> int:
    """``python -m services.devstack.cleanup``: clean up after a stopped datapath (compose's teardown).

    Run where the datapath ran, after it stopped (deploy/compose: ``run --rm --no-deps datapath
    python -m services.devstack.cleanup``); the locations default to the datapath's own settings.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m services.devstack.cleanup", description=main.__doc__)
    parser.add_argument(
        "--bpffs", default=os.environ.get("PALISADE_BPFFS", "/sys/fs/bpf/palisade"), help="the datapath's pin directory"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("PALISADE_STATE_DIR", "/var/run/palisade/datapath")),
        help="the datapath's state directory (its endpoint records)",
    )
    args = parser.parse_args(argv)
    left = clean(args.bpffs, args.state_dir, dns_routing=True)
    for item in left:
        print(f"left behind: {item}")
    print("nothing left behind" if not left else f"{len(left)} left behind")
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
