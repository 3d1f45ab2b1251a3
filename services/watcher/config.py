"""Watcher configuration."""

from __future__ import annotations

import dataclasses

from services.common.config import CommonConfig, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class WatcherConfig(CommonConfig):
    """Publish Kubernetes deltas (or a manifest folder's) to NATS."""

    source: str = setting("Where objects come from: 'manifests' or 'kubernetes'.", default="manifests")
    manifests: str = setting("Folder of YAML manifests for the manifests source.", default="examples")
    kubeconfig: str = setting("kubeconfig path for the kubernetes source; empty uses in-cluster config.", default="")
