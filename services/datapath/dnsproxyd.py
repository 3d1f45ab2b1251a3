"""The node's DNS proxy as a process of its own beside the datapath: ``python -m services.datapath.dnsproxyd``.

Why its own process: a pod's DNS must not depend on the datapath's life (Cilium's in-agent
proxy made every agent restart a DNS outage, cilium/cilium#16364). The steering lives in BPF and
the learned entries in pinned maps; this process only needs the pins and the datapath's state
dir. A kill -9 of the datapath leaves it serving; a restart of this process leaves the steering
in place, so queries in the gap are dropped and retried by the client (never sent past the proxy),
and the learned names are restored from disk before its sockets open.

It waits for the datapath to create the maps, installs the node's policy routing for steered
packets (``dnsrouting``), and follows the endpoints the datapath publishes (``dnsnames``). What
it learned, the datapath reads from it through a root-only socket in the state dir (``namesapi``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys

from services.common.config import CommonConfig, ConfigError, load_config, setting
from services.common.log import get_logger, setup_logging
from services.datapath import dnsrouting
from services.datapath.dnsnames import NameSource
from services.datapath.dnsproxy import DnsProxy, ProxyConfig, RefuseCode
from services.datapath.fqdncache import CacheLimits
from services.datapath.learnedmaps import LearnedMaps, MapsMissing
from services.datapath.namesapi import NamesApi, socket_path

log = get_logger("dnsproxy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DnsProxyDaemonConfig(CommonConfig):
    """The node's DNS proxy (runs beside the datapath, in its network namespace)."""

    state_dir: str = setting(
        "The datapath's state directory (learned names, published endpoints).", default="/var/run/palisade/datapath"
    )
    bpffs: str = setting("Where the datapath pins its maps.", default="/sys/fs/bpf/palisade")
    dns_proxy_port: int = setting(
        "Port of the proxy's transparent sockets (the datapath's setting too).", default=10053
    )
    dns_refuse: str = setting("Answer to a name no DNS rule allows: refused or nxdomain.", default="refused")
    dns_min_ttl: float = setting("Learned addresses are kept at least this many seconds.", default=5.0)
    dns_max_per_name: int = setting("Addresses kept per name; the oldest are evicted first.", default=50)
    dns_max_per_endpoint: int = setting("Addresses kept per endpoint; the oldest are evicted first.", default=1000)

    def validate(self) -> None:
        if self.dns_refuse not in {r.value for r in RefuseCode}:
            raise ConfigError(f"--dns-refuse {self.dns_refuse!r}: use refused or nxdomain")
        try:
            self.proxy()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def proxy(self) -> ProxyConfig:
        limits = CacheLimits(
            min_ttl=self.dns_min_ttl, max_per_name=self.dns_max_per_name, max_per_endpoint=self.dns_max_per_endpoint
        )
        return ProxyConfig(
            state_dir=self.state_dir, port=self.dns_proxy_port, refuse=RefuseCode(self.dns_refuse), limits=limits
        )


async def _open_maps(bpffs: str) -> LearnedMaps:
    """The pins, once the datapath has made them."""
    waiting = False
    while True:
        try:
            return LearnedMaps.open(bpffs)
        except MapsMissing as exc:
            if not waiting:
                log.info("waiting for the datapath's maps", reason=str(exc))
                waiting = True
            await asyncio.sleep(0.2)


async def serve(cfg: DnsProxyDaemonConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    maps = await _open_maps(cfg.bpffs)
    try:
        await asyncio.to_thread(dnsrouting.install)
        proxy = DnsProxy(cfg.proxy(), maps, source=NameSource(cfg.state_dir))
        async with proxy, NamesApi(socket_path(cfg.state_dir), proxy.view):
            await stop.wait()
            log.info("DNS proxy stopping", stats=str(proxy.stats))
    finally:
        maps.close()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(DnsProxyDaemonConfig, argv, prog="palisade-dnsproxy")
    except ConfigError as exc:
        print(f"palisade-dnsproxy: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
