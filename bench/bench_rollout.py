"""Safe-rollout benchmark: what the flow ring costs on the packet path, and how long a diff takes.

Run as root on a machine with bcc (the first part; ``--no-datapath`` skips it):

    .venv/bin/python -m bench.bench_rollout            # about a minute
    .venv/bin/python -m bench.bench_rollout --quick    # a smoke run

1. **Flow recording.** 64-byte UDP frames go through the compiled program of a pod's veth
   (BPF_PROG_TEST_RUN), each one dropped by the pod's default deny, so each one is a flow event:
   the worst case for the recorder (an allowed flow makes one event per connection, not per
   packet). Meanwhile the datapath's flow hub takes the events as the service runs it: ``skip``
   (``--flow-ring-size 0``, nobody observing: the events are consumed, never decoded), ``ring``
   (the default: each event decoded, turned into its wire form, counted and kept in the bounded
   ring, up to ``--flow-ring-rate`` a second, its default) or ``ring-all`` (no rate: every event
   decoded). The packets come from another process. The packet rate is measured in alternating
   rounds; the output gives the ratios to ``skip`` and the hub's CPU time per event. The program
   does the same work in every variant (it emits every event either way): what differs is the
   hub's CPU, taken from the same cores as the packets.
2. **Diff.** An engine with 1,000 policies and 2,000 pod identities; 100,000 recorded flows
   (random pairs and ports) aggregated as `palisade policy diff` does, then the preview of an
   edited policy exactly as PolicyService computes it (copy of the engine, the edit applied,
   identity pairs and observed flows judged before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import secrets
import socket
import statistics
import sys
import threading
import time
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from bench.bench_engine import load_engine, make_identities, make_policy
from bench.output import logger
from palisade.v1 import common_pb2, datapath_pb2
from services.cli.diff import aggregate
from services.policy import wire
from services.policy.engine.parse import parse_policy
from services.policy.engine.preview import preview

log = logger("rollout")


# --- 1. flow recording ------------------------------------------------------------------------


def bench_ring(rounds: int, packets: int, *, flood: bool) -> dict[str, Any]:
    from services.datapath import netns
    from services.datapath.config import DatapathConfig
    from services.datapath.datapath import Datapath
    from services.datapath.flows import FlowHub
    from services.datapath.maps.bpf import prog_test_run
    from services.datapath.types import Direction, Enforcement, L4Proto, PolicyEntry, PolicyKey, Verdict
    from testkit.traffic import tc_frame

    run = secrets.token_hex(2)
    base = f"/sys/fs/bpf/palisade-bench-ring-{run}"
    netns.enable_forwarding()
    dp = Datapath.open(base)
    pods = []
    try:
        for idx in (1, 2):
            name = f"pr{run}{idx}"
            link = netns.create_pod(name, name, [f"10.251.{int(run[:2], 16)}.{idx}"])
            pods.append(link)
            from services.datapath.types import EndpointSpec

            dp.attach_endpoint(EndpointSpec(100 + idx, link.host_ifindex, link.host_ifname, link.ips, 5000 + idx))
        src_ip, dst_ip = pods[0].ips[0], pods[1].ips[0]
        if flood:  # every packet to pod 2 is dropped: one event each
            dp.sync_policy(102, Enforcement(ingress=True), [])
        else:  # allowed: the first packet opens the flow (one event), the others are established
            key = PolicyKey(Direction.INGRESS, 5001, L4Proto.UDP, 9, 9)
            dp.sync_policy(102, Enforcement(ingress=True), [PolicyEntry(key, Verdict.ALLOW)])
        fd = dp.template.to_container_fd
        frame = tc_frame(src_ip, dst_ip, 40000, 9, socket.IPPROTO_UDP)
        assert len(frame) == 64

        def reader(mode: str, stop: threading.Event, out: dict[str, float]) -> None:
            """The datapath's flow hub as the service runs it: no ring (skip), the ring with its
            default rate, or the ring decoding every event (no rate)."""
            ring, rate = {"skip": (0, 0), "ring": (16384, DatapathConfig.flow_ring_rate), "ring-all": (16384, 0)}[mode]
            hub = FlowHub(dp, node="bench", pod_of=lambda ep: "bench/pod", poll_ms=20, ring=ring, ring_rate=rate)

            async def main() -> None:
                task = asyncio.create_task(hub.run())
                await asyncio.to_thread(stop.wait)
                task.cancel()

            cpu0 = time.process_time()  # the hub reads in worker threads: the process's CPU is the reader's
            asyncio.run(main())
            out["cpu"], out["events"], out["recorded"] = time.process_time() - cpu0, hub.events, len(hub.ring)

        modes = ("skip", "ring", "ring-all")
        samples: dict[str, list[float]] = {m: [] for m in modes}
        cpu_per_event: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
                dp.skip_flows(0)
                stop, out = threading.Event(), dict[str, float]()
                t = threading.Thread(target=reader, args=(mode, stop, out))
                t.start()
                # The packets come from another process, as from the kernel's own paths: the reader's
                # Python never holds them up by the interpreter lock, only by the CPU it takes.
                rfd, wfd = os.pipe()
                child = os.fork()
                if child == 0:  # pragma: no cover - the sender
                    os.close(rfd)
                    started = time.perf_counter()
                    sent = 0
                    while sent < packets:
                        prog_test_run(fd, frame, pods[1].host_ifindex, 1000)
                        sent += 1000
                    os.write(wfd, str(sent / (time.perf_counter() - started)).encode())
                    os._exit(0)
                os.close(wfd)
                with os.fdopen(rfd) as pipe:
                    rate = float(pipe.read())
                os.waitpid(child, 0)
                stop.set()
                t.join()
                samples[mode].append(rate)
                if out["events"]:
                    cpu_per_event[mode].append(out["cpu"] / out["events"] * 1e9)

        def ratio(mode: str) -> float:
            pairs = zip(samples[mode], samples["skip"], strict=True)
            return round(statistics.median(a / b for a, b in pairs), 3)

        return {
            "packets_per_second": {m: round(statistics.median(v)) for m, v in samples.items()},
            "ratio_ring_to_skip": ratio("ring"),
            "ratio_ring_all_to_skip": ratio("ring-all"),
            "reader_cpu_ns_per_event": {m: round(statistics.median(v)) for m, v in cpu_per_event.items() if v},
        }
    finally:
        for link in pods:
            netns.delete_pod(link)
        dp.teardown()


# --- 2. diff ------------------------------------------------------------------------------------


def bench_diff(policies: int, identities: int, flows: int) -> dict[str, Any]:
    rng = random.Random(7)
    namespaces = 50
    idents = make_identities(identities, namespaces, rng)
    docs = [make_policy(i, namespaces, rng) for i in range(policies)]
    engine, _ = load_engine(idents, [parse_policy(doc) for doc in docs], named_ports=False)
    pods = {ident.id: [f"ns{n % namespaces}/pod{n}"] for n, ident in enumerate(idents)}

    ports = [80, 443, 8080, 8050, 53, 5432]
    events = []
    stamp = Timestamp()
    stamp.GetCurrentTime()
    for _ in range(flows):
        src, dst = rng.choice(idents).id, rng.choice(idents).id
        egress = rng.random() < 0.5
        events.append(
            datapath_pb2.FlowEvent(
                time=stamp,
                direction=common_pb2.DIRECTION_EGRESS if egress else common_pb2.DIRECTION_INGRESS,
                verdict=common_pb2.VERDICT_ALLOW,
                reason=datapath_pb2.FLOW_REASON_POLICY_ALLOW,
                source_identity=src,
                destination_identity=dst,
                destination_port=rng.choice(ports),
                protocol=common_pb2.PROTOCOL_TCP,
            )
        )
    started = time.perf_counter()
    observed = [wire.observed_from_proto(f, "flows") for f in aggregate(events)]
    aggregated = time.perf_counter() - started

    edited = parse_policy(make_policy(0, namespaces, rng, variant=1))
    started = time.perf_counter()
    after = copy.deepcopy(engine)
    copied = time.perf_counter() - started
    old = engine.declared_policy(edited.key)
    assert old is not None
    after.upsert_policy(edited)
    result = preview(engine, after, [old, edited], pods=pods, flows=observed)
    total = time.perf_counter() - started
    return {
        "policies": policies,
        "identities": identities,
        "flows": flows,
        "flow_keys": len(observed),
        "aggregate_seconds": round(aggregated, 3),
        "copy_seconds": round(copied, 3),
        "preview_seconds": round(total, 3),
        "pairs_changed": len(result.pairs),
        "flows_changed": len(result.flows),
        "probes": len(result.probes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-datapath", action="store_true", help="skip the flow-recording part (needs root)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    if not args.no_datapath and os.geteuid() == 0:
        rounds, packets = (2, 20_000) if args.quick else (8, 400_000)
        log("flow recording: one allowed 64-byte UDP flow, skip vs ring")
        out["flow_ring"] = bench_ring(rounds, packets, flood=False)
        log("flow recording: a flood of dropped 64-byte UDP packets (an event each), skip vs ring")
        out["flow_ring_drop_flood"] = bench_ring(rounds, packets, flood=True)
    log("diff: 1,000 policies, 100,000 flows")
    out["diff"] = bench_diff(
        100 if args.quick else 1000, 200 if args.quick else 2000, 10_000 if args.quick else 100_000
    )
    summary: list[dict[str, Any]] = []
    for name, what in (("flow_ring", "one UDP flow"), ("flow_ring_drop_flood", "dropped flood")):
        if name in out:
            ring = out[name]
            pps = ring["packets_per_second"]
            summary += [
                {"metric": f"64B {what}: pkt/s through the program, no ring", "value": pps["skip"], "unit": "pkt/s"},
                {"metric": f"64B {what}: pkt/s through the program, ring", "value": pps["ring"], "unit": "pkt/s"},
                {"metric": f"64B {what}: ratio ring / no ring", "value": ring["ratio_ring_to_skip"], "unit": ""},
                {
                    "metric": f"64B {what}: ratio ring without rate limit / no ring",
                    "value": ring["ratio_ring_all_to_skip"],
                    "unit": "",
                },
            ]
    summary += [
        {"metric": "diff: aggregate the recorded flows", "value": out["diff"]["aggregate_seconds"], "unit": "s"},
        {"metric": "diff: preview (copy, edit, pairs and flows)", "value": out["diff"]["preview_seconds"], "unit": "s"},
    ]
    out["summary"] = summary
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
