"""`make run`: NATS, etcd and the four services on the embedded default, plus the dev node.

The watcher reads the manifest folder (``examples/`` by default); the dev node turns the
Pod objects assigned to it into network namespaces running small servers on their
container ports. Editing a policy file changes who can reach whom within a moment.
A part that exits (a crash, a kill -9) is restarted, with a backoff, as a kubelet would.
Ctrl-C stops everything and removes namespaces, links, pinned maps and state, unless
``--keep-state`` is given; the logs of the run stay in the run directory until the next start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from services.common import etcdconfig, natsconfig
from services.common.bus import Bus
from services.common.config import DEFAULT_GRPC_PORTS
from services.common.log import get_logger, setup_logging
from services.common.trust import Credentials, ensure_pki
from services.devstack import hosts, world
from services.devstack.cniexec import CniRuntime
from services.devstack.hosts import HostsError
from services.devstack.node import DevNode
from services.devstack.processes import Child, StackError, binary, port_free

ROOT = Path(__file__).resolve().parents[2]
log = get_logger("devstack")
#: The run directory's folder of logs, one file per child: kept after a stop, removed at the next start.
LOGS = "logs"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="make run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--manifests", default=str(ROOT / "examples"), help="manifest folder the watcher reads")
    p.add_argument("--node", default="dev-node", help="name of the dev node")
    p.add_argument("--run-dir", default=str(ROOT / ".run"), help="logs and data of this run")
    p.add_argument("--bpffs", default="/sys/fs/bpf/palisade", help="where the datapath pins its maps")
    p.add_argument("--nats-port", type=int, default=4222, help="NATS client port (with --ha, the first of 3)")
    p.add_argument("--nats-route-port", type=int, default=6222, help="with --ha: the first of 3 NATS route ports")
    p.add_argument(
        "--etcd-port", type=int, default=2379, help="etcd client port; its peer port is the next (--ha: 3 such pairs)"
    )
    p.add_argument(
        "--ha",
        action="store_true",
        help="a control plane that survives losing any one member: 3 NATS servers (R3 JetStream), "
        "3 etcd members, 2 policy replicas (one leader) and 2 ipam replicas",
    )
    p.add_argument(
        "--grpc-port-base",
        type=int,
        default=DEFAULT_GRPC_PORTS["watcher"],
        help="gRPC ports: watcher at this port, then policy, ipam, datapath (the CLI's defaults are 9401-9404)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="dev nodes: with more than one, each (dev-node-1..N) is a network namespace standing for a host, "
        "with its own datapath and pod CIDR, which routes to the others' pods itself (--routing); pods go to "
        "the node their spec.nodeName names, the others are spread",
    )
    p.add_argument(
        "--routing",
        choices=("direct", "tunnel"),
        default="direct",
        help="with --nodes: direct puts the hosts on one bridge and the datapaths route each pod CIDR via its "
        "node's address; tunnel puts each host on a bridge of its own behind a router, and the datapaths "
        "tunnel (VXLAN) between the nodes' addresses",
    )
    p.add_argument(
        "--node-subnet",
        default="172.31.255.0/24",
        help="with --nodes: the hosts' network (direct: the bridge takes its first address, where the control "
        "plane listens, node i the 10+i-th; tunnel: a /28 of it per node)",
    )
    p.add_argument(
        "--service-cidr",
        default="10.96.0.0/16",
        help="the dev cluster's Service range: Services written without a clusterIP get one from it",
    )
    p.add_argument(
        "--dns-min-ttl",
        type=float,
        default=None,
        help="the nodes' DNS proxies keep learned addresses at least this many seconds (default: the proxy's)",
    )
    p.add_argument(
        "--dns-refuse",
        choices=("refused", "nxdomain"),
        default=None,
        help="the nodes' DNS proxies' answer to a name no DNS rule allows (default: the proxy's, refused)",
    )
    p.add_argument("--keep-state", action="store_true", help="keep pinned maps, namespaces and data on exit")
    p.add_argument("--no-pods", action="store_true", help="do not create the dev node's pods")
    p.add_argument(
        "--no-datapath",
        action="store_true",
        help="start no datapath: each node's is run by something else (the datapath DaemonSet's container "
        "under a container runtime, as tests/deploy/test_pod_specs.py does). Every node, even a single one, "
        "is then a network namespace of its own (the datapath's host network), the control plane listens "
        "on the bridge's address, and no pods are made (needs --no-pods)",
    )
    p.add_argument(
        "--cni",
        action="store_true",
        help="create the dev node's pods as a container runtime does: sandbox namespaces joined by palisade-cni",
    )
    args = p.parse_args(argv)
    if args.nodes < 1:
        p.error(f"--nodes {args.nodes} must be 1 or more")
    if args.nodes > 1 and args.cni:
        p.error("--cni runs one node; drop --cni or --nodes")
    if args.no_datapath and not args.no_pods:
        p.error("--no-datapath: the dev node makes its pods through its datapath; add --no-pods")
    args.network = None
    args.world = None
    args.host = "127.0.0.1"
    if args.nodes > 1 or args.no_datapath:
        tag = hosts.tag_of(args.run_dir)
        try:
            names = [f"dev-node-{i + 1}" for i in range(args.nodes)] if args.nodes > 1 else [args.node]
            args.network = hosts.plan(names, args.node_subnet, tag, args.routing)
        except (HostsError, ValueError) as exc:
            p.error(str(exc))
        args.host = args.network.gateway  # reachable from the root namespace and from every node
        # The outside world and its DNS, which the pods resolve through (see services/devstack/world.py).
        args.world = world.plan(args.network, tag)
    return args


def grpc_address(args: argparse.Namespace, name: str) -> str:
    offset = DEFAULT_GRPC_PORTS[name] - DEFAULT_GRPC_PORTS["watcher"]
    return f"{args.host}:{args.grpc_port_base + offset}"


def nats_urls(args: argparse.Namespace) -> list[str]:
    return [f"nats://{args.host}:{args.nats_port + i}" for i in range(3 if args.ha else 1)]


def watcher_nodes(args: argparse.Namespace) -> list[str]:
    """In a dev cluster the watcher plays the scheduler and lists the nodes' Node objects.

    With one node too: a Pod written without ``spec.nodeName`` is bound to the dev node (whose
    address is the host's, where the single node's datapath runs), as kube-scheduler would;
    unbound, ipam would never give it an identity and it would never be created.
    """
    if args.network is None:
        return ["--dev-nodes", f"{args.node}={args.host}"]
    return ["--dev-nodes", ",".join(f"{n.name}={n.address}" for n in args.network.nodes)]


def node_names(args: argparse.Namespace) -> list[str]:
    return [n.name for n in args.network.nodes] if args.network else [args.node]


def clear_run_dir(run_dir: Path) -> None:
    """Remove a stopped run's data, certificates and sockets, but not its logs: a crash can be read
    after Ctrl-C. The next start removes them (it starts from an empty run directory)."""
    if not run_dir.is_dir():
        return
    for path in run_dir.iterdir():
        if path.name == LOGS and path.is_dir():
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def build(args: argparse.Namespace, run_dir: Path) -> list[Child]:
    logs = run_dir / LOGS
    logs.mkdir(parents=True, exist_ok=True)
    # One CA per installation, made on first start; every part proves its name with it.
    # The address the control plane listens on is in every certificate: NATS routes and etcd peers
    # check it (with --nodes, the bridge's address; with --ha, NATS refused its own routes without it).
    tls_dir = ensure_pki(run_dir / "tls", extra_hosts=[args.host] if args.host != "127.0.0.1" else [])
    members = 3 if args.ha else 1
    # etcd member i listens for clients on etcd_port + 2i and for peers on the port after it.
    etcd = [f"{args.host}:{args.etcd_port + 2 * i}" for i in range(members)]
    common = ["--nats-url", ",".join(nats_urls(args)), "--etcd-endpoints", ",".join(etcd),
              "--node-name", args.node, "--log-format", "json"]  # fmt: skip
    env = {"PALISADE_TLS_DIR": str(tls_dir)}
    probe = Credentials.load(tls_dir, "devnode")

    def svc(name: str, *extra: str, address: str = "", replica: str = "") -> Child:
        address = address or grpc_address(args, name)
        cmd = [sys.executable, "-m", f"services.{name}", "--grpc-listen", address, *common, *extra]
        child = name + replica
        return Child(child, cmd, logs / f"{child}.log", grpc_address=address, env=env, credentials=probe,
                     component=name)  # fmt: skip

    def suffix(i: int) -> str:
        return f"-{i + 1}" if args.ha else ""

    nats_tls = Credentials.load(tls_dir, "nats")
    routes = tuple(f"{args.host}:{args.nats_route_port + i}" for i in range(members))
    children = []
    for i in range(members):
        name = "nats" + suffix(i)
        cluster = natsconfig.Cluster(name, routes[i], routes) if args.ha else None
        conf = natsconfig.write(
            run_dir / f"{name}.conf",
            listen=f"{args.host}:{args.nats_port + i}",
            store_dir=str(run_dir / name),
            tls=nats_tls,
            cluster=cluster,
        )
        children.append(Child(name, [binary("nats-server"), "-c", str(conf)], logs / f"{name}.log",
                              tcp_port=args.nats_port + i, tcp_host=args.host, group="nats"))  # fmt: skip
    etcd_tls = Credentials.load(tls_dir, "etcd")
    peers = {f"dev{suffix(i)}": f"{args.host}:{args.etcd_port + 2 * i + 1}" for i in range(members)}
    for i, (member, peer) in enumerate(peers.items()):
        name = "etcd" + suffix(i)
        children.append(Child(
            name,
            [binary("etcd"), "--name", member, "--data-dir", str(run_dir / name), "--log-level", "warn",
             *etcdconfig.flags(etcd_tls, member, etcd[i], peer, peers)],
            logs / f"{name}.log",
            tcp_port=args.etcd_port + 2 * i,
            tcp_host=args.host,
            group="etcd",
        ))  # fmt: skip
    ipams = [svc("ipam", replica=suffix(0))]
    if args.ha:
        # A second ipam on the port after the datapath's: replicas serve the same etcd state.
        second = f"{args.host}:{args.grpc_port_base + 4}"
        ipams.append(svc("ipam", address=second, replica=suffix(1)))
    ipam_addresses = ",".join(c.grpc_address for c in ipams)
    # The policy leader holds the CIDR identities of the prefixes policies name in ipam.
    policies = [svc("policy", "--member", "policy" + suffix(0), "--ipam-address", ipam_addresses, replica=suffix(0))]
    if args.ha:
        # The second policy replica after the second ipam; the replicas elect one leader.
        second = f"{args.host}:{args.grpc_port_base + 5}"
        policies.append(
            svc("policy", "--member", "policy-2", "--ipam-address", ipam_addresses, address=second, replica=suffix(1))
        )
    policy_addresses = ",".join(c.grpc_address for c in policies)
    datapaths = [
        Child(
            node.child,
            [sys.executable, "-m", *node.launcher, "services.datapath", "--grpc-listen", node.address, *common,
             "--node-name", node.name, "--policy-address", policy_addresses, "--ipam-address", ipam_addresses,
             "--state-dir", str(node.state_dir), "--bpffs", node.bpffs, "--routing", node.routing,
             "--masquerade", str(node.masquerade).lower()],
            logs / f"{node.child}.log",
            grpc_address=node.address,
            env=env,
            credentials=probe,
            component="datapath",
        )
        for node in dev_nodes(args, run_dir)
        if not args.no_datapath
    ]  # fmt: skip
    # Each node's DNS proxy, a process of its own beside the datapath (as a second container of the
    # DaemonSet): it outlives a datapath restart, and waits for the datapath's maps when it starts first.
    dnsproxies = [
        Child(
            f"{node.child}-dnsproxy",
            [sys.executable, "-m", *node.launcher, "services.datapath.dnsproxyd", "--state-dir", str(node.state_dir),
             "--bpffs", node.bpffs, "--log-format", "json", *dns_flags(args)],
            logs / f"{node.child}-dnsproxy.log",
            env=env,
        )
        for node in dev_nodes(args, run_dir)
        if not args.no_datapath
    ]  # fmt: skip
    addresses = {
        "watcher": grpc_address(args, "watcher"),
        "policy": policy_addresses,
        "ipam": ipam_addresses,
        # With --no-datapath, where each node's datapath is to listen (the DaemonSet's port).
        "datapath": ",".join(c.grpc_address for c in datapaths)
        or ",".join(spec.address for spec in dev_nodes(args, run_dir)),
        # The dev cluster's API server is this folder: `connectivity probe --via-services` applies Services to it.
        "manifests": str(Path(args.manifests).resolve()),
    }
    outside = world_children(args, run_dir, logs)
    if args.world is not None:
        # The pods' resolver and the file of names it answers (edited while the cluster runs).
        addresses["dns"] = args.world.dns
        addresses["dns_zone"] = str(zone_path(run_dir))
    # The CLI reads them from here (every replica, so it reaches the survivors of a failover;
    # every node's datapath, so `palisade endpoint list` shows the whole cluster).
    (run_dir / "addresses.json").write_text(json.dumps(addresses, indent=2) + "\n")
    return [
        # The world is there before the cluster, as the internet is.
        *outside,
        *children,
        # Upstreams first: each service reports SERVING only once what it consumes is synced.
        svc(
            "watcher",
            "--source",
            "manifests",
            "--manifests",
            args.manifests,
            "--service-cidr",
            args.service_cidr,
            *watcher_nodes(args),
        ),
        *ipams,
        *policies,
        *datapaths,
        *dnsproxies,
    ]


def dns_flags(args: argparse.Namespace) -> list[str]:
    """The DNS proxies' settings given to the stack."""
    flags = []
    if args.dns_min_ttl is not None:
        flags += ["--dns-min-ttl", str(args.dns_min_ttl)]
    if args.dns_refuse is not None:
        flags += ["--dns-refuse", args.dns_refuse]
    return flags


def zone_path(run_dir: Path) -> Path:
    """The outside world's zone file: the names its DNS server answers."""
    return run_dir / "dns" / "zone.yaml"


def world_children(args: argparse.Namespace, run_dir: Path, logs: Path) -> list[Child]:
    """The outside world's DNS server and its servers, in the world's namespace (none without --nodes)."""
    if args.world is None:
        return []
    zone = zone_path(run_dir)
    world.write_zone(zone)
    ports = [a for port in world.PORTS for a in ("--tcp", str(port))]
    return [
        Child("world-dns", [sys.executable, "-m", "services.devstack.innetns", args.world.netns,
                            "services.devstack.dnsserver", "--zone", str(zone), "--listen", args.world.dns],
              logs / "world-dns.log", shows=f"{args.world.dns}:53"),
        Child("world", [sys.executable, "-m", "services.devstack.podserver", "--netns", args.world.netns,
                        "--name", "world", *ports],
              logs / "world.log", shows="documentation ranges"),
    ]  # fmt: skip


@dataclass(frozen=True)
class DevNodeSpec:
    """Where one dev node's datapath runs, listens and keeps its state."""

    name: str
    child: str
    address: str
    state_dir: Path
    bpffs: str
    #: What runs the datapath's module (``-m`` this, then the module): it enters the node's namespace.
    launcher: tuple[str, ...]
    #: The datapath's --routing: none for the single dev node (the machine itself, no other node).
    routing: str = "none"
    #: The datapath's --masquerade: off for the single dev node (the machine's own netfilter is left alone).
    masquerade: bool = False


def dev_nodes(args: argparse.Namespace, run_dir: Path) -> list[DevNodeSpec]:
    """The single dev node (the root namespace), or each node host of a dev cluster."""
    if args.network is None:
        return [DevNodeSpec(args.node, "datapath", grpc_address(args, "datapath"), run_dir / "datapath",
                            args.bpffs, ())]  # fmt: skip
    port = args.grpc_port_base + DEFAULT_GRPC_PORTS["datapath"] - DEFAULT_GRPC_PORTS["watcher"]
    return [
        DevNodeSpec(host.name, f"datapath-{i + 1}", f"{host.address}:{port}", run_dir / f"datapath-{host.name}",
                    f"{args.bpffs}-{host.name}", ("services.devstack.innetns", host.netns), args.routing, True)
        for i, host in enumerate(args.network.nodes)
    ]  # fmt: skip


def banner(args: argparse.Namespace, children: list[Child], nodes: list[DevNode], started: float) -> str:
    lines = [f"Palisade is running ({time.monotonic() - started:.1f}s to start). Logs: {args.run_dir}/{LOGS}", ""]
    for c in children:
        where = c.grpc_address or (f"{c.tcp_host}:{c.tcp_port}" if c.tcp_port else c.shows or "(pod DNS)")
        lines.append(f"  {c.name:9} {where:18} pid {c.proc.pid if c.proc else '-'}")
    for node in nodes:
        lines += ["", f"Pods on {node.name}:"]
        for key, ep in sorted(node.endpoints.items()):
            lines.append(f"  {key:24} {','.join(ep.ips):16} identity {ep.identity}  endpoint {ep.id}")
    if args.world is not None:
        lines += ["", f"The outside world: pods resolve through {args.world.dns}, which answers the names of "
                      f"{zone_path(Path(args.run_dir))} (edit it while the cluster runs)."]  # fmt: skip
    lines += [
        "",
        "Try:",
        "  .venv/bin/palisade status",
        "  .venv/bin/palisade endpoint list",
        f"  .venv/bin/palisade analyze -f {args.manifests} --probe 8080/TCP",
        "  .venv/bin/palisade policy trace --src shop/frontend --dst shop/backend --port 8080",
        "  .venv/bin/palisade observe --verdict dropped",
        f"  edit a policy in {args.manifests}/ and watch the verdicts change",
        "",
        f"Ctrl-C stops everything and cleans up (the logs stay in {args.run_dir}/{LOGS} until the next start).",
    ]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    started = time.monotonic()
    run_dir = Path(args.run_dir)
    if not args.keep_state:
        shutil.rmtree(run_dir, ignore_errors=True)
    children = build(args, run_dir)
    for c in children:
        if not c.tcp_port and not c.grpc_address:
            continue  # listens on no port of the host (the DNS proxy: steered pod traffic only)
        port = c.tcp_port or int(c.grpc_address.rpartition(":")[2])
        if not port_free(port):
            raise StackError(
                f"port {port} for {c.name} is in use: is another Palisade (or {c.name}) running? stop it first"
            )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    nodes: list[DevNode] = []
    node_tasks: list[asyncio.Task[None]] = []
    bus: Bus | None = None
    pod_netns: dict[str, list[str]] = {}
    code = 0
    try:
        if args.network is not None:
            await asyncio.to_thread(hosts.create, args.network)
        if args.world is not None:
            await asyncio.to_thread(world.create, args.world)
        # In order; the members of a cluster start together, then each is waited for.
        for i, c in enumerate(children):
            print(f"starting {c.name}...", flush=True)
            c.start(ROOT)
            if c.group and i + 1 < len(children) and children[i + 1].group == c.group:
                continue
            for member in [m for m in children[: i + 1] if m.group and m.group == c.group] or [c]:
                await asyncio.to_thread(member.wait_ready, 60.0)
        if not args.no_pods:
            devnode = Credentials.load(run_dir / "tls", "devnode")
            bus = await Bus.connect(nats_urls(args), name="palisade-devnode", tls=devnode)
            names = node_names(args)
            for spec in dev_nodes(args, run_dir):
                cni = CniRuntime(str(spec.state_dir / "cni.sock")) if args.cni else None
                node = DevNode(bus, spec.address, spec.name, cni, devnode, names)
                nodes.append(node)
                node_tasks.append(asyncio.create_task(node.run(), name=f"devnode-{spec.name}"))
            # The banner lists the pods, so let the initial ones come up first.
            await asyncio.wait_for(asyncio.gather(*(n.settled.wait() for n in nodes)), 120)
        print(banner(args, children, nodes, started), flush=True)
        # Like a kubelet with restartPolicy Always: a part that dies (crash, kill -9) comes back.
        while not stop.is_set():
            for c in children:
                line = c.supervise(ROOT, time.monotonic())
                if line:
                    log.warning("child restarted", child=c.name, restarts=c.restarts)
                    print(line, flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
        print("\nstopping...", flush=True)
    finally:
        for node in nodes:
            pod_netns[node.name] = [ep.netns for ep in node.endpoints.values()]
            await node.shutdown()
        for task in node_tasks:
            task.cancel()
        if bus is not None:
            await bus.close()
        for c in reversed(children):
            c.stop()
        if args.keep_state:
            print(f"stopped; state kept in {run_dir}", flush=True)
        else:
            from services.devstack.cleanup import clean  # the datapath's modules, only at the end

            left: list[str] = []
            if args.world is not None:
                left += await asyncio.to_thread(world.remove, args.world)
            if args.network is not None:
                # A node's namespace takes its pods' veths and routes with it.
                left += await asyncio.to_thread(hosts.remove, args.network)
            for spec in [] if args.no_datapath else dev_nodes(args, run_dir):
                left += await asyncio.to_thread(
                    functools.partial(
                        clean,
                        spec.bpffs,
                        spec.state_dir,
                        pod_netns.get(spec.name, []),
                        dns_routing=args.network is None,
                    )
                )
            clear_run_dir(run_dir)
            kept = f"the logs of this run are kept in {run_dir / LOGS} until the next start"
            if left:
                print("stopped; could not remove, do it by hand:\n  " + "\n  ".join(left) + f"\n{kept}", flush=True)
                code = 1
            else:
                print(f"stopped; nothing left behind ({kept})", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0:
        print("make run: needs root: it creates network namespaces and loads BPF programs (try `sudo make run`)",
              file=sys.stderr)  # fmt: skip
        return 2
    setup_logging("warning", "text")
    try:
        return asyncio.run(main_async(args))
    except StackError as exc:
        print(f"make run: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
