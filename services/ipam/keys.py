"""The etcd key layout of ipam, in one place. Pure: builds and parses keys, no I/O.

Everything lives under ``/palisade/``::

    /palisade/identities/id/<id>                    -> canonical labels ("k8s:app=web;k8s:io...")
    /palisade/identities/labels/<canonical labels>  -> <id>
    /palisade/identities/refs/<id>/<node>/<owner>   -> ""        (attached to the node's lease)
    /palisade/identities/owners/<node>/<owner>      -> <id>      (attached to the node's lease)
    /palisade/identities/creators/<id>              -> <replica> (attached to that ipam replica's lease)
    /palisade/leases/<node>                         -> <lease id, decimal> (attached to that lease)
    /palisade/ipam/nodes/<node>                     -> JSON {"cidrs": [{"cidr": ..., "source": ...}]}
    /palisade/ipam/pool/<cidr>                      -> <node>    (pool CIDR claimed by a node)
    /palisade/ipam/ips/<node>/<ip>                  -> <owner>
    /palisade/ipam/owners/<node>/<family>/<owner>   -> <ip>      (family "4" or "6")
    /palisade/ipam/outside/<family>/<hex address>   -> <node>    (an address reserved outside every pod CIDR)
    /palisade/ipcache/<prefix>                      -> IpcacheEntry (protobuf), e.g. prefix 10.244.0.5/32

Identity allocation creates the ``id`` and ``labels`` keys in one transaction that
requires both to be absent, so two allocators can neither give one label set two
ids nor one id two label sets. A reference (``refs`` + ``owners``) is taken in a
transaction that requires the ``labels`` key to still map to the id, and the
collector deletes an identity only in a transaction that requires no key under
its ``refs/<id>/`` prefix, so a reference is never taken on a collected identity.
Taking a reference also rewrites the ``id`` key (same value) so its mod revision
says "used since": the collector's grace period restarts on every use.

The ``creators`` key names the ipam replica whose transaction created the identity, and it
announces the identity on the bus; the other replicas only learn it from the watch. The key
lives on the creator's lease: when the creator dies, etcd deletes it, and the replicas that
see it go announce the identity themselves (the creator may have died before it could).

Owners may contain ``/`` (``pod/<ns>/<name>``), so owners are always the last
part of a key. Node names never contain ``/`` (Kubernetes names are DNS labels).
"""

from __future__ import annotations

import ipaddress

ROOT = "/palisade/"

IDENTITY_IDS = ROOT + "identities/id/"
IDENTITY_LABELS = ROOT + "identities/labels/"
IDENTITY_REFS = ROOT + "identities/refs/"
IDENTITY_OWNERS = ROOT + "identities/owners/"
IDENTITY_CREATORS = ROOT + "identities/creators/"
LEASES = ROOT + "leases/"
IPAM_NODES = ROOT + "ipam/nodes/"
IPAM_POOL = ROOT + "ipam/pool/"
IPAM_IPS = ROOT + "ipam/ips/"
IPAM_OWNERS = ROOT + "ipam/owners/"
IPAM_OUTSIDE = ROOT + "ipam/outside/"
IPCACHE = ROOT + "ipcache/"


def b(text: str) -> bytes:
    return text.encode()


def identity_id(identity: int) -> bytes:
    return b(f"{IDENTITY_IDS}{identity}")


def identity_labels(canonical: str) -> bytes:
    return b(IDENTITY_LABELS + canonical)


def identity_refs_of(identity: int) -> bytes:
    """Prefix of every reference on one identity."""
    return b(f"{IDENTITY_REFS}{identity}/")


def identity_ref(identity: int, node: str, owner: str) -> bytes:
    return b(f"{IDENTITY_REFS}{identity}/{node}/{owner}")


def identity_owner(node: str, owner: str) -> bytes:
    return b(f"{IDENTITY_OWNERS}{node}/{owner}")


def identity_creator(identity: int) -> bytes:
    return b(f"{IDENTITY_CREATORS}{identity}")


def lease(node: str) -> bytes:
    return b(LEASES + node)


def ipam_node(node: str) -> bytes:
    return b(IPAM_NODES + node)


def ipam_pool(cidr: str) -> bytes:
    return b(IPAM_POOL + cidr)


def ipam_ips_of(node: str) -> bytes:
    return b(f"{IPAM_IPS}{node}/")


def ipam_ip(node: str, ip: str) -> bytes:
    return b(f"{IPAM_IPS}{node}/{ip}")


def ipam_owner(node: str, family: int, owner: str) -> bytes:
    return b(f"{IPAM_OWNERS}{node}/{family}/{owner}")


def ipam_outside(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    """The cluster-wide claim of an address reserved outside the pod CIDRs.

    The address is written as fixed-width hex, so the claims inside one subnet are one
    contiguous key range (:func:`ipam_outside_range`) that a transaction can guard.
    """
    width = 8 if ip.version == 4 else 32
    return b(f"{IPAM_OUTSIDE}{ip.version}/{int(ip):0{width}x}")


def ipam_outside_range(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> tuple[bytes, bytes]:
    """[start, end) of the outside claims of every address in ``net``."""
    return ipam_outside(net.network_address), ipam_outside(net.broadcast_address) + b"\0"


def ipcache(prefix: str) -> bytes:
    return b(IPCACHE + prefix)


def _tail(key: bytes, prefix: str) -> str:
    text = key.decode()
    if not text.startswith(prefix):
        raise ValueError(f"key {text!r} is not under {prefix!r}")
    return text[len(prefix) :]


def parse_identity_id(key: bytes) -> int:
    return int(_tail(key, IDENTITY_IDS))


def parse_identity_ref(key: bytes) -> tuple[int, str, str]:
    """(id, node, owner) of a ``refs`` key."""
    ident, node, owner = _tail(key, IDENTITY_REFS).split("/", 2)
    return int(ident), node, owner


def parse_identity_owner(key: bytes) -> tuple[str, str]:
    """(node, owner) of an ``owners`` key."""
    node, owner = _tail(key, IDENTITY_OWNERS).split("/", 1)
    return node, owner


def parse_identity_creator(key: bytes) -> int:
    return int(_tail(key, IDENTITY_CREATORS))


def parse_lease(key: bytes) -> str:
    return _tail(key, LEASES)


def parse_ipam_node(key: bytes) -> str:
    return _tail(key, IPAM_NODES)


def parse_ipam_pool(key: bytes) -> str:
    return _tail(key, IPAM_POOL)


def parse_ipam_outside(key: bytes) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    family, _, value = _tail(key, IPAM_OUTSIDE).partition("/")
    number = int(value, 16)
    return ipaddress.IPv4Address(number) if family == "4" else ipaddress.IPv6Address(number)


def parse_ipam_ip(key: bytes) -> tuple[str, str]:
    """(node, ip) of an ``ips`` key."""
    node, ip = _tail(key, IPAM_IPS).split("/", 1)
    return node, ip
