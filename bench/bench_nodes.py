"""A dev cluster of three nodes: policy change -> realized on every node, and each node's order bytes.

    sudo .venv/bin/python -m bench.bench_nodes [--changes 40] [--quick]

Runs `make run --nodes 3` (real datapaths, each in its node's namespace, real BPF) on a
manifest folder of its own: namespace ``bench`` with three pods on each node (``spec.nodeName``),
labelled ``home: <node>``. Then, interleaved, ``--changes`` times each:

- **one node**: a CiliumNetworkPolicy selecting only the pods of dev-node-1 changes (its port);
- **all nodes**: one selecting every bench pod changes.

Each change is imported over the API and timed until WaitForRevision says every affected
endpoint on every node realized it. The regeneration orders published meanwhile are read
from the bus and their bytes counted per node: the span shows as nodes that host none of
the selected identities getting only a revision bump.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from nats.js import api as jsapi

from bench.output import logger
from bench.stats import stats_ms
from palisade.v1 import policy_pb2, policy_pb2_grpc
from services.common.bus import Bus
from services.common.grpcserver import grpc_target, open_channel, parse_addresses
from services.common.subjects import REGEN_ALL
from services.common.trust import Credentials

NODES = ["dev-node-1", "dev-node-2", "dev-node-3"]


log = logger("nodes")


def manifests(folder: Path) -> None:
    docs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}}]
    for node in NODES:
        for i in range(3):
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"{node}-p{i}", "namespace": "bench", "labels": {"home": node, "i": str(i)}},
                    "spec": {"nodeName": node, "containers": [{"name": "c", "ports": [{"containerPort": 80}]}]},
                }
            )
    (folder / "pods.yaml").write_text(yaml.safe_dump_all(docs))


def policy(name: str, selector: dict[str, str], port: int) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNetworkPolicy",
            "metadata": {"name": name, "namespace": "bench"},
            "spec": {
                "endpointSelector": {"matchLabels": selector},
                "ingress": [
                    {
                        "fromEndpoints": [{"matchLabels": {"i": "0"}}],
                        "toPorts": [{"ports": [{"port": str(port), "protocol": "TCP"}]}],
                    }
                ],
            },
        }
    )


class OrderBytes:
    """Bytes of the regeneration orders published per node, read from the bus."""

    def __init__(self) -> None:
        self.per_node: dict[str, int] = dict.fromkeys(NODES, 0)

    async def start(self, bus: Bus) -> None:
        async def on_msg(msg: Any) -> None:
            node = msg.subject.rpartition(".")[2]
            self.per_node[node] = self.per_node.get(node, 0) + len(msg.data)

        await bus.js.subscribe(
            REGEN_ALL,
            cb=on_msg,
            ordered_consumer=True,
            config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.NEW),
        )

    def take(self) -> dict[str, int]:
        out, self.per_node = self.per_node, dict.fromkeys(NODES, 0)
        return out


async def measure(stack: Any, changes: int) -> dict[str, Any]:
    tls = stack.tls_dir
    bus = await Bus.connect(
        [f"nats://{a}" for a in _nats(stack)], name="bench-nodes", tls=Credentials.load(tls, "policy")
    )
    orders = OrderBytes()
    await orders.start(bus)
    target = grpc_target(parse_addresses(stack.address("policy")))
    channel = open_channel(target, "policy", Credentials.load(tls, "cli"))
    api = policy_pb2_grpc.PolicyServiceStub(channel)
    cases = {"one_node": ("one", {"home": "dev-node-1"}), "all_nodes": ("all", {})}
    times: dict[str, list[float]] = {c: [] for c in cases}
    sent: dict[str, list[dict[str, int]]] = {c: [] for c in cases}
    try:
        port = 1000
        for round_ in range(changes + 1):  # the first round is a warm-up
            for case, (name, selector) in cases.items():
                port += 1
                await asyncio.sleep(0.2)  # let the previous change's orders arrive
                orders.take()
                started = time.perf_counter()
                answer = await api.ImportPolicies(
                    policy_pb2.ImportPoliciesRequest(documents=policy(name, selector, port)), timeout=30
                )
                waited = await api.WaitForRevision(
                    policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=30), timeout=35
                )
                took = time.perf_counter() - started
                if not waited.realized:
                    raise RuntimeError(f"revision {answer.revision} not realized: {waited}")
                await asyncio.sleep(0.2)
                if round_:
                    times[case].append(took * 1000)
                    sent[case].append(orders.take())
    finally:
        await channel.close()
        await bus.close()
    out: dict[str, Any] = {}
    for case in cases:
        out[case] = {
            "change_to_realized_ms": stats_ms(times[case]),
            "order_bytes_per_change": {n: round(sum(s[n] for s in sent[case]) / len(sent[case])) for n in NODES},
        }
    return out


def _nats(stack: Any) -> list[str]:
    return [line.split()[1] for line in stack.output if line.strip().startswith("nats")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--changes", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="5 changes")
    args = p.parse_args(argv)
    if args.quick:
        args.changes = 5
    from testkit.stack import running_stack  # needs root: the stack makes namespaces

    with tempfile.TemporaryDirectory(prefix="palisade-bench-nodes-") as tmp:
        folder = Path(tmp) / "examples"
        folder.mkdir()
        manifests(folder)
        with running_stack(Path(tmp), folder, "--nodes", "3", "--node-subnet", "172.31.253.0/24") as stack:
            log("3 nodes up")
            result = asyncio.run(measure(stack, args.changes))
    one, every = result["one_node"], result["all_nodes"]
    summary = [
        {"metric": "change -> realized on 3 nodes p50", "value": every["change_to_realized_ms"]["p50"], "unit": "ms"},
        {"metric": "change -> realized on 3 nodes p99", "value": every["change_to_realized_ms"]["p99"], "unit": "ms"},
        {"metric": "change on one node's pods -> realized p50", "value": one["change_to_realized_ms"]["p50"],
         "unit": "ms"},
    ]  # fmt: skip
    for node in NODES:
        for label, case in (("one node selected", one), ("all selected", every)):
            bytes_ = case["order_bytes_per_change"][node]
            summary.append({"metric": f"order bytes to {node}, {label}", "value": bytes_, "unit": "B"})
    print(json.dumps({**result, "changes": args.changes, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
