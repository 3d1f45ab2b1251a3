"""Prometheus metrics of the watcher.

Registered on a given registry so several watchers (tests, benchmarks) can live in
one process; the service uses the default registry that ``--metrics-listen`` serves.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.watcher.kinds import KINDS


class WatcherMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else prometheus_client.REGISTRY
        self.received = Counter(
            "palisade_watcher_events_received",
            "Events received from the source (list items, watch events, manifest objects), per kind.",
            ["kind"],
            registry=reg,
        )
        self.skipped = Counter(
            "palisade_watcher_events_skipped",
            "Events that changed nothing policy-relevant and were not published, per kind.",
            ["kind"],
            registry=reg,
        )
        self.published = Counter(
            "palisade_watcher_deltas_published",
            "Deltas acked by JetStream, per kind and op (upsert, delete).",
            ["kind", "op"],
            registry=reg,
        )
        self.errors = Counter(
            "palisade_watcher_errors",
            "Source errors, per kind ('' for manifest files) and reason.",
            ["kind", "reason"],
            registry=reg,
        )
        self.relists = Counter(
            "palisade_watcher_relists",
            "Full relists after the watch history expired (410 Gone), per kind.",
            ["kind"],
            registry=reg,
        )
        self.objects = Gauge("palisade_watcher_objects", "Objects currently known, per kind.", ["kind"], registry=reg)
        self.pending = Gauge("palisade_watcher_publish_pending", "Messages waiting for a JetStream ack.", registry=reg)
        self.synced = Gauge("palisade_watcher_synced", "1 once every kind's initial list is on the bus.", registry=reg)
        # Export every series from the start so dashboards and tests see zeros, not gaps.
        for info in KINDS:
            kind = info.kind.value
            self.received.labels(kind)
            self.skipped.labels(kind)
            self.relists.labels(kind)
            self.objects.labels(kind)
            for op in ("upsert", "delete"):
                self.published.labels(kind, op)
