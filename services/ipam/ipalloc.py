"""Node pod CIDRs and per-node pod addresses, on etcd.

A node gets one pod CIDR per configured family (see :mod:`services.ipam.nodecidr`
for where it comes from). Pool CIDRs are claimed with create-if-absent on
``/palisade/ipam/pool/<cidr>``, addresses with create-if-absent on both the
address key and the owner key, so neither a CIDR nor an address is ever handed
out twice, even by racing processes, and an owner never gets two addresses of
one family on a node. The in-memory maps are caches re-checked by every
transaction; a lost race re-reads the node and tries the next address.

A node's CIDR is fixed while addresses are allocated from it: a node object
that later asks for another CIDR is logged and honoured once the node's
addresses in that family are all released.

Node CIDRs and addresses stay in one class (about 620 lines) because every address
transaction is guarded by the node's CIDR record and every CIDR change by the node's
addresses; where CIDRs come from is :mod:`services.ipam.nodecidr`, the etcd layout
:mod:`services.ipam.keys`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.errors import Code
from services.common.log import get_logger
from services.common.podcidr import (
    IPAddress,
    IPNetwork,
    assignable_problem,
    capacity,
    gateway,
    host_range,
    next_free_address,
)
from services.ipam import keys
from services.ipam.config import IPAMMode
from services.ipam.errors import IpamError
from services.ipam.kv import (
    KV,
    Change,
    Compare,
    Delete,
    Get,
    Op,
    Put,
    Store,
    Txn,
    absent,
    mod_is,
    none_between,
    value_is,
)
from services.ipam.nodecidr import CIDRSource, NodeCIDR, NodeRecord, desired
from services.ipam.owners import OwnerIndexed
from services.ipam.pool import by_family, next_free_subnet

log = get_logger("ipalloc")

MAX_ATTEMPTS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class IPAllocation:
    ip: str
    node: str
    owner: str
    family: int
    cidr: str
    gateway: str


def _check_node(node: str) -> None:
    if not node or "/" in node:
        raise IpamError(f"node {node!r} is not a node name; pass the node's name", Code.INVALID_ARGUMENT)


def _parse_ip(ip: str) -> IPAddress:
    try:
        return ipaddress.ip_address(ip)
    except ValueError:
        raise IpamError(f"{ip!r} is not an IP address; pass e.g. 10.244.1.5", Code.INVALID_ARGUMENT) from None


def _holder(key: tuple[str, int, str]) -> tuple[str, str]:
    node, _family, owner = key
    return node, owner


class IPAllocator:
    """Node CIDR assignment and per-node address allocation."""

    def __init__(
        self,
        store: Store,
        clusters: Sequence[IPNetwork],
        *,
        mask_v4: int,
        mask_v6: int,
        mode: IPAMMode,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._pools = by_family(clusters)
        self._masks = {4: mask_v4, 6: mask_v6}
        self.mode = mode
        self.families = tuple(sorted(self._pools))
        self._rng = rng or random.Random()
        self._nodes: dict[str, NodeRecord] = {}
        self._claims: dict[IPNetwork, str] = {}
        self._ips: dict[str, dict[str, str]] = {}
        self._owners: OwnerIndexed[tuple[str, int, str], str] = OwnerIndexed(_holder)
        #: Addresses in use per (node, family), as ints, kept in step with ``_ips``.
        self._used: dict[tuple[str, int], set[int]] = {}
        #: Addresses a transaction of this process is trying to take right now.
        self._pending: set[tuple[str, int]] = set()
        self._cursor: dict[tuple[str, int], int] = {}
        self._k8s_nodes: dict[str, Mapping[str, Any]] = {}
        #: Addresses reserved outside every pod CIDR, and the node holding each.
        self._outside: dict[IPAddress, str] = {}

    # -- cache -------------------------------------------------------------

    def _note_ip(self, node: str, ip: str, owner: str) -> None:
        addr = ipaddress.ip_address(ip)
        self._ips.setdefault(node, {})[ip] = owner
        self._owners[(node, addr.version, owner)] = ip
        self._used.setdefault((node, addr.version), set()).add(int(addr))

    def _drop_ip(self, node: str, ip: str) -> None:
        owner = self._ips.get(node, {}).pop(ip, None)
        if owner is not None:
            addr = ipaddress.ip_address(ip)
            key = (node, addr.version, owner)
            if self._owners.get(key) == ip:
                del self._owners[key]
            self._used.get((node, addr.version), set()).discard(int(addr))

    async def load(self) -> None:
        nodes, _ = await self._store.get_prefix(keys.IPAM_NODES.encode())
        self._nodes = {}
        for kv in nodes:
            name = keys.parse_ipam_node(kv.key)
            self._nodes[name] = NodeRecord.from_json(name, kv.value, kv.mod_revision)
        claims, _ = await self._store.get_prefix(keys.IPAM_POOL.encode())
        self._claims = {ipaddress.ip_network(keys.parse_ipam_pool(kv.key)): kv.value.decode() for kv in claims}
        ips, _ = await self._store.get_prefix(keys.IPAM_IPS.encode())
        self._ips = {}
        self._owners = OwnerIndexed(_holder)
        self._used = {}
        for kv in ips:
            node, ip = keys.parse_ipam_ip(kv.key)
            self._note_ip(node, ip, kv.value.decode())
        await self._refresh_outside()

    async def _refresh_outside(self) -> None:
        kvs, _ = await self._store.get_prefix(keys.IPAM_OUTSIDE.encode())
        self._outside = {keys.parse_ipam_outside(kv.key): kv.value.decode() for kv in kvs}

    def observe(self, change: Change) -> None:
        """Apply a change to an address, node or pool key, made by any allocator, as the watch saw it."""
        key = change.kv.key
        text = key.decode(errors="replace")
        try:
            if text.startswith(keys.IPAM_NODES):
                name = keys.parse_ipam_node(key)
                current = self._nodes.get(name)
                if current is not None and current.mod_revision > change.revision:
                    return  # this process wrote it again since
                if change.deleted:
                    self._nodes.pop(name, None)
                else:
                    self._nodes[name] = NodeRecord.from_json(name, change.kv.value, change.revision)
            elif text.startswith(keys.IPAM_POOL):
                net = ipaddress.ip_network(keys.parse_ipam_pool(key))
                if change.deleted:
                    self._claims.pop(net, None)
                else:
                    self._claims[net] = change.kv.value.decode()
            elif text.startswith(keys.IPAM_OUTSIDE):
                addr = keys.parse_ipam_outside(key)
                if change.deleted:
                    self._outside.pop(addr, None)
                else:
                    self._outside[addr] = change.kv.value.decode()
            elif text.startswith(keys.IPAM_IPS):
                node, ip = keys.parse_ipam_ip(key)
                if change.deleted:
                    self._drop_ip(node, ip)
                else:
                    owner = change.kv.value.decode()
                    if self._ips.get(node, {}).get(ip) != owner:
                        self._drop_ip(node, ip)
                        self._note_ip(node, ip, owner)
        except (ValueError, KeyError) as exc:
            log.warning("malformed ipam key ignored", key=text, error=str(exc))

    async def _reload_node_ips(self, node: str) -> None:
        kvs, _ = await self._store.get_prefix(keys.ipam_ips_of(node))
        for ip in list(self._ips.get(node, {})):
            self._drop_ip(node, ip)
        for kv in kvs:
            _, ip = keys.parse_ipam_ip(kv.key)
            self._note_ip(node, ip, kv.value.decode())

    def allocation_count(self) -> int:
        return sum(len(v) for v in self._ips.values())

    def count_by_node(self) -> dict[str, int]:
        """Addresses allocated per node (nodes with a CIDR and none: 0); safe from another thread."""
        out = dict.fromkeys(self._nodes.copy(), 0)
        out.update((node, len(ips)) for node, ips in self._ips.copy().items())
        return out

    def owner_ips(self, node: str, owner: str) -> tuple[str, ...]:
        """Addresses ``owner`` holds on ``node``, IPv4 first."""
        return tuple(ip for f in (4, 6) if (ip := self._owners.get((node, f, owner))) is not None)

    def owner_keys(self) -> set[tuple[str, str]]:
        """Every (node, owner) holding an address."""
        return self._owners.pairs()

    def owner_nodes(self, owner: str) -> set[str]:
        """The nodes where ``owner`` holds an address (no scan)."""
        return self._owners.nodes_of(owner)

    def _family_in_use(self, node: str, family: int) -> int:
        return len(self._used.get((node, family), ()))

    # -- node CIDRs --------------------------------------------------------

    async def observe_node(self, name: str, obj: Mapping[str, Any] | None) -> None:
        """A node object from Kubernetes (None: deleted)."""
        if obj is None:
            self._k8s_nodes.pop(name, None)
            await self._forget_node(name)
            return
        self._k8s_nodes[name] = obj
        await self.node_cidrs(name, changed=True)

    async def _forget_node(self, name: str) -> None:
        record = self._nodes.get(name)
        if record is None or self._ips.get(name):
            return  # keep the CIDR while addresses are allocated from it
        ops: list[Op] = [Delete(keys.ipam_node(name))]
        for c in record.cidrs:
            if c.source == CIDRSource.POOL:
                pool_key = keys.ipam_pool(str(c.cidr))
                ops.append(Txn((value_is(pool_key, name.encode()),), (Delete(pool_key),)))
        res = await self._store.txn([mod_is(keys.ipam_node(name), record.mod_revision)], ops)
        if res.succeeded:
            # The etcd watch may have applied this very delete while the transaction was in flight.
            self._nodes.pop(name, None)
            for c in record.cidrs:
                if self._claims.get(c.cidr) == name:
                    del self._claims[c.cidr]
            log.info("node pod cidr released", node=name, cidrs=",".join(str(c.cidr) for c in record.cidrs))

    def node_record(self, name: str) -> NodeRecord | None:
        return self._nodes.get(name)

    def node_records(self) -> list[NodeRecord]:
        return [self._nodes[n] for n in sorted(self._nodes)]

    def _used_networks(self, exclude_node: str) -> list[IPNetwork]:
        used = set(self._claims)
        for name, record in self._nodes.items():
            if name != exclude_node:
                used.update(c.cidr for c in record.cidrs)
        # A pool CIDR never covers an address reserved outside the pod CIDRs.
        used.update(ipaddress.ip_network(addr) for addr in self._outside)
        return list(used)

    def _plan(
        self, name: str, record: NodeRecord | None, *, warn: bool
    ) -> tuple[tuple[NodeCIDR, ...], list[IPNetwork]] | None:
        """The CIDRs the node should have and the pool subnets to claim; None if it has them already.

        ``warn`` logs ignored node values and deferred changes (only when the node object changed,
        not on every allocation).
        """
        want, problems = desired(self._k8s_nodes.get(name), self.families, self.mode)
        for problem in problems if warn else ():
            log.warning("node pod cidr ignored", node=name, problem=problem)
        cidrs: list[NodeCIDR] = []
        claims: list[IPNetwork] = []
        used: list[IPNetwork] | None = None
        for family in self.families:
            current = record.cidr(family) if record else None
            target = want[family]
            keep = current is not None and (
                current == target if target is not None else current.source == CIDRSource.POOL
            )
            if current is not None and (keep or self._family_in_use(name, family)):
                if not keep and warn:
                    log.warning(
                        "node pod cidr change deferred while addresses are allocated",
                        node=name,
                        current=str(current.cidr),
                        wanted=str(target.cidr) if target else "pool",
                    )
                cidrs.append(current)
            elif target is not None:
                cidrs.append(target)
            else:
                used = self._used_networks(name) if used is None else used
                subnet = next_free_subnet(self._pools[family], self._masks[family], used)
                if subnet is None:
                    pools = ", ".join(str(p) for p in self._pools[family])
                    raise IpamError(
                        f"cluster pool {pools} has no free /{self._masks[family]} for node {name}; "
                        "add a cluster CIDR (--cluster-cidrs) or remove nodes",
                        Code.RESOURCE_EXHAUSTED,
                    )
                used.append(subnet)
                claims.append(subnet)
                cidrs.append(NodeCIDR(subnet, CIDRSource.POOL))
        planned = tuple(cidrs)
        if record is not None and record.cidrs == planned:
            return None
        return planned, claims

    async def node_cidrs(self, name: str, *, changed: bool = False) -> NodeRecord:
        """The node's CIDRs, assigning them (from the node object or the pool) if needed.

        ``changed``: called because the node object changed (reports what it cannot honour).
        """
        _check_node(name)
        for attempt in range(MAX_ATTEMPTS):
            record = self._nodes.get(name)
            plan = self._plan(name, record, warn=changed and attempt == 0)
            if plan is None:
                assert record is not None
                return record
            cidrs, claims = plan
            node_key = keys.ipam_node(name)
            new = NodeRecord(name, cidrs)
            compares = [mod_is(node_key, record.mod_revision if record else 0)]
            compares += [absent(keys.ipam_pool(str(c))) for c in claims]
            compares += [none_between(*keys.ipam_outside_range(c)) for c in claims]
            ops: list[Op] = [Put(node_key, new.to_json())]
            ops += [Put(keys.ipam_pool(str(c)), name.encode()) for c in claims]
            released = [c.cidr for c in (record.cidrs if record else ()) if c.source == CIDRSource.POOL]
            released = [c for c in released if c not in {x.cidr for x in cidrs}]
            for c in released:
                pool_key = keys.ipam_pool(str(c))
                ops.append(Txn((value_is(pool_key, name.encode()),), (Delete(pool_key),)))
            failure: list[Op] = [Get(node_key), *(Get(keys.ipam_pool(str(c))) for c in claims)]
            res = await self._store.txn(compares, ops, failure)
            if res.succeeded:
                self._nodes[name] = dataclasses.replace(new, mod_revision=res.revision)
                for c in claims:
                    self._claims[c] = name
                for c in released:
                    self._claims.pop(c, None)
                log.info(
                    "node pod cidr assigned",
                    node=name,
                    cidrs=",".join(str(c.cidr) for c in cidrs),
                    source=cidrs[0].source.value if cidrs else "",
                )
                return self._nodes[name]
            current = res.first(0)
            if current is not None:
                self._nodes[name] = NodeRecord.from_json(name, current.value, current.mod_revision)
            else:
                self._nodes.pop(name, None)
            for i, c in enumerate(claims, start=1):
                taken = res.first(i)
                if taken is not None:
                    self._claims[c] = taken.value.decode()
            await self._refresh_nodes()
            await self._refresh_outside()
        raise IpamError(f"gave up assigning a pod CIDR to node {name} after concurrent changes; retry", Code.ABORTED)

    async def _refresh_nodes(self) -> None:
        nodes, _ = await self._store.get_prefix(keys.IPAM_NODES.encode())
        for kv in nodes:
            name = keys.parse_ipam_node(kv.key)
            self._nodes[name] = NodeRecord.from_json(name, kv.value, kv.mod_revision)

    # -- addresses ---------------------------------------------------------

    def _allocation(self, node: str, ip: str, owner: str, record: NodeRecord) -> IPAllocation:
        addr = ipaddress.ip_address(ip)
        cidr = record.cidr(addr.version)
        net = str(cidr.cidr) if cidr else ""
        gw = str(gateway(cidr.cidr)) if cidr else ""
        return IPAllocation(ip=ip, node=node, owner=owner, family=addr.version, cidr=net, gateway=gw)

    async def _outside_guards(self, node: str, addr: IPAddress) -> list[Compare]:
        """Check that ``addr`` may be reserved on ``node`` outside its pod CIDR; the guards of that reservation.

        It must not be in another node's pod CIDR (reserve it there), nor claimed outside by another
        node; inside the cluster pool, the pool subnet around it must still be unclaimed (the claim of
        a subnet, in turn, requires that no address inside it is reserved outside).
        """
        kind = next(
            (
                name
                for name, test in (
                    ("unspecified", addr.is_unspecified),
                    ("loopback", addr.is_loopback),
                    ("multicast", addr.is_multicast),
                    ("link-local", addr.is_link_local),
                )
                if test
            ),
            None,
        )
        if kind is not None:
            raise IpamError(f"cannot reserve {addr}: it is a {kind} address", Code.INVALID_ARGUMENT)
        # The nodes as the watch keeps them (observe): reading every node record again here cost an
        # etcd round trip and a parse per node in every reservation, and a node written between that
        # read and the transaction was missed all the same. Inside the cluster pool, the pool-claim
        # guards below make the transaction itself refuse an address in a node's carved CIDR.
        for name, record in sorted(self._nodes.items()):
            for c in record.cidrs:
                if name != node and addr in c.cidr:
                    raise IpamError(
                        f"cannot reserve {addr} on node {node}: it is in node {name}'s pod CIDR {c.cidr}; "
                        f"reserve it on {name}, or choose an address outside every pod CIDR",
                        Code.FAILED_PRECONDITION,
                    )
        guards = [absent(keys.ipam_outside(addr))]
        mask = self._masks[addr.version]
        for pool in self._pools.get(addr.version, []):
            if addr in pool and pool.prefixlen <= mask:
                subnet = ipaddress.ip_network(f"{addr}/{mask}", strict=False)
                guards.append(absent(keys.ipam_pool(str(subnet))))
        return guards

    async def allocate(
        self, node: str, owner: str, family: int | None = None, ip: str = "", *, outside_pool: bool = False
    ) -> IPAllocation:
        """Give ``owner`` an address on ``node`` (the next free one, or exactly ``ip`` to restore it).

        An ``ip`` outside the node's pod CIDR is reserved only with ``outside_pool`` (an address
        chosen elsewhere, e.g. a manifest's ``status.podIP``), and then cluster-wide: no other node
        reserves it and no pool CIDR is carved around it.
        """
        _check_node(node)
        if not owner:
            raise IpamError("owner is empty; pass who gets the address, e.g. pod/ns/name", Code.INVALID_ARGUMENT)
        wanted = _parse_ip(ip) if ip else None
        if wanted is not None and family is not None and wanted.version != family:
            raise IpamError(f"{ip} is not an IPv{family} address; fix family or ip", Code.INVALID_ARGUMENT)
        fam = wanted.version if wanted is not None else (family or self.families[0])
        if fam not in self.families:
            raise IpamError(
                f"IPv{fam} is not configured; add an IPv{fam} cluster CIDR to --cluster-cidrs",
                Code.FAILED_PRECONDITION,
            )
        record = await self.node_cidrs(node)
        node_cidr = record.cidr(fam)
        assert node_cidr is not None
        cidr = node_cidr.cidr
        outside = wanted is not None and wanted not in cidr
        guards: list[Compare] = []
        if wanted is not None and outside:
            if not outside_pool:
                raise IpamError(
                    f"cannot reserve {ip} on node {node}: it is outside the node's pod CIDR {cidr}; set "
                    "outside_pool to reserve an address chosen elsewhere (e.g. a manifest's status.podIP)",
                    Code.INVALID_ARGUMENT,
                )
            guards = await self._outside_guards(node, wanted)
        elif wanted is not None:
            problem = assignable_problem(cidr, wanted)
            if problem is not None:
                raise IpamError(f"cannot reserve {ip} on node {node}: {problem}", Code.INVALID_ARGUMENT)
        owner_key = keys.ipam_owner(node, fam, owner)
        if wanted is None and (node, fam, owner) in self._owners:
            await self._refuse_second(node, owner, owner_key)
        reloaded = False
        for _ in range(MAX_ATTEMPTS):
            candidate = wanted
            if candidate is None:
                taken = _Taken(self._used.get((node, fam), set()), self._pending, node)
                candidate = next_free_address(cidr, taken, self._cursor.get((node, fam)))
            if candidate is None:
                if not reloaded:
                    await self._reload_node_ips(node)
                    reloaded = True
                    continue
                await self._refuse_second(node, owner, owner_key)
                raise IpamError(
                    f"node {node} pod CIDR {cidr} has no free address ({capacity(cidr)} in use); release "
                    "addresses of gone pods or give nodes larger CIDRs (--node-mask-v4/--node-mask-v6)",
                    Code.RESOURCE_EXHAUSTED,
                )
            text = str(candidate)
            ip_key = keys.ipam_ip(node, text)
            # Claimed locally before the round trip, so concurrent requests pick other addresses.
            self._cursor[(node, fam)] = int(candidate)
            pending = (node, int(candidate))
            mine = wanted is None and pending not in self._pending
            if mine:
                self._pending.add(pending)
            success: list[Op] = [Put(ip_key, owner.encode()), Put(owner_key, text.encode())]
            if guards:
                success.append(Put(keys.ipam_outside(candidate), node.encode()))
            try:
                res = await self._store.txn(
                    [absent(ip_key), absent(owner_key), *guards],
                    success,
                    [Get(ip_key), Get(owner_key), Get(keys.ipam_outside(candidate))],
                )
            finally:
                if mine:
                    self._pending.discard(pending)
            if res.succeeded:
                self._note_ip(node, text, owner)
                if guards:
                    self._outside[candidate] = node
                log.info("ip allocated", node=node, ip=text, owner=owner, outside_pool=bool(guards))
                return self._allocation(node, text, owner, record)
            by_ip, by_owner, by_outside = res.first(0), res.first(1), res.first(2)
            if by_ip is not None:
                self._note_ip(node, text, by_ip.value.decode())
            if by_owner is not None:
                held = by_owner.value.decode()
                self._note_ip(node, held, owner)
                if (wanted is not None and held == text) or (
                    res.retried and _is_own_write(by_ip, by_owner, text, owner)
                ):
                    return self._allocation(node, held, owner, record)
                raise IpamError(
                    f"{owner} already has {held} on node {node}; release it first, or pass ip={held} to restore it",
                    Code.ALREADY_EXISTS,
                )
            if by_ip is not None:
                if wanted is not None:
                    raise IpamError(
                        f"{text} on node {node} is allocated to {by_ip.value.decode()}; release it first "
                        "or restore a different address",
                        Code.ALREADY_EXISTS,
                    )
                # Lost a race for this address to another process (a replica allocating on this node
                # too): go on from a random place in the CIDR, so the two part ways instead of
                # meeting again at every next address.
                first, last = host_range(cidr)
                self._cursor[(node, fam)] = self._rng.randint(first, last)
            elif guards and by_outside is not None:
                holder = by_outside.value.decode()
                self._outside[candidate] = holder
                raise IpamError(
                    f"{text} is already reserved outside the pod CIDRs by node {holder}; release it there first",
                    Code.ALREADY_EXISTS,
                )
            elif guards:
                # The pool subnet around it was claimed meanwhile: it now belongs to a node's pod CIDR.
                guards = await self._outside_guards(node, candidate)
        raise IpamError(f"gave up allocating an address on node {node} under contention; retry", Code.ABORTED)

    async def _refuse_second(self, node: str, owner: str, owner_key: bytes) -> None:
        """ALREADY_EXISTS if ``owner`` holds an address of this family on ``node`` (checked in etcd)."""
        held = await self._store.get(owner_key)
        if held is None:
            return
        text = held.value.decode()
        self._note_ip(node, text, owner)
        raise IpamError(
            f"{owner} already has {text} on node {node}; release it first, or pass ip={text} to restore it",
            Code.ALREADY_EXISTS,
        )

    async def release(self, node: str, ip: str, owner: str = "") -> IPAllocation:
        """Free ``ip`` on ``node``; with ``owner`` it must belong to that owner."""
        _check_node(node)
        addr = _parse_ip(ip)
        text = str(addr)
        ip_key = keys.ipam_ip(node, text)
        # The cache's idea of the holder saves a read; the transaction checks it.
        holder = self._ips.get(node, {}).get(text)
        if holder is None:
            kv = await self._store.get(ip_key)
            holder = kv.value.decode() if kv is not None else None
        for _ in range(MAX_ATTEMPTS):
            if holder is None:
                self._drop_ip(node, text)
                raise IpamError(
                    f"{text} is not allocated on node {node}; ListAllocations shows what is",
                    Code.NOT_FOUND,
                )
            if owner and holder != owner:
                raise IpamError(
                    f"{text} on node {node} belongs to {holder}, not {owner}; pass the right owner or none",
                    Code.FAILED_PRECONDITION,
                )
            owner_key = keys.ipam_owner(node, addr.version, holder)
            outside_key = keys.ipam_outside(addr)
            res = await self._store.txn(
                [value_is(ip_key, holder.encode())],
                [
                    Delete(ip_key),
                    Txn((value_is(owner_key, text.encode()),), (Delete(owner_key),)),
                    Txn((value_is(outside_key, node.encode()),), (Delete(outside_key),)),
                ],
                [Get(ip_key)],
            )
            if res.succeeded:
                self._drop_ip(node, text)
                if self._outside.get(addr) == node:
                    del self._outside[addr]
                log.info("ip released", node=node, ip=text, owner=holder)
                record = self._nodes.get(node) or NodeRecord(node, ())
                return self._allocation(node, text, holder, record)
            current = res.first(0)
            self._drop_ip(node, text)
            holder = current.value.decode() if current is not None else None
            if holder is not None:
                self._note_ip(node, text, holder)
        raise IpamError(f"gave up releasing {text} on node {node} under contention; retry", Code.ABORTED)

    def list(self, node: str = "") -> tuple[list[IPAllocation], list[NodeRecord]]:
        nodes = [node] if node else sorted(set(self._ips) | set(self._nodes))
        allocations = []
        for name in nodes:
            record = self._nodes.get(name) or NodeRecord(name, ())
            for ip, owner in sorted(self._ips.get(name, {}).items(), key=lambda x: ipaddress.ip_address(x[0])):
                allocations.append(self._allocation(name, ip, owner, record))
        records = [self._nodes[n] for n in nodes if n in self._nodes]
        return allocations, records


class _Taken:
    """Addresses not to pick on one node: in use, or being taken by a transaction in flight."""

    def __init__(self, used: set[int], pending: set[tuple[str, int]], node: str) -> None:
        self._used = used
        self._pending = pending
        self._node = node

    def __contains__(self, value: object) -> bool:
        return value in self._used or (self._node, value) in self._pending


def _is_own_write(by_ip: KV | None, by_owner: KV, ip: str, owner: str) -> bool:
    """A retried transaction that had already been applied: both keys say exactly what we wrote."""
    return by_ip is not None and by_ip.value.decode() == owner and by_owner.value.decode() == ip
