"""Per-endpoint state directories: everything needed to restore an endpoint after a restart.

Layout: ``<state_dir>/<endpoint id>/endpoint.json``, one directory per endpoint, like
Cilium's ``/var/run/cilium/state/<id>``. A file is written to a temporary name and renamed,
so a crash of the process leaves either the old or the new version, never half of one. It
is not synced to disk: the state describes veths and pinned BPF objects that a reboot
removes anyway (and /var/run is a tmpfs on a node), and a sync waits on the disk's journal
in every endpoint's create.
Only what cannot be recomputed is stored: the pod, its namespace and veth, its
addresses, and where its identity came from. Policy is not stored: after a restart
it is fetched again from PolicyService (Resync), and until then the pinned maps keep
enforcing what they held.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from services.datapath.types import Address, Label, PortRecord

FORMAT_VERSION = 1
STATE_FILE = "endpoint.json"
#: A deleted endpoint whose network is still being torn down: ``<state_dir>/going-<id>-<random>``.
#: Never restored; a restart finishes its teardown (:meth:`EndpointStore.going`).
GOING_PREFIX = "going-"


class StateError(ValueError):
    """A state file cannot be read back; the message names the file."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndpointRecord:
    """The durable part of an endpoint."""

    id: int
    namespace: str
    pod: str
    #: Path of the pod's network namespace, e.g. /run/netns/palisade-x-a.
    netns: str
    #: True when the datapath created the namespace (and so deletes it with the endpoint).
    netns_owned: bool
    host_ifname: str
    host_ifindex: int
    addresses: tuple[Address, ...]
    #: Identity-relevant labels given in CreateEndpoint; empty when the identity was resolved.
    labels: tuple[Label, ...]
    #: True when the datapath took an identity reference (AllocateIdentity) it must release.
    identity_owned: bool
    identity: int
    ports: tuple[PortRecord, ...] = ()
    created_at: float = 0.0
    #: The container runtime's sandbox id, for endpoints made through CNI.
    container_id: str = ""
    #: The pod-side interface and its MAC address.
    ifname: str = "eth0"
    mac: str = ""
    #: False when another plugin made the veth (chained CNI): it is never deleted here.
    link_owned: bool = True
    #: The host end's MAC address, where Palisade made the veth ("" in records written before).
    host_mac: str = ""

    @property
    def key(self) -> str:
        """ "namespace/pod", the name users know the endpoint by."""
        return f"{self.namespace}/{self.pod}"

    @property
    def owner(self) -> str:
        """The owner string under which IPs and identity references are held."""
        return f"pod/{self.namespace}/{self.pod}"

    @property
    def ips(self) -> tuple[str, ...]:
        return tuple(a.ip for a in self.addresses)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["version"] = FORMAT_VERSION
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EndpointRecord:
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version!r} is not {FORMAT_VERSION}")
        return cls(
            id=int(data["id"]),
            namespace=str(data["namespace"]),
            pod=str(data["pod"]),
            netns=str(data["netns"]),
            netns_owned=bool(data["netns_owned"]),
            host_ifname=str(data["host_ifname"]),
            host_ifindex=int(data["host_ifindex"]),
            addresses=tuple(Address(**a) for a in data["addresses"]),
            labels=tuple(Label(str(s), str(k), str(v)) for s, k, v in data["labels"]),
            identity_owned=bool(data["identity_owned"]),
            identity=int(data["identity"]),
            ports=tuple(PortRecord(**p) for p in data.get("ports", [])),
            created_at=float(data.get("created_at", 0.0)),
            container_id=str(data.get("container_id", "")),
            ifname=str(data.get("ifname", "eth0")),
            mac=str(data.get("mac", "")),
            link_owned=bool(data.get("link_owned", True)),
            host_mac=str(data.get("host_mac", "")),
        )


class EndpointStore:
    """Reads and writes endpoint state directories. Blocking: call through ``asyncio.to_thread``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def prepare(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Root's alone: endpoint state, and the node socket that needs no certificate.
            os.chmod(self.root, 0o700)
        except OSError as exc:
            raise OSError(f"cannot create state directory {self.root} ({exc}); fix --state-dir") from None

    def directory(self, endpoint_id: int) -> Path:
        return self.root / str(endpoint_id)

    def save(self, record: EndpointRecord) -> None:
        directory = self.directory(record.id)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / STATE_FILE
        tmp = directory / (STATE_FILE + ".tmp")
        data = json.dumps(record.to_json(), indent=2, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def remove(self, endpoint_id: int) -> None:
        shutil.rmtree(self.directory(endpoint_id), ignore_errors=True)

    def mark_going(self, endpoint_id: int) -> Path:
        """Move a deleted endpoint's state out of the restorable set while its network is torn
        down (its id may be reused at once); the path to :meth:`forget` when that is done."""
        path = self.root / f"{GOING_PREFIX}{endpoint_id}-{secrets.token_hex(4)}"
        os.rename(self.directory(endpoint_id), path)
        return path

    def going(self) -> list[tuple[Path, EndpointRecord]]:
        """The deleted endpoints whose teardown a stop interrupted (unreadable ones are forgotten)."""
        out: list[tuple[Path, EndpointRecord]] = []
        if not self.root.is_dir():
            return out
        for entry in sorted(self.root.iterdir()):
            if not entry.name.startswith(GOING_PREFIX):
                continue
            try:
                out.append((entry, EndpointRecord.from_json(json.loads((entry / STATE_FILE).read_text()))))
            except (OSError, ValueError, KeyError, TypeError):
                shutil.rmtree(entry, ignore_errors=True)
        return out

    def forget(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def load_all(self) -> tuple[list[EndpointRecord], list[StateError]]:
        """Every readable endpoint (sorted by id) and one error per unreadable directory."""
        records: list[EndpointRecord] = []
        errors: list[StateError] = []
        if not self.root.is_dir():
            return records, errors
        for entry in sorted(self.root.iterdir()):
            if not entry.is_dir() or not entry.name.isdigit():
                continue
            path = entry / STATE_FILE
            try:
                record = EndpointRecord.from_json(json.loads(path.read_text()))
                if record.id != int(entry.name):
                    raise ValueError(f"holds endpoint {record.id}, not {entry.name}")
            except FileNotFoundError:
                # Created but never completed (crash during CreateEndpoint): nothing to restore.
                errors.append(StateError(f"{entry}: no {STATE_FILE}; the endpoint was never completed"))
                continue
            except (ValueError, KeyError, TypeError) as exc:
                errors.append(StateError(f"{path}: unreadable endpoint state ({exc}); delete the directory"))
                continue
            records.append(record)
        records.sort(key=lambda r: r.id)
        return records, errors
