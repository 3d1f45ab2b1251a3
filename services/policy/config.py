"""Policy service configuration."""

from __future__ import annotations

import dataclasses
import re

from services.common.config import CommonConfig, ConfigError, setting
from services.common.grpcserver import parse_addresses

_BUCKET_RE = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyConfig(CommonConfig):
    """Own the policy repository and send regeneration orders."""

    max_order_bytes: int = setting(
        "Largest order published whole; larger ones are chunked (never above the server's max payload).",
        default=512 * 1024,
    )
    max_order_chunks: int = setting(
        "Most chunks one order is split into; beyond that the datapath is told to fetch it with Resync.",
        default=16,
    )
    state_bucket: str = setting(
        "JetStream key-value bucket holding the revision and per-node order sequences.",
        default="PALISADE_POLICY",
    )
    cluster_name: str = setting("Cluster name, as matched by the `cluster` entity.", default="default")
    wait_timeout: float = setting("Default WaitForRevision timeout, seconds.", default=30.0)
    max_wait_timeout: float = setting("Longest WaitForRevision timeout a client may ask for, seconds.", default=600.0)
    member: str = setting(
        "This replica's name among the policy replicas (default: host name and process id; set it to the pod name).",
        default="",
    )
    advertise_address: str = setting(
        "host:port the other replicas forward calls to (default: the gRPC listen address, with the host "
        "name when it listens on every interface).",
        default="",
    )
    leader_lease: float = setting(
        "Seconds a leader's lease lasts without renewal: a follower takes over about this long after the leader dies.",
        default=15.0,
    )
    node_grace: float = setting(
        "Seconds a node's datapath may stay silent (datapaths send a heartbeat every 10 s) before its "
        "endpoints stop counting in 'realized on n/N' and in WaitForRevision, until it reports again.",
        default=60.0,
    )
    bump_interval: float = setting(
        "Least seconds between two bare revision bumps to one node: a node none of whose identities a "
        "change touches is told the new revision at most this often (it enforces nothing new and owes "
        "no report; WaitForRevision does not wait for it). 0 sends one with every change.",
        default=2.0,
    )
    ipam_address: str = setting(
        "IdentityService address host:port, or several (replicas), comma-separated: the leader holds the CIDR "
        "identities of the prefixes policies name there.",
        default="127.0.0.1:9403",
    )
    rpc_timeout: float = setting("Seconds one call to IdentityService may take.", default=10.0)
    cidr_resync_interval: float = setting(
        "Seconds between two checks that ipam still holds the CIDR identities the policies name.", default=60.0
    )
    max_batch: int = setting(
        "Most queued changes folded into one engine batch (one order per node per batch).", default=512
    )

    def validate(self) -> None:
        if self.bump_interval < 0:
            raise ConfigError(f"--bump-interval {self.bump_interval} is negative; use 0 (every change) or more")
        if self.max_order_bytes < 1024:
            raise ConfigError(f"--max-order-bytes {self.max_order_bytes} is too small; use 1024 or more")
        if self.max_order_chunks < 1:
            raise ConfigError(f"--max-order-chunks {self.max_order_chunks} must be at least 1")
        if not _BUCKET_RE.match(self.state_bucket):
            raise ConfigError(
                f"--state-bucket {self.state_bucket!r} is not a valid bucket name; use letters, digits, - and _"
            )
        if self.wait_timeout <= 0 or self.max_wait_timeout < self.wait_timeout:
            raise ConfigError(
                f"--wait-timeout {self.wait_timeout} must be positive and at most --max-wait-timeout "
                f"{self.max_wait_timeout}"
            )
        if not 0.5 <= self.leader_lease <= 60:
            raise ConfigError(f"--leader-lease {self.leader_lease} must be between 0.5 and 60 seconds")
        if self.member and not _BUCKET_RE.match(self.member):
            raise ConfigError(f"--member {self.member!r} is not a valid name; use letters, digits, - and _")
        if self.node_grace < 1:
            raise ConfigError(f"--node-grace {self.node_grace} must be at least 1 second (datapaths beat every 10)")
        try:
            parse_addresses(self.ipam_address)
        except ValueError as exc:
            raise ConfigError(f"--ipam-address {self.ipam_address!r}: {exc}; use host:port[,host:port...]") from None
        if self.rpc_timeout <= 0:
            raise ConfigError(f"--rpc-timeout must be positive, got {self.rpc_timeout}")
        if self.cidr_resync_interval < 1:
            raise ConfigError(f"--cidr-resync-interval {self.cidr_resync_interval} must be at least 1 second")
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch {self.max_batch} must be at least 1")
