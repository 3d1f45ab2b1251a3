"""Datapath service configuration."""

from __future__ import annotations

import dataclasses

from services.common.config import CommonConfig, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatapathConfig(CommonConfig):
    """Realize policy entries in BPF on this node."""

    policy_address: str = setting("PolicyService address host:port.", default="127.0.0.1:9402")
    ipam_address: str = setting("IdentityService/IPAMService address host:port.", default="127.0.0.1:9403")
    state_dir: str = setting("Per-endpoint state directory.", default="/var/run/palisade/datapath")
    bpffs: str = setting("Where maps and programs are pinned.", default="/sys/fs/bpf/palisade")
