"""Prometheus metrics of the policy service (names are a contract for dashboards)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

IMPLEMENTATION_DELAY = Histogram(
    "palisade_policy_implementation_delay_seconds",
    "From a policy-relevant change arriving at the policy service to the last affected endpoint "
    "reporting the revision that carries it (Cilium's policy implementation delay).",
    buckets=_DELAY_BUCKETS,
)
REVISION = Gauge("palisade_policy_revision", "Current policy repository revision.")
POLICIES = Gauge("palisade_policy_policies", "Policy objects known, by source and state.", ["source", "state"])
REJECTED = Counter("palisade_policy_rejected_total", "Policy documents rejected by validation, by source.", ["source"])
ORDERS = Counter(
    "palisade_policy_orders_total",
    "Regeneration orders published, by form (diff, bump, replace, chunked, fetch).",
    ["form"],
)
ORDER_BYTES = Histogram(
    "palisade_policy_order_bytes",
    "Size of published regeneration order messages.",
    buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576),
)
PUBLISH_SECONDS = Histogram(
    "palisade_policy_publish_seconds",
    "Time to persist the state and publish the orders of one batch.",
    buckets=_DELAY_BUCKETS,
)
COMPUTE_SECONDS = Histogram(
    "palisade_policy_compute_seconds",
    "Time to fold one batch of changes into the engine and plan its orders.",
    buckets=_DELAY_BUCKETS,
)
REALIZED_REPORTS = Counter("palisade_policy_realized_reports_total", "Realized reports received from datapaths.")
