"""Cluster-pool arithmetic: carve node CIDRs out of cluster CIDRs. Pure.

The addresses inside a node's CIDR are :mod:`services.common.podcidr`'s.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from services.common.podcidr import IPNetwork


def next_free_subnet(clusters: Sequence[IPNetwork], mask: int, used: Collection[IPNetwork]) -> IPNetwork | None:
    """The first ``/mask`` subnet of ``clusters`` (in order) that overlaps nothing in ``used``.

    ``used`` holds pool claims and any other node CIDRs (e.g. from node specs) that
    must not be handed out twice.
    """
    exact = {n for n in used if n.prefixlen == mask}
    irregular = [n for n in used if n.prefixlen != mask]
    for cluster in clusters:
        if cluster.prefixlen > mask:
            continue
        for subnet in cluster.subnets(new_prefix=mask):
            if subnet in exact:
                continue
            if any(subnet.version == other.version and subnet.overlaps(other) for other in irregular):
                continue
            return subnet
    return None


def by_family(networks: Iterable[IPNetwork]) -> dict[int, list[IPNetwork]]:
    out: dict[int, list[IPNetwork]] = {}
    for net in networks:
        out.setdefault(net.version, []).append(net)
    return out
