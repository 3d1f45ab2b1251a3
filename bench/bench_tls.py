"""What mutual TLS costs on the hot paths: orders over NATS and realized reports over gRPC.

    .venv/bin/python -m bench.bench_tls [--messages 400] [--reports 400] [--rounds 3] [--quick]

Two installations run side by side on loopback: one as shipped (NATS with TLS and the
components' users, the policy service on mutual TLS), one with TLS off (plain NATS,
services started with --insecure). Rounds alternate between them, so both see the same
machine. Measured per installation:

- orders: a policy-service client publishes RegenerationOrder-sized messages (1 KB and
  16 KB) on ``palisade.regen.<node>``; a datapath client follows the stream. Latency is
  publish to receipt, one message at a time; throughput is a burst of acknowledged
  publishes until the follower has them all.
- reports: a datapath calls ReportRealized on the real policy service, one call at a
  time (latency) and 16 in flight (calls per second).

Prints one JSON object; ``ratios`` are TLS over plaintext (latency: >1 is slower;
throughput: <1 is fewer per second).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.js import api as jsapi

from bench.stats import percentile
from palisade.v1 import policy_pb2, policy_pb2_grpc
from services.common.bus import ALL_STREAMS, Bus
from services.common.grpcserver import open_channel
from services.common.subjects import regen_subject
from testkit.harness import NatsServer, ServiceProcess, creds

NODE = "bench-node"
POLICY = """apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: bench, namespace: bench}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress]
"""


@dataclass
class Installation:
    name: str
    secure: bool
    nats: NatsServer
    policy: ServiceProcess
    procs: list[ServiceProcess]


@contextlib.contextmanager
def installation(tmp: Path, secure: bool) -> Iterator[Installation]:
    name = "tls" if secure else "plain"
    nats = NatsServer(tmp / f"nats-{name}", secure=secure)
    nats.start()
    flags = [] if secure else ["--insecure"]
    common = ["--nats-url", nats.url, "--node-name", NODE, "--log-level", "warning", *flags]
    manifests = tmp / f"manifests-{name}"
    manifests.mkdir()
    # One policy, so the repository is at revision 1 and reports of it are valid.
    (manifests / "policy.yaml").write_text(POLICY)
    procs: list[ServiceProcess] = []
    try:
        watcher = ServiceProcess("watcher", tmp, [*common, "--manifests", str(manifests)])
        procs.append(watcher)
        watcher.start(wait=False)
        policy = ServiceProcess("policy", tmp, common)
        procs.append(policy)
        policy.start(wait=False)
        yield Installation(name, secure, nats, policy, procs)
    finally:
        for proc in procs:
            proc.kill()
        nats.stop()


async def _bus(inst: Installation, who: str) -> Bus:
    return await Bus.connect([inst.nats.url], name=f"bench-{who}", tls=creds(who) if inst.secure else None)


async def orders(inst: Installation, count: int, size: int) -> dict[str, float]:
    """Publish ``count`` orders of ``size`` bytes as the policy service; a datapath follows them."""
    publisher, follower = await _bus(inst, "policy"), await _bus(inst, "datapath")
    try:
        await publisher.ensure_streams(*ALL_STREAMS)
        subject = regen_subject(NODE)
        got: asyncio.Queue[float] = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            got.put_nowait(time.perf_counter())
            await msg.ack()

        config = jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.NEW)
        sub = await follower.js.subscribe(subject, cb=on_msg, ordered_consumer=True, config=config)
        await asyncio.sleep(0.2)
        payload = policy_pb2.RegenerationOrder(node=NODE, sequence=1, revision=1).SerializeToString()
        payload += b"\x00" * max(0, size - len(payload))
        latencies = []
        for _ in range(count):
            sent = time.perf_counter()
            await publisher.js.publish(subject, payload)
            latencies.append((await asyncio.wait_for(got.get(), 10)) - sent)
        start = time.perf_counter()
        await asyncio.gather(*(publisher.js.publish(subject, payload) for _ in range(count)))
        for _ in range(count):
            await asyncio.wait_for(got.get(), 30)
        burst = time.perf_counter() - start
        await sub.unsubscribe()
        return {"latency_ms_p50": percentile(latencies, 0.5) * 1000, "per_s": count / burst}
    finally:
        await publisher.close()
        await follower.close()


async def reports(inst: Installation, count: int) -> dict[str, float]:
    """ReportRealized as a datapath: one at a time, then 16 in flight."""
    channel = open_channel(inst.policy.address, "policy", creds("datapath") if inst.secure else None)
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    try:

        def request(i: int) -> policy_pb2.ReportRealizedRequest:
            report = policy_pb2.RealizedReport(node=NODE, endpoint_id=1 + i % 50, identity=256, revision=1, pod="b/p")
            return policy_pb2.ReportRealizedRequest(reports=[report])

        await stub.ReportRealized(request(0), timeout=10)  # connect and warm up
        latencies = []
        for i in range(count):
            sent = time.perf_counter()
            await stub.ReportRealized(request(i), timeout=10)
            latencies.append(time.perf_counter() - sent)
        queue = list(range(count))

        async def worker() -> None:
            while queue:
                await stub.ReportRealized(request(queue.pop()), timeout=10)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(16)))
        return {"latency_ms_p50": percentile(latencies, 0.5) * 1000, "per_s": count / (time.perf_counter() - start)}
    finally:
        await channel.close()


def _median(values: Sequence[float]) -> float:
    return round(percentile(list(values), 0.5), 3)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="palisade-bench-tls-") as tmp, contextlib.ExitStack() as stack:
        insts = [stack.enter_context(installation(Path(tmp), secure)) for secure in (True, False)]
        for inst in insts:
            for proc in inst.procs:
                await asyncio.to_thread(proc.wait_serving, 60)
        samples: dict[str, dict[str, list[float]]] = {i.name: {} for i in insts}
        for _ in range(args.rounds):
            for inst in insts:  # interleaved: tls, plain, tls, plain, ...
                into = samples[inst.name]
                for size in (1024, 16384):
                    figures = await orders(inst, args.messages, size)
                    for key, value in figures.items():
                        into.setdefault(f"orders_{size // 1024}k_{key}", []).append(value)
                for key, value in (await reports(inst, args.reports)).items():
                    into.setdefault(f"reports_{key}", []).append(value)
    result: dict[str, Any] = {name: {k: _median(v) for k, v in figures.items()} for name, figures in samples.items()}
    ratios = {k: round(result["tls"][k] / result["plain"][k], 3) for k in result["tls"]}
    result["ratios"] = ratios
    result["summary"] = [{"metric": f"tls/plain {k}", "value": v, "unit": "ratio"} for k, v in ratios.items()]
    result["summary"] += [
        {"metric": f"{name} {k}", "value": v, "unit": "ms" if "ms" in k else "/s"}
        for name in ("tls", "plain")
        for k, v in result[name].items()
    ]
    result["plots"] = []
    result["config"] = {"messages": args.messages, "reports": args.reports, "rounds": args.rounds}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--reports", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few messages, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.reports, args.rounds = 20, 20, 1
    json.dump(asyncio.run(run(args)), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
