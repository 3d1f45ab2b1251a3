"""Datapath service configuration."""

from __future__ import annotations

import dataclasses
import ipaddress
import os

from services.common.config import CommonConfig, ConfigError, setting
from services.common.grpcserver import parse_addresses
from services.datapath.loader import ATTACH_MODES
from services.datapath.routing import MODES as ROUTING_MODES

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
        "How programs go on pod veths: tc (clsact filters, any kernel), tcx (BPF links, kernel 6.6+: each "
        "attach waits an RCU grace period under the rtnl lock, ~26 ms per pod, and a packet crossing both "
        "hooks costs less), or auto (tcx where the kernel has it). Unset: tc with --local-delivery, auto "
        "without it (every packet then crosses both hooks).",
        default="",
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
    routing: str = setting(
        "How pods reach the other nodes' pods: tunnel (a VXLAN device, for nodes that share no network; "
        "Cilium's default), direct (routes to each node's pod CIDRs via its address, for nodes on one "
        "network, as Cilium's auto-direct-node-routes), or none (another plugin or the cloud routes pods).",
        default="tunnel",
    )
    tunnel_port: int = setting("UDP port of the VXLAN tunnel (--routing tunnel), the same on every node.", default=8472)
    node_resync_interval: float = setting(
        "Seconds between full re-applications of the routes to other nodes (ipam asked again; repairs drift).",
        default=30.0,
    )
    masquerade: bool = setting(
        "Pod traffic to addresses outside the cluster's pod CIDRs, its node addresses and "
        "--non-masquerade-cidrs leaves with the node's address (nftables; replies find their pod).",
        default=True,
    )
    non_masquerade_cidrs: str = setting(
        "Comma-separated CIDRs pods reach with their own address, besides the cluster's pod CIDRs and "
        "node addresses (ip-masq-agent's nonMasqueradeCIDRs: a VPC range, a peered network).",
        default="",
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
    flow_ring_size: int = setting(
        "Recent flow events kept in memory so `palisade observe --last/--since` and `policy diff` see "
        "traffic that no client watched (0 keeps none: events are skipped while nobody observes).",
        default=16384,
    )
    flow_ring_rate: int = setting(
        "Flow events a second decoded for the ring while no Observe client listens (0: all); beyond it "
        "they are counted, not recorded, so a flood of drops does not take the CPU the packets need.",
        default=5000,
    )
    dns_proxy_port: int = setting(
        "Port of the node's DNS proxy (services.datapath.dnsproxyd, the same setting there): DNS queries "
        "of endpoints a DNS rule selects are steered to it.",
        default=10053,
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
    def non_masquerade(self) -> tuple[str, ...]:
        return tuple(c.strip() for c in self.non_masquerade_cidrs.split(",") if c.strip())

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
        if self.attach and self.attach not in ATTACH_MODES:
            raise ConfigError(f"--attach {self.attach!r}: give one of {', '.join(ATTACH_MODES)}")
        if self.allow_localhost not in ALLOW_LOCALHOST:
            raise ConfigError(f"--allow-localhost {self.allow_localhost!r}: give one of {', '.join(ALLOW_LOCALHOST)}")
        if self.routing not in ROUTING_MODES:
            raise ConfigError(f"--routing {self.routing!r}: give one of {', '.join(ROUTING_MODES)}")
        if not 0 < self.tunnel_port < 65536:
            raise ConfigError(f"--tunnel-port {self.tunnel_port} is not a UDP port (1-65535)")
        if self.node_resync_interval <= 0:
            raise ConfigError(f"--node-resync-interval must be positive, got {self.node_resync_interval}")
        for cidr in self.non_masquerade:
            try:
                ipaddress.ip_network(cidr)
            except ValueError as exc:
                raise ConfigError(
                    f"--non-masquerade-cidrs: {cidr!r} is not a CIDR ({exc}); give prefixes such as 10.0.0.0/8"
                ) from None
        if self.rpc_timeout <= 0:
            raise ConfigError(f"--rpc-timeout must be positive, got {self.rpc_timeout}")
        if self.repair_interval < 0:
            raise ConfigError(f"--repair-interval must be >= 0 (0 disables), got {self.repair_interval}")
        if self.flow_poll_ms <= 0 or self.observe_buffer <= 0:
            raise ConfigError("--flow-poll-ms and --observe-buffer must be positive")
        if self.flow_ring_rate < 0:
            raise ConfigError(f"--flow-ring-rate must be >= 0 (0: no limit), got {self.flow_ring_rate}")
        if self.flow_ring_size < 0:
            raise ConfigError(f"--flow-ring-size must be >= 0 (0 keeps no flows), got {self.flow_ring_size}")
