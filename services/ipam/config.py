"""IPAM service configuration."""

from __future__ import annotations

import dataclasses
import enum
import ipaddress

from services.common.config import CommonConfig, ConfigError, setting

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class IPAMMode(enum.StrEnum):
    """Where node pod CIDRs come from."""

    #: Carve every node's CIDR out of --cluster-cidrs (Cilium's default mode).
    CLUSTER_POOL = "cluster-pool"
    #: Node spec.podCIDRs, else the io.cilium.network.ipv4-pod-cidr annotation, else the pool.
    KUBERNETES = "kubernetes"


@dataclasses.dataclass(frozen=True, kw_only=True)
class IPAMConfig(CommonConfig):
    """Allocate identities and pod IPs in etcd."""

    cluster_cidrs: str = setting(
        "Cluster pod CIDRs to carve node CIDRs from, comma-separated (IPv4 and optionally IPv6).",
        default="10.244.0.0/16",
    )
    node_mask_v4: int = setting("Prefix length of each node's IPv4 pod CIDR.", default=24)
    node_mask_v6: int = setting("Prefix length of each node's IPv6 pod CIDR.", default=112)
    ipam_mode: str = setting(
        "Where node pod CIDRs come from: cluster-pool, or kubernetes (node spec > annotation > pool).",
        default=IPAMMode.CLUSTER_POOL.value,
    )
    cluster_name: str = setting("Cluster name, part of every pod identity.", default="default")
    identity_lease_ttl: int = setting(
        "Seconds a node's identity references outlive the last keepalive (etcd lease TTL).", default=30
    )
    identity_gc_interval: float = setting(
        "Seconds between identity garbage-collection passes (also resyncs published identities).", default=30.0
    )
    identity_gc_grace: float = setting(
        "Seconds an identity must stay unreferenced before it is collected.", default=300.0
    )
    k8s_sync_timeout: float = setting(
        "Seconds to wait for the watcher's palisade.k8s.synced marker before serving anyway "
        "(status stays synced=false until it comes); 0 waits forever, so ready means synced.",
        default=0.0,
    )
    etcd_patience: float = setting(
        "Seconds one etcd operation keeps retrying through an etcd outage before failing.", default=30.0
    )

    @property
    def mode(self) -> IPAMMode:
        return IPAMMode(self.ipam_mode)

    def cluster_networks(self) -> tuple[IPNetwork, ...]:
        out = []
        for part in self.cluster_cidrs.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(ipaddress.ip_network(part, strict=True))
            except ValueError as exc:
                raise ConfigError(f"--cluster-cidrs: {part!r} is not a network address/prefix ({exc})") from None
        return tuple(out)

    def validate(self) -> None:
        try:
            IPAMMode(self.ipam_mode)
        except ValueError:
            choices = ", ".join(m.value for m in IPAMMode)
            raise ConfigError(f"--ipam-mode: {self.ipam_mode!r} is not one of {choices}") from None
        nets = self.cluster_networks()
        if not nets:
            raise ConfigError("--cluster-cidrs: give at least one cluster CIDR, e.g. 10.244.0.0/16")
        if not 8 <= self.node_mask_v4 <= 30:
            raise ConfigError(f"--node-mask-v4: {self.node_mask_v4} must be between 8 and 30")
        if not 64 <= self.node_mask_v6 <= 126:
            raise ConfigError(f"--node-mask-v6: {self.node_mask_v6} must be between 64 and 126")
        for net in nets:
            mask = self.node_mask_v4 if net.version == 4 else self.node_mask_v6
            if mask < net.prefixlen:
                flag = "--node-mask-v4" if net.version == 4 else "--node-mask-v6"
                raise ConfigError(f"{flag}: /{mask} is larger than cluster CIDR {net}; use a longer prefix")
        if self.identity_lease_ttl < 2:
            raise ConfigError(f"--identity-lease-ttl: {self.identity_lease_ttl} is too short; etcd needs at least 2")
        for flag, value in (
            ("--identity-gc-interval", self.identity_gc_interval),
            ("--etcd-patience", self.etcd_patience),
        ):
            if value <= 0:
                raise ConfigError(f"{flag}: {value} must be greater than 0")
        for flag, value in (
            ("--identity-gc-grace", self.identity_gc_grace),
            ("--k8s-sync-timeout", self.k8s_sync_timeout),
        ):
            if value < 0:
                raise ConfigError(f"{flag}: {value} must not be negative")
