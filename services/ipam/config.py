"""IPAM service configuration."""

from __future__ import annotations

import dataclasses

from services.common.config import CommonConfig, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class IPAMConfig(CommonConfig):
    """Allocate identities and pod IPs in etcd."""

    cluster_cidrs: str = setting(
        "Cluster pod CIDRs to carve node CIDRs from, comma-separated.", default="10.244.0.0/16"
    )
    node_mask_v4: int = setting("Prefix length of each node's IPv4 pod CIDR.", default=24)
    node_mask_v6: int = setting("Prefix length of each node's IPv6 pod CIDR.", default=112)
