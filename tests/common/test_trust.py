"""Every refusal of the trust model, against real servers.

A gRPC client without a certificate, with one from another CA, or with the wrong
component's certificate is refused on every API; a NATS client cannot publish what its
user does not own; etcd accepts only ipam's certificate; the datapath's node socket is
root-only.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import nats
import pytest
from nats.aio.client import Client as NATSClient
from nats.errors import Error as NatsError

from palisade.v1 import datapath_pb2, identity_pb2, ipam_pb2, policy_pb2
from services.common.access import INBOX_PREFIX, RULES, allowed
from services.common.grpcserver import open_sync_channel
from services.common.store import connect_etcd
from services.common.trust import COMPONENTS, Credentials, ensure_pki
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, bcc_problem, creds, is_root, pki

# With root, a datapath serves on the host beside the others: in turn with the kernel's tests.
pytestmark = pytest.mark.kernel

#: Which server serves which API (its certificate's name).
SERVERS = {
    "palisade.v1.PolicyService": "policy",
    "palisade.v1.IdentityService": "ipam",
    "palisade.v1.IPAMService": "ipam",
    "palisade.v1.DatapathService": "datapath",
}
STREAMING = {"palisade.v1.DatapathService/Observe"}
PEOPLE = tuple(c for c in COMPONENTS if c not in ("nats", "etcd"))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another installation: its certificates carry the same names, signed by another CA."""
    return ensure_pki(tmp_path_factory.mktemp("foreign"))


def _methods(service: str) -> list[str]:
    return sorted(m for m in RULES if m.startswith(service + "/"))


def _method_names(full_service: str) -> list[str]:
    """Every method of a generated service, from its descriptor."""
    name = full_service.rpartition(".")[2]
    for module in (policy_pb2, identity_pb2, ipam_pb2, datapath_pb2):
        found = module.DESCRIPTOR.services_by_name.get(name)
        if found is not None:
            return [f"{full_service}/{m.name}" for m in found.methods]
    raise AssertionError(f"no service {full_service}")


def _call(ch: grpc.Channel, method: str) -> grpc.StatusCode:
    """Call ``method`` with an empty request; the status it ends with (OK when it answers)."""
    ident: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    try:
        if method in STREAMING:
            stream = ch.unary_stream("/" + method, request_serializer=ident, response_deserializer=ident)
            next(iter(stream(b"", timeout=3)), None)
        else:
            ch.unary_unary("/" + method, request_serializer=ident, response_deserializer=ident)(b"", timeout=3)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """policy, ipam (and the datapath, where BPF can load) on real NATS and etcd; name -> address.

    The datapath's node socket is under "socket".
    """
    tmp = tmp_path_factory.mktemp("trust")
    nats_server, etcd_server = NatsServer(tmp / "nats"), EtcdServer(tmp / "etcd")
    nats_server.start()
    etcd_server.start()
    procs: list[ServiceProcess] = []
    bpffs = f"/sys/fs/bpf/palisade-trust-{os.getpid()}"

    def start(name: str, *args: str) -> ServiceProcess:
        proc = ServiceProcess(name, tmp, ["--nats-url", nats_server.url, "--node-name", "n1", *args])
        procs.append(proc)
        proc.start()
        return proc

    try:
        (tmp / "manifests").mkdir()
        start("watcher", "--manifests", str(tmp / "manifests"))  # ipam and policy serve once it has synced
        ipam = start("ipam", "--etcd-endpoints", etcd_server.endpoint)
        policy = start("policy")
        out = {"ipam": ipam.address, "policy": policy.address}
        if is_root() and bcc_problem() is None:
            state = tmp / "state"
            routes = ("--policy-address", policy.address, "--ipam-address", ipam.address)
            out["datapath"] = start("datapath", *routes, "--state-dir", str(state), "--bpffs", bpffs).address
            out["socket"] = str(state / "cni.sock")
        yield out
    finally:
        for proc in procs:
            proc.kill()
        nats_server.stop()
        etcd_server.stop()
        if os.path.exists(bpffs):
            from services.datapath.datapath import teardown_all

            teardown_all(bpffs)


def test_every_method_has_a_rule_and_no_rule_names_a_missing_method() -> None:
    for service in SERVERS:
        methods = _method_names(service)
        for method in methods:
            assert allowed(method), f"{method} has no access rule: nobody could call it"
        for method in _methods(service):
            assert method in methods, f"the access table names {method}, which does not exist"


def test_a_client_without_a_certificate_is_refused_on_every_api(servers: dict[str, str]) -> None:
    for service, server in SERVERS.items():
        if server not in servers:
            continue
        with grpc.insecure_channel(servers[server]) as ch:  # plaintext: no TLS at all
            for method in _method_names(service):
                assert _call(ch, method) == grpc.StatusCode.UNAVAILABLE, method
        # TLS that trusts the server but presents no certificate of its own.
        anonymous = grpc.ssl_channel_credentials(root_certificates=creds("cli").ca_file.read_bytes())
        options = [("grpc.ssl_target_name_override", server)]
        with grpc.secure_channel(servers[server], anonymous, options=options) as ch:
            for method in _method_names(service):
                assert _call(ch, method) == grpc.StatusCode.UNAVAILABLE, method


def test_a_certificate_from_another_ca_is_refused_on_every_api(servers: dict[str, str], foreign: Path) -> None:
    for service, server in SERVERS.items():
        if server not in servers:
            continue
        # The foreign client trusts our CA (so only its own certificate can be the problem).
        mixed = foreign / "mixed"
        mixed.mkdir(exist_ok=True, mode=0o700)
        for f in ("cli.crt", "cli.key"):
            (mixed / f).write_bytes((foreign / f).read_bytes())
        (mixed / "ca.crt").write_bytes(creds("cli").ca_file.read_bytes())
        with open_sync_channel(servers[server], server, Credentials.load(mixed, "cli")) as ch:
            for method in _method_names(service):
                assert _call(ch, method) == grpc.StatusCode.UNAVAILABLE, method


def test_the_wrong_components_certificate_is_permission_denied_on_every_method(servers: dict[str, str]) -> None:
    checked = 0
    for service, server in SERVERS.items():
        if server not in servers:
            continue
        for method in _method_names(service):
            for person in PEOPLE:
                if person in allowed(method) or "*" in allowed(method):
                    continue
                with open_sync_channel(servers[server], server, creds(person)) as ch:
                    code = _call(ch, method)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (method, person, code)
                checked += 1
    assert checked > 20


def test_an_allowed_caller_gets_past_the_check(servers: dict[str, str]) -> None:
    # The method answers on its merits (an empty request is invalid or not found), never PERMISSION_DENIED.
    with open_sync_channel(servers["policy"], "policy", creds("cli")) as ch:
        assert _call(ch, "palisade.v1.PolicyService/ListPolicies") == grpc.StatusCode.OK
        assert _call(ch, "palisade.v1.PolicyService/GetPolicy") == grpc.StatusCode.INVALID_ARGUMENT
    with open_sync_channel(servers["ipam"], "ipam", creds("datapath")) as ch:
        assert _call(ch, "palisade.v1.IPAMService/AllocateIP") == grpc.StatusCode.INVALID_ARGUMENT


def test_a_client_checks_it_reached_the_service_it_meant(servers: dict[str, str]) -> None:
    # ipam's port answers with ipam's certificate: a client that means the policy service refuses it.
    with open_sync_channel(servers["ipam"], "policy", creds("cli")) as ch:
        assert _call(ch, "palisade.v1.PolicyService/ListPolicies") == grpc.StatusCode.UNAVAILABLE


# --- the bus -------------------------------------------------------------------------------------


async def _connect(server: NatsServer, who: Credentials) -> tuple[NATSClient, list[Exception]]:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(
        server.url,
        tls=who.client_ssl_context(),
        tls_hostname="nats",
        inbox_prefix=INBOX_PREFIX + who.name,
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=3,
    )
    return nc, errors


async def _forged(server: NatsServer, who: str, subject: str) -> str:
    """Publish ``subject`` as ``who`` through JetStream; the server's refusal, or "" if it took it."""
    nc, errors = await _connect(server, creds(who))
    try:
        try:
            await nc.jetstream().publish(subject, b"forged", timeout=3)
            return ""
        except NatsError:
            await nc.flush(timeout=2)
            return " ".join(str(e) for e in errors)
    finally:
        await nc.close()


async def test_only_the_owner_publishes_each_subject(nats_server: NatsServer) -> None:
    # The streams exist (as the services provision them).
    nc, _ = await _connect(nats_server, creds())
    from services.common.bus import ALL_STREAMS, Bus

    await nc.close()
    async with await Bus.connect([nats_server.url], name="setup", tls=creds()) as bus:
        await bus.ensure_streams(*ALL_STREAMS)
    owners = {
        "palisade.k8s.pod.default.web": "watcher",
        "palisade.identity.300": "ipam",
        "palisade.ipcache.10_0_0_1_32": "ipam",
        "palisade.regen.n1": "policy",
    }
    with pytest.raises((NatsError, OSError)):  # the CLI has no bus user at all
        await _connect(nats_server, creds("cli"))
    # All at once: a refused publish is only known when its acknowledgement times out.
    cases = [
        (subject, owner, who)
        for subject, owner in owners.items()
        for who in ("watcher", "ipam", "policy", "datapath", "devnode")
    ]
    answers = await asyncio.gather(*(_forged(nats_server, who, subject) for subject, _, who in cases))
    for (subject, owner, who), answer in zip(cases, answers, strict=True):
        if who == owner:
            assert answer == "", (owner, subject)
        else:
            assert "permissions violation" in answer.lower(), (who, subject, answer)
    # The policy service's revision bucket is its own.
    refusal = await _forged(nats_server, "ipam", "$KV.PALISADE_POLICY.state")
    assert "permissions violation" in refusal.lower()


async def test_a_component_cannot_listen_on_anothers_inbox_or_the_raw_subjects(nats_server: NatsServer) -> None:
    nc, errors = await _connect(nats_server, creds("datapath"))
    try:
        await nc.subscribe("palisade.regen.>")
        await nc.subscribe(INBOX_PREFIX + "policy.>")
        await nc.flush(timeout=2)
        await asyncio.sleep(0.2)
        text = " ".join(str(e) for e in errors).lower()
        assert text.count("permissions violation for subscription") == 2, errors
    finally:
        await nc.close()


async def test_a_bus_client_without_a_certificate_or_from_another_ca_is_refused(
    nats_server: NatsServer, foreign: Path
) -> None:
    with pytest.raises((NatsError, OSError)):
        await nats.connect(nats_server.url, allow_reconnect=False, connect_timeout=3)
    mixed = foreign / "nats-mixed"
    mixed.mkdir(exist_ok=True, mode=0o700)
    for f in ("watcher.crt", "watcher.key"):
        (mixed / f).write_bytes((foreign / f).read_bytes())
    (mixed / "ca.crt").write_bytes(creds().ca_file.read_bytes())
    with pytest.raises((NatsError, OSError)):
        await _connect(nats_server, Credentials.load(mixed, "watcher"))


# --- etcd ----------------------------------------------------------------------------------------


async def test_etcd_accepts_only_ipams_certificate(etcd_server: EtcdServer, foreign: Path) -> None:
    host, _, port = etcd_server.endpoint.rpartition(":")
    endpoint = [(host, int(port))]
    client = await connect_etcd(endpoint, retries=1, tls=creds("ipam"))
    await client.put(b"/palisade/trust-test", b"ipam")
    await client.close()
    for who in ("policy", "datapath", "watcher", "cli"):
        with pytest.raises(Exception, match="cannot reach etcd"):
            await connect_etcd(endpoint, retries=1, backoff=0.01, tls=creds(who))
    with pytest.raises(Exception, match="cannot reach etcd"):
        await connect_etcd(endpoint, retries=1, backoff=0.01)  # plaintext
    with pytest.raises(Exception, match="cannot reach etcd"):
        await connect_etcd(endpoint, retries=1, backoff=0.01, tls=Credentials.load(foreign, "ipam"))


# --- files ---------------------------------------------------------------------------------------


def test_keys_and_their_directory_are_owner_only() -> None:
    root = pki()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for key in root.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_a_missing_certificate_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.policy", "--tls-dir", str(tmp_path), "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"no ca.crt in {tmp_path} for the policy component" in result.stderr
    assert "palisade tls init" in result.stderr


@pytest.mark.root
def test_the_datapath_node_socket_is_root_only(servers: dict[str, str]) -> None:
    if "socket" not in servers:
        pytest.skip(bcc_problem() or "needs root")
    socket_path = Path(servers["socket"])
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) & 0o077 == 0
    # Root reaches the whole datapath API there without a certificate ...
    with grpc.insecure_channel(f"unix:{socket_path}") as ch:
        assert _call(ch, "palisade.v1.DatapathService/ListEndpoints") == grpc.StatusCode.OK
    # ... and an unprivileged local user cannot even open it.
    script = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(3)\n"
    )
    # The system interpreter: the project's may live where nobody can read (a root-only home).
    nobody = subprocess.run(
        ["/usr/bin/python3", "-c", script, str(socket_path)],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert nobody.returncode == 3, nobody.stderr
