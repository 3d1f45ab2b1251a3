"""Prometheus metrics of the datapath (names are a contract for dashboards).

Besides the order-to-report histogram, everything is collected at scrape time, in
the metrics server's thread, by :class:`AgentCollector`:

* from what the agent counts anyway (the status provider shows most of it too):
  plain ints, and the endpoint table copied with one ``dict.copy()``, which runs no
  Python code and so is a consistent snapshot under the GIL while the event loop
  changes the table;
* from the kernel's packet counters, through ``counters()`` of the datapath facade,
  which takes the facade's lock and so is safe from any thread. One read serves every
  scrape within ``min_interval`` seconds, so scrapers cannot hammer the map.

The kernel counts per endpoint and deletes an endpoint's counters with it; the
totals exported here are per node and must never go down, so :class:`KernelTotals`
keeps what the endpoints that went had counted (as of the last read before they
went: packets of an endpoint's last moments may be missing, never counted twice).

Registered on a given registry so tests can run several agents in one process; the
service uses the default registry that ``--metrics-listen`` serves.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.log import get_logger
from services.datapath.datapath import CounterSource
from services.datapath.flows import FlowCountKey, FlowHub, count_key
from services.datapath.manager import EndpointManager
from services.datapath.orders import OrderConsumer, Reporter
from services.datapath.types import CounterKey, Counters, CounterValue, Direction, EndpointState, Reason

log = get_logger("metrics")

_DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

Totals = dict[tuple[Reason, Direction], CounterValue]


class KernelTotals:
    """Per-node packet and byte totals over per-endpoint kernel counters that come and go. Pure."""

    def __init__(self) -> None:
        self._last: dict[CounterKey, CounterValue] = {}
        self._gone: Totals = {}
        self.events_lost = 0

    def update(self, counters: Counters) -> None:
        for key, old in self._last.items():
            new = counters.values.get(key)
            if new is None or new.packets < old.packets or new.bytes < old.bytes:
                # The endpoint went, and its counters with it (a lower count: its id was reused since).
                _add(self._gone, (key.reason, key.direction), old)
        self._last = dict(counters.values)
        self.events_lost = max(self.events_lost, counters.events_lost)

    def totals(self) -> Totals:
        out = dict(self._gone)
        for key, value in self._last.items():
            _add(out, (key.reason, key.direction), value)
        return out


def _add(into: Totals, key: tuple[Reason, Direction], value: CounterValue) -> None:
    old = into.get(key, CounterValue(0, 0))
    into[key] = CounterValue(old.packets + value.packets, old.bytes + value.bytes)


@dataclasses.dataclass(frozen=True)
class AgentParts:
    """What the collector reads: the agent's components and the facade's counters."""

    manager: EndpointManager
    consumer: OrderConsumer
    reporter: Reporter
    flows: FlowHub
    counters: CounterSource


class AgentCollector(Collector):
    """Collects the agent's figures and the kernel's packet counters at scrape time."""

    def __init__(self, parts: AgentParts, min_interval: float = 1.0) -> None:
        self._parts = parts
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._kernel = KernelTotals()
        self._read_at: float | None = None

    def _read_kernel(self) -> tuple[Totals, int]:
        with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self._min_interval:
                try:
                    counters = self._parts.counters.counters()
                except Exception as exc:  # closed while shutting down, or a map read failed: keep the last values
                    log.warning("reading BPF counters for metrics failed", error=str(exc))
                else:
                    self._kernel.update(counters)
                    self._read_at = now
            return self._kernel.totals(), self._kernel.events_lost

    def describe(self) -> Iterator[prometheus_client.Metric]:
        # The families without reading anything (registering calls this).
        return _families(_Figures(), {}, 0)

    def collect(self) -> Iterator[prometheus_client.Metric]:
        p = self._parts
        endpoints = list(p.manager.endpoints.copy().values())
        figures = _Figures(
            states=[ep.state for ep in endpoints],
            revision=min(ep.realized_revision for ep in endpoints) if endpoints else p.manager.revision,
            applied=p.consumer.applied,
            replaces=p.consumer.replaces,
            resyncs=p.consumer.resyncs,
            gaps=p.consumer.sequencer.gaps,
            reports=p.reporter.delivered,
            flow_events=p.flows.events,
            flow_dropped=p.flows.dropped,
            ring_skipped=p.flows.ring_skipped,
            flows={count_key(raw): n for raw, n in p.flows.counts.copy().items()},
            ring=len(p.flows.ring),
            address_picks=p.manager.address_picks,
        )
        totals, events_lost = self._read_kernel()
        return _families(figures, totals, events_lost)


@dataclasses.dataclass(frozen=True)
class _Figures:
    """The agent's own figures at one scrape."""

    states: list[EndpointState] = dataclasses.field(default_factory=list)
    revision: int = 0
    applied: int = 0
    replaces: int = 0
    resyncs: int = 0
    gaps: int = 0
    reports: int = 0
    flow_events: int = 0
    flow_dropped: int = 0
    ring_skipped: int = 0
    flows: dict[FlowCountKey, int] = dataclasses.field(default_factory=dict)
    ring: int = 0
    address_picks: tuple[int, int] = (0, 0)


def _families(f: _Figures, totals: Totals, events_lost: int) -> Iterator[prometheus_client.Metric]:
    states = GaugeMetricFamily("palisade_datapath_endpoints", "Local endpoints, by state.", labels=["state"])
    counts = dict.fromkeys(EndpointState, 0)
    for state in f.states:
        counts[state] += 1
    for state, n in counts.items():
        states.add_metric([state.value], n)
    yield states
    yield GaugeMetricFamily(
        "palisade_datapath_realized_revision",
        "Lowest policy revision realized over the local endpoints (the node's when it has none).",
        value=f.revision,
    )

    orders = CounterMetricFamily(
        "palisade_datapath_orders_applied",
        "Regeneration orders applied, by form (diff: incremental; replace: the whole state).",
        labels=["form"],
    )
    orders.add_metric(["diff"], f.applied)
    orders.add_metric(["replace"], f.replaces)
    yield orders
    yield CounterMetricFamily(
        "palisade_datapath_resyncs", "Full resyncs fetched from PolicyService and applied.", value=f.resyncs
    )
    picks = CounterMetricFamily(
        "palisade_datapath_address_picks",
        "Pod addresses picked on the node, by IPAM's outcome (refused: another process took the address "
        "meanwhile, and the create asked IPAM to choose).",
        labels=["outcome"],
    )
    picks.add_metric(["recorded"], f.address_picks[0])
    picks.add_metric(["refused"], f.address_picks[1])
    yield picks
    yield CounterMetricFamily(
        "palisade_datapath_sequence_gaps",
        "Gaps found in the node's order sequence (each is repaired by a resync).",
        value=f.gaps,
    )
    yield CounterMetricFamily(
        "palisade_datapath_realized_reports",
        "Realized reports (and deletions) delivered to PolicyService.",
        value=f.reports,
    )

    families: dict[tuple[bool, str], CounterMetricFamily] = {}
    for drop, verb in ((False, "forwarded"), (True, "dropped")):
        for unit in ("packets", "bytes"):
            families[(drop, unit)] = CounterMetricFamily(
                f"palisade_datapath_{verb}_{unit}",
                f"{unit.capitalize()} the BPF programs {verb}, by reason and direction "
                "(summed over endpoints, deleted ones included).",
                labels=["reason", "direction"],
            )
    for reason in Reason:
        for direction in Direction:
            total = totals.get((reason, direction), CounterValue(0, 0))
            labels = [reason.value, direction.value]
            families[(reason.is_drop, "packets")].add_metric(labels, total.packets)
            families[(reason.is_drop, "bytes")].add_metric(labels, total.bytes)
    yield from families.values()

    yield CounterMetricFamily(
        "palisade_datapath_flow_events",
        "Flow events read from the ring buffer and handed to Observe clients.",
        value=f.flow_events,
    )
    lost = CounterMetricFamily(
        "palisade_datapath_flow_events_lost",
        "Flow events lost, by stage (ring_buffer: the kernel had no room; "
        "observer: dropped from the buffer of an Observe client that could not keep up; ring_rate: "
        "not recorded in the flow ring, beyond --flow-ring-rate a second while nobody observed).",
        labels=["stage"],
    )
    lost.add_metric(["ring_buffer"], events_lost)
    lost.add_metric(["observer"], f.flow_dropped)
    lost.add_metric(["ring_rate"], f.ring_skipped)
    yield lost
    flows = CounterMetricFamily(
        "palisade_datapath_flows",
        "Flow events decoded (recorded in the flow ring, or handed to Observe clients), by verdict "
        "(allow, deny, audit), reason and direction.",
        labels=["verdict", "reason", "direction"],
    )
    for key, n in sorted(f.flows.items()):
        flows.add_metric([key.verdict, key.reason, key.direction], n)
    yield flows
    yield GaugeMetricFamily(
        "palisade_datapath_flow_ring_events", "Flow events held in the node's flow ring.", value=f.ring
    )


class DatapathMetrics:
    """The datapath's metrics for one agent, registered on ``registry`` (the default one if None)."""

    def __init__(
        self, parts: AgentParts, registry: CollectorRegistry | None = None, *, min_interval: float = 1.0
    ) -> None:
        reg = registry if registry is not None else prometheus_client.REGISTRY
        self.order_realized = Histogram(
            "palisade_datapath_order_realized_seconds",
            "From an incremental order reaching the node to the delivery of the ReportRealized that carries "
            "its revision (orders that leave no endpoint to report are not counted).",
            buckets=_DELAY_BUCKETS,
            registry=reg,
        )
        self.collector = AgentCollector(parts, min_interval)
        reg.register(self.collector)
        parts.reporter.on_order_realized = self.order_realized.observe
