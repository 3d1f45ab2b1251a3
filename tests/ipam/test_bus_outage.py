"""NATS goes away: ipam keeps answering (SERVING) but its status, and `palisade status`, say the bus is down."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

from grpc_health.v1 import health_pb2

from palisade.v1 import common_pb2
from services.common.bus import Bus
from testkit.harness import ROOT, EtcdServer, NatsServer, ServiceProcess, creds, health_status
from testkit.ipam import Api, K8s, eventually, ipam_args


async def _status(api: Api) -> common_pb2.ServiceStatus:
    answer: common_pb2.ServiceStatus = await api.status.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    return answer


def _palisade_status(address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "status", f"--ipam-address={address}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_bus_outage_shows_in_status(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess]
) -> None:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as bus:
        await bus.ensure_streams()
        await K8s(bus).synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    api = Api(proc.address)
    up = await _status(api)
    assert up.synced and up.details["bus"] == "ok"

    await asyncio.to_thread(nats_server.stop)
    down = await eventually(lambda: _when(_status(api), lambda s: s.details["bus"].startswith("down")))
    assert not down.synced
    assert health_status(proc.address, proc.name) == health_pb2.HealthCheckResponse.SERVING
    shown = await asyncio.to_thread(_palisade_status, proc.address)
    assert shown.returncode == 1
    assert "bus=down" in shown.stdout and "ipam: bus down" in shown.stdout, shown.stdout

    await asyncio.to_thread(nats_server.start)
    back = await eventually(lambda: _when(_status(api), lambda s: s.details["bus"] == "ok"))
    assert back.synced


async def _when(pending: object, test: Callable[[common_pb2.ServiceStatus], bool]) -> common_pb2.ServiceStatus | None:
    status: common_pb2.ServiceStatus = await pending  # type: ignore[misc]
    return status if test(status) else None
