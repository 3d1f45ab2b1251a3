"""Prometheus metrics of ipam (names are a contract for dashboards).

Counters and the latency histogram are updated where things happen. How many
identities and addresses exist is collected at scrape time, in the metrics server's
thread, by :class:`StateCollector`: the allocators answer from their caches with one
``dict.copy()``, which runs no Python code and so is a consistent snapshot under the
GIL while the event loop changes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

import prometheus_client
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.ipam.model import Kind

#: The gRPC methods that allocate; their latency and errors are measured.
ALLOCATION_METHODS = ("AllocateIdentity", "AllocateIP")
#: Kinds of identities that are allocated (reserved ones are fixed).
ALLOCATED_KINDS = (Kind.CLUSTER, Kind.CIDR)

IDENTITY_ALLOCATIONS = Counter(
    "palisade_ipam_identity_allocations_total",
    "Identity references taken (AllocateIdentity and pods from the bus), by kind and result "
    "(created: a new identity; existing). Reserved label sets take no reference and are not counted.",
    ["kind", "result"],
)
ETCD_TRANSACTIONS = Counter(
    "palisade_ipam_etcd_transactions_total",
    "Transactions ipam sent to etcd, alone or together with others in one batch.",
)
ETCD_BATCHES = Counter(
    "palisade_ipam_etcd_batches_total",
    "Requests to etcd that carried ipam's transactions: transactions / batches is the mean batch size.",
)
IDENTITY_RELEASES = Counter(
    "palisade_ipam_identity_releases_total",
    "Identity references released (ReleaseIdentity and pods that went), by kind. References dropped "
    "with a node's lease are not counted.",
    ["kind"],
)
IDENTITIES_COLLECTED = Counter(
    "palisade_ipam_identities_collected_total",
    "Unreferenced identities deleted by the collector after the grace period, by kind.",
    ["kind"],
)
ALLOCATION_ERRORS = Counter(
    "palisade_ipam_allocation_errors_total",
    "AllocateIdentity and AllocateIP calls answered with an error, by method and gRPC status code.",
    ["method", "code"],
)
ALLOCATION_SECONDS = Histogram(
    "palisade_ipam_allocation_seconds",
    "Time to answer AllocateIdentity and AllocateIP (errors included), by method.",
    ["method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

# Export every series from the start so dashboards and tests see zeros, not gaps.
for _kind in ALLOCATED_KINDS:
    for _result in ("created", "existing"):
        IDENTITY_ALLOCATIONS.labels(_kind.value, _result)
    IDENTITY_RELEASES.labels(_kind.value)
    IDENTITIES_COLLECTED.labels(_kind.value)
for _method in ALLOCATION_METHODS:
    ALLOCATION_SECONDS.labels(_method)


def served(method: str, code: str, seconds: float) -> None:
    """One gRPC call answered with ``code`` (a ``grpc.StatusCode`` name) after ``seconds``."""
    if method not in ALLOCATION_METHODS:
        return
    ALLOCATION_SECONDS.labels(method).observe(seconds)
    if code != "OK":
        ALLOCATION_ERRORS.labels(method, code).inc()


class IdentityCounts(Protocol):
    def count_by_kind(self) -> Mapping[Kind, int]: ...


class AllocationCounts(Protocol):
    def count_by_node(self) -> Mapping[str, int]: ...


class StateCollector(Collector):
    """Identities by kind and addresses by node, as this process knows them, at scrape time."""

    def __init__(self, identities: IdentityCounts, addresses: AllocationCounts) -> None:
        self._identities = identities
        self._addresses = addresses

    def describe(self) -> Iterator[prometheus_client.Metric]:
        # The families without reading anything (registering calls this).
        return _families({}, {})

    def collect(self) -> Iterator[prometheus_client.Metric]:
        return _families(self._identities.count_by_kind(), self._addresses.count_by_node())


def _families(kinds: Mapping[Kind, int], nodes: Mapping[str, int]) -> Iterator[prometheus_client.Metric]:
    identities = GaugeMetricFamily(
        "palisade_ipam_identities",
        "Allocated identities, by kind (this process's view of etcd, refreshed by every collector pass).",
        labels=["kind"],
    )
    for kind in ALLOCATED_KINDS:
        identities.add_metric([kind.value], kinds.get(kind, 0))
    yield identities
    addresses = GaugeMetricFamily("palisade_ipam_ip_allocations", "Pod addresses allocated, by node.", labels=["node"])
    for node in sorted(nodes):
        addresses.add_metric([node], nodes[node])
    yield addresses


def register_state(
    identities: IdentityCounts, addresses: AllocationCounts, registry: prometheus_client.CollectorRegistry | None = None
) -> StateCollector:
    """Export the allocators' state on ``registry`` (the default one if None)."""
    collector = StateCollector(identities, addresses)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
