"""Datapath service configuration."""

from __future__ import annotations

import dataclasses
import os

from services.common.config import CommonConfig, ConfigError, setting
from services.common.grpcserver import parse_addresses
from services.datapath.loader import ATTACH_MODES


#: --allow-localhost values: host traffic always allowed, or judged by policy.
ALLOW_LOCALHOST = ("always", "policy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatapathConfig(CommonConfig):
    """Realize policy entries in BPF on this node."""

    policy_address: str = setting("PolicyService address host:port.", default="127.0.0.1:9402")
    ipam_address: str = setting(
        "IdentityService/IPAMService address host:port, or several (replicas), comma-separated.",
        default="127.0.0.1:9403",
    )
    state_dir: str = setting("Per-endpoint state directory.", default="/var/run/palisade/datapath")
    bpffs: str = setting("Where maps and programs are pinned.", default="/sys/fs/bpf/palisade")
    attach: str = setting(
        "How programs go on pod veths: tcx (BPF links, kernel 6.6+), tc (clsact filters, any kernel), "
        "or auto (tcx where the kernel has it).",
        default="auto",
    )
    local_delivery: bool = setting(
        "Pass packets between pods of this node straight into the destination pod (its ingress policy "
        "judged on the way, as in Cilium's BPF host routing); off, they go through the host's routing and "
        "netfilter (for host firewall rules that must see pod-to-pod traffic).",
        default=True,
    )
    allow_localhost: str = setting(
        "Traffic into a pod from its own node (its host namespace: kubelet's probes): always (allowed "
        "whatever the policy, as Kubernetes specifies and Cilium's default) or policy (judged like any "
        "other peer, as the reserved identity host).",
        default="always",
    )
    rpc_timeout: float = setting("Seconds one call to PolicyService or IPAMService may take.", default=10.0)
    repair_interval: float = setting(
        "Seconds between full dumps of every endpoint's policy map to repair drift (0 disables).",
        default=60.0,
    )
    retry_backoff_max: float = setting(
        "Longest wait, seconds, between retries of a failed resync or report.", default=5.0
    )
    flow_poll_ms: int = setting(
        "Milliseconds a read of the flow ring buffer waits for events; while no Observe client listens,"
        " the milliseconds between two takes of them.",
        default=200,
    )
    observe_buffer: int = setting(
        "Flow events buffered per Observe client; a slower client loses the oldest.", default=4096
    )
    cni_socket: str = setting(
        "Unix socket the CNI plugin calls (owner-only; its directory also holds the plugin's queue of "
        "deletions made while the datapath was down); default <state-dir>/cni.sock.",
        default="",
    )
    cni_sweep_interval: float = setting(
        "Seconds between sweeps for queued CNI deletions and endpoints whose namespace vanished.", default=5.0
    )

    @property
    def cni_socket_path(self) -> str:
        return self.cni_socket or os.path.join(self.state_dir, "cni.sock")

    def validate(self) -> None:
        for name in ("policy_address", "ipam_address"):
            value = getattr(self, name)
            try:
                parse_addresses(value)
            except ValueError as exc:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {value!r}: {exc}; give the service's gRPC address") from None
        if not self.state_dir:
            raise ConfigError("--state-dir is empty; give a directory for per-endpoint state")
        if not self.bpffs:
            raise ConfigError("--bpffs is empty; give a directory under /sys/fs/bpf")
        if self.attach not in ATTACH_MODES:
            raise ConfigError(f"--attach {self.attach!r}: give one of {', '.join(ATTACH_MODES)}")
        if self.allow_localhost not in ALLOW_LOCALHOST:
            raise ConfigError(
                f"--allow-localhost {self.allow_localhost!r}: give one of {', '.join(ALLOW_LOCALHOST)}"
            )
        if self.rpc_timeout <= 0:
            raise ConfigError(f"--rpc-timeout must be positive, got {self.rpc_timeout}")
        if self.repair_interval < 0:
            raise ConfigError(f"--repair-interval must be >= 0 (0 disables), got {self.repair_interval}")
        if self.flow_poll_ms <= 0 or self.observe_buffer <= 0:
            raise ConfigError("--flow-poll-ms and --observe-buffer must be positive")
