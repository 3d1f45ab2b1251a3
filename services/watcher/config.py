"""Watcher configuration."""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from pathlib import Path

from services.common.config import CommonConfig, ConfigError, setting


class SourceKind(enum.StrEnum):
    MANIFESTS = "manifests"
    KUBERNETES = "kubernetes"


@dataclasses.dataclass(frozen=True, kw_only=True)
class WatcherConfig(CommonConfig):
    """Publish Kubernetes deltas (or a manifest folder's) to NATS."""

    source: str = setting("Where objects come from: 'manifests' or 'kubernetes'.", default="manifests")
    manifests: str = setting("Folder of YAML manifests for the manifests source.", default="examples")
    kubeconfig: str = setting("kubeconfig path for the kubernetes source; empty uses in-cluster config.", default="")
    manifests_poll: float = setting(
        "Seconds between two polls of the manifest folder where file-system notifications are off or "
        "unavailable (with them, the folder is also polled every 5 s as a safety net).",
        default=0.5,
    )
    manifests_notify: bool = setting(
        "React to file-system notifications (inotify) on the manifest folder within milliseconds.", default=True
    )
    dev_nodes: str = setting(
        "Manifests source only: the nodes of a dev cluster, NAME=ADDRESS comma-separated. The source then "
        "plays the scheduler (a pod whose spec.nodeName names none of them gets one, spread by its name) "
        "and lists a Node object for each node the folder does not define.",
        default="",
    )
    service_cidr: str = setting(
        "Manifests source only: play a dev cluster's controllers: Services written without a clusterIP get "
        "one from this range, and Services with a selector get the EndpointSlices Kubernetes would keep "
        "(from the pods' addresses, which ipam publishes). Empty: neither.",
        default="",
    )
    watch_timeout: int = setting(
        "Seconds the API server keeps one watch request open before it is renewed.", default=300
    )
    backoff_initial: float = setting("First wait after a failed list/watch, seconds (doubles).", default=0.2)
    backoff_max: float = setting("Longest wait between list/watch attempts, seconds.", default=10.0)
    missing_kind_retry: float = setting(
        "Seconds between attempts to list a kind the API server does not serve (CRD not installed).", default=10.0
    )
    list_page_size: int = setting("Objects per page of a list request.", default=500)
    publish_inflight: int = setting(
        "Subjects published concurrently to JetStream (order per subject is kept).", default=256
    )

    def dev_node_addresses(self) -> dict[str, str]:
        """``--dev-nodes`` as name -> address; ValueError naming a malformed item."""
        out: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in self.dev_nodes.split(","))):
            name, sep, address = item.partition("=")
            if not sep or not name or not address:
                raise ValueError(f"{item!r} is not NAME=ADDRESS")
            ipaddress.ip_address(address)
            out[name] = address
        return out

    def source_kind(self) -> SourceKind:
        return SourceKind(self.source)

    def validate(self) -> None:
        if self.source not in {s.value for s in SourceKind}:
            raise ConfigError(f"--source {self.source!r} is not one of: manifests, kubernetes")
        if self.source == SourceKind.MANIFESTS and not Path(self.manifests).is_dir():
            raise ConfigError(
                f"--manifests {self.manifests!r} is not a folder; create it or point --manifests at your manifests"
            )
        try:
            self.dev_node_addresses()
        except ValueError as exc:
            raise ConfigError(f"--dev-nodes {self.dev_nodes!r}: {exc}") from None
        if self.service_cidr:
            try:
                network = ipaddress.ip_network(self.service_cidr)
            except ValueError as exc:
                raise ConfigError(f"--service-cidr {self.service_cidr!r}: {exc}") from None
            if network.num_addresses < 4:
                raise ConfigError(f"--service-cidr {self.service_cidr!r}: give a range of at least 4 addresses")
        positive = {
            "--manifests-poll": self.manifests_poll,
            "--watch-timeout": self.watch_timeout,
            "--backoff-initial": self.backoff_initial,
            "--backoff-max": self.backoff_max,
            "--missing-kind-retry": self.missing_kind_retry,
            "--list-page-size": self.list_page_size,
            "--publish-inflight": self.publish_inflight,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{flag} must be greater than 0, got {value}")
        if self.backoff_max < self.backoff_initial:
            raise ConfigError(
                f"--backoff-max ({self.backoff_max}) is below --backoff-initial ({self.backoff_initial}); raise it"
            )
