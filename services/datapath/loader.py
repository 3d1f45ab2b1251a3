"""Compile the datapath program once, reuse it for every endpoint, attach it with tc.

Template cache (after Cilium's ``pkg/datapath/loader/cache.go``): a template is
keyed by the SHA-256 of the C source, the layout asserts generated from the
map modules, the numbers the program shares with them (``maps.constants``: defined
by cflags, asserted beside the layouts) and the compile-time configuration. Nothing per endpoint is
compiled in (the program finds its endpoint by ``skb->ifindex``), so one
template serves every endpoint. Lookup order:

1. this process's cache;
2. programs pinned under ``<pin_dir>/programs/<hash>/`` by an earlier process
   (no compiler run at all after a restart);
3. compile with bcc, load the programs, pin them.

A template is four programs: the two below; ``deliver``, which
``from_container`` tail-calls for a packet to another local endpoint (that
endpoint's ingress policy, then straight into its namespace); and
``sctp_csum``, which the other three tail-call for an SCTP packet whose ports
they translated (its CRC32c, then on where the caller would have sent it).
The tail-called ones sit in the template's program array ``calls``, pinned
beside the programs: a program array empties when its last pin or descriptor
goes; a tail call into an empty slot falls back to the host's path (deliver)
or drops the packet (sctp_csum: it would leave with a wrong checksum).

Local headers (``#include "name.h"`` of a file in ``bpf/``) are put into the
source text where they are included (with ``#line`` markers, so compiler
messages name the header and its line): bcc rewrites map method calls in its
main file only, and the template hash, taken over that text, covers every file.

Attaching puts ``from_container`` on the tc ingress hook of the pod's
host-side veth (packets leaving the pod) and ``to_container`` on its tc egress
hook (packets entering it), in one of two ways (by default, :func:`default_attach`:
tc with local delivery, tcx where the kernel has it without):

- tc: a ``clsact`` qdisc with one
  direct-action ``bpf`` filter per hook, always at the same priority and handle
  and written with replace semantics.
- tcx (kernel 6.6+; ``auto`` picks it where the kernel has it, as Cilium does): one
  BPF link per hook, pinned under ``<pin_dir>/links/<ifindex>/``. No qdisc and
  no classifier walk per packet. Re-attaching updates the link's program
  atomically. But the kernel waits an RCU grace period under the rtnl lock for
  every link attached (~13 ms here): two per pod, serialized with every other
  pod's network work on the node, so a pod's start pays ~26 ms and a burst of
  pods queues behind them. A filter's attach waits for none. Per packet the
  two measured alike where a packet crosses one hook (local delivery;
  ``bench_datapath_cost --compare-attach``); across two (local delivery off)
  tcx kept ~3.5 % more of the 64-byte UDP rate. Hence the default: where
  every packet crosses both hooks, the per-packet saving is worth the pod-start
  cost; where it crosses one, it is not.

The tc qdisc and both filters go to the kernel in one netlink send
(:mod:`services.datapath.rtnl`, not pyroute2, whose per-request event loop cost
more CPU than the attach itself); reading them back (:meth:`Loader.attachment`)
still parses pyroute2's dump.

Either way, re-attaching a new template swaps the program in place with no
window where the hook is empty, and the pins or filters hold the programs, so
enforcement continues when this process exits. Attaching one way removes an
attachment made the other way (an agent upgraded onto a newer kernel).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from services.common.log import get_logger
from services.datapath import maps, rtnl
from services.datapath.maps import constants
from services.datapath.maps.bpf import (
    BPF_TCX_EGRESS,
    BPF_TCX_INGRESS,
    BpfError,
    c_layout,
    link_create,
    link_detach,
    link_info,
    link_update,
    obj_get,
    obj_pin,
    prog_info,
    prog_info_by_id,
    prog_query,
)
from services.datapath.maps.sizes import MapSizes
from services.datapath.rtnl import Rtnl
from services.datapath.types import IDENTITY_WORLD

log = get_logger("loader")

SOURCE_DIR = Path(__file__).parent / "bpf"
SOURCE_PATH = SOURCE_DIR / "palisade.c"
PROGRAMS_DIR = "programs"
FROM_CONTAINER = "from_container"
TO_CONTAINER = "to_container"
DELIVER = "deliver"
SCTP_CSUM = "sctp_csum"
DNS_STEER = "dns_steer"
#: The programs of a template, as pinned, and the pinned program array holding the tail-called ones.
PROGRAMS = (FROM_CONTAINER, TO_CONTAINER, DELIVER, SCTP_CSUM, DNS_STEER)
CALLS = "calls"
#: Slots of ``calls`` (shared with the program: see program_constants).
CALL_DELIVER = 0
CALL_SCTP_CSUM = 1
CALL_DNS_STEER = 2
CALL_SLOTS = {DELIVER: CALL_DELIVER, SCTP_CSUM: CALL_SCTP_CSUM, DNS_STEER: CALL_DNS_STEER}
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# clsact hooks: TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS / TC_H_MIN_EGRESS).
TC_INGRESS_PARENT = 0xFFFFFFF2
TC_EGRESS_PARENT = 0xFFFFFFF3
FILTER_PRIO = 1
FILTER_HANDLE = 1
ETH_P_ALL = 0x0003
FILTER_NAME_PREFIX = "palisade"
#: Pinned tcx links: ``<pin_dir>/links/<ifindex>/<program>``.
LINKS_DIR = "links"
#: The two hooks: program, tcx attach type, clsact parent.
HOOKS = (
    (FROM_CONTAINER, BPF_TCX_INGRESS, TC_INGRESS_PARENT),
    (TO_CONTAINER, BPF_TCX_EGRESS, TC_EGRESS_PARENT),
)
#: "tcx": BPF links on the tc hooks (kernel 6.6+: no qdisc, no classifier walk; each attach waits a
#: grace period under rtnl); "tc": a clsact qdisc with bpf filters (any kernel); "auto": tcx where
#: the kernel has it.
ATTACH_MODES = ("auto", "tcx", "tc")
#: How a loader attaches unless told otherwise; the datapath's default depends on its
#: configuration (:func:`default_attach`).
DEFAULT_ATTACH = "tc"

#: Every struct the program shares with Python, as (ctypes struct, C struct name).
C_STRUCTS = tuple(struct for module in maps.ALL for struct in module.C_STRUCTS)


def program_constants() -> tuple[constants.Shared, ...]:
    """Every number the program shares with Python: the map modules' and the loader's own."""
    return (
        *constants.shared(),
        constants.Shared("CALL_DELIVER", CALL_DELIVER, "loader.CALL_DELIVER"),
        constants.Shared("CALL_SCTP_CSUM", CALL_SCTP_CSUM, "loader.CALL_SCTP_CSUM"),
        constants.Shared("CALL_DNS_STEER", CALL_DNS_STEER, "loader.CALL_DNS_STEER"),
        constants.Shared("CALL_SLOTS", len(CALL_SLOTS), "loader.CALL_SLOTS"),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramConfig:
    """Compile-time configuration; every field is part of the template hash."""

    #: Identity of addresses neither local nor in the ipcache.
    world_identity: int = IDENTITY_WORLD
    #: Idle lifetime of a TCP conntrack entry.
    ct_tcp_lifetime_s: int = 21600
    #: Lifetime of a TCP entry after FIN or RST.
    ct_closing_lifetime_s: int = 10
    #: Idle lifetime of UDP, SCTP, ICMP and other entries.
    ct_other_lifetime_s: int = 60
    #: Deliver packets between local endpoints straight into the destination's namespace (its
    #: ingress policy judged on the way) instead of through the host's routing and netfilter.
    local_delivery: bool = True
    #: Allow new flows into a pod from its own node (the host identity) whatever the policy.
    allow_host: bool = True
    sizes: MapSizes = dataclasses.field(default_factory=MapSizes)

    def cflags(self, pin_dir: str) -> list[str]:
        """The configuration's defines, then the shared numbers' (the program defines neither)."""
        s = self.sizes
        return [
            f'-DPIN_DIR="{pin_dir}"',
            f"-DLOCAL_DELIVERY={int(self.local_delivery)}",
            f"-DALLOW_HOST={int(self.allow_host)}",
            f"-DWORLD_ID={self.world_identity}",
            f"-DCT_TCP_LIFETIME_S={self.ct_tcp_lifetime_s}",
            f"-DCT_CLOSING_LIFETIME_S={self.ct_closing_lifetime_s}",
            f"-DCT_OTHER_LIFETIME_S={self.ct_other_lifetime_s}",
            f"-DIPCACHE_MAX={s.ipcache}",
            f"-DENDPOINTS_MAX={s.endpoints}",
            f"-DPOLICY_MAX={s.policy}",
            f"-DCT_MAX={s.conntrack}",
            f"-DMETRICS_MAX={s.metrics}",
            f"-DLB_SERVICES_MAX={s.lb_services}",
            f"-DLB_BACKENDS_MAX={s.lb_backends}",
            f"-DLB_REVNAT_MAX={s.lb_services}",
            f"-DLB_AFFINITY_MAX={s.lb_affinity}",
            f"-DLB_CT_MAX={s.lb_conntrack}",
            f"-DSNAT_MAX={s.snat}",
            f"-DDNS_STEER_MAX={s.dns_steer}",
            f"-DEVENTS_BYTES={s.events_bytes}",
            f"-DEVENTS_WAKEUP_BYTES={maps.eventsmap.wakeup_bytes(s)}",
            *constants.defines(program_constants()),
        ]


def expand_includes(path: Path, seen: frozenset[str] = frozenset()) -> str:
    """``path``'s text with each ``#include "name"`` of a file beside it replaced by that file's
    (expanded) text between ``#line`` markers; other includes stay. A file including itself, directly
    or not, is an error."""
    out: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        match = _LOCAL_INCLUDE.match(line)
        header = path.parent / match.group(1) if match else None
        if header is None or not header.is_file():
            out.append(line)
            continue
        if header.name in seen or header.name == path.name:
            raise ValueError(f"{path.name} line {number}: {header.name} includes itself")
        out.append(f'#line 1 "{header.name}"\n')
        text = expand_includes(header, seen | {path.name})
        out.append(text if text.endswith("\n") else text + "\n")
        out.append(f'#line {number + 1} "{path.name}"\n')
    return "".join(out)


def program_source() -> str:
    """The C source, its local headers put in place, with the asserts that tie it to Python: the
    layouts of the ctypes mirrors, and the shared numbers' values (the cflags define them; a
    definition in C that differs fails)."""
    layouts = [line for struct, name in C_STRUCTS for line in c_layout(struct, name)]
    return (
        expand_includes(SOURCE_PATH)
        + "\n/* Generated by loader.py from the ctypes mirrors. */\n"
        + "\n".join(layouts)
        + "\n/* Generated by loader.py from maps/constants.py. */\n"
        + "\n".join(constants.asserts(program_constants()))
        + "\n"
    )


def template_hash(source: str, cflags: list[str]) -> str:
    """The template's key: the source (its headers in place, see program_source) and the flags."""
    digest = hashlib.sha256(source.encode())
    for flag in cflags:
        digest.update(b"\0" + flag.encode())
    return digest.hexdigest()


@dataclasses.dataclass
class Template:
    """The loaded programs, shared by every endpoint."""

    hash: str
    from_container_fd: int
    to_container_fd: int
    #: The program from_container tail-calls for local delivery (attached nowhere).
    deliver_fd: int
    #: The program array holding the tail-called programs: held open so it stays filled while this
    #: process uses the template, even if another process unpins it.
    calls_fd: int
    #: "compiled" (by this process), or "pinned" (reused from an earlier process).
    origin: str
    #: Seconds spent compiling and loading (0 when reused).
    compile_seconds: float
    #: The program the others tail-call for a translated SCTP packet's checksum (attached nowhere).
    sctp_csum_fd: int = -1
    #: The program from_container tail-calls for a DNS query policy passed (attached nowhere).
    dns_steer_fd: int = -1

    @property
    def short(self) -> str:
        return self.hash[:12]

    def fd(self, name: str) -> int:
        fds = {
            FROM_CONTAINER: self.from_container_fd,
            TO_CONTAINER: self.to_container_fd,
            DELIVER: self.deliver_fd,
            SCTP_CSUM: self.sctp_csum_fd,
            DNS_STEER: self.dns_steer_fd,
        }
        return fds[name]

    @classmethod
    def of_fds(cls, digest: str, fds: list[int], *, origin: str, compile_seconds: float) -> Template:
        """A template from the descriptors of PROGRAMS then CALLS, in that order."""
        by_name = dict(zip((*PROGRAMS, CALLS), fds, strict=True))
        return cls(
            digest,
            by_name[FROM_CONTAINER],
            by_name[TO_CONTAINER],
            by_name[DELIVER],
            by_name[CALLS],
            origin=origin,
            compile_seconds=compile_seconds,
            sctp_csum_fd=by_name[SCTP_CSUM],
            dns_steer_fd=by_name[DNS_STEER],
        )

    def close(self) -> None:
        for fd in (
            self.from_container_fd,
            self.to_container_fd,
            self.deliver_fd,
            self.calls_fd,
            self.sctp_csum_fd,
            self.dns_steer_fd,
        ):
            if fd >= 0:
                os.close(fd)
        self.from_container_fd = self.to_container_fd = self.deliver_fd = self.calls_fd = self.sctp_csum_fd = -1


@dataclasses.dataclass(frozen=True)
class Attachment:
    """What runs on one veth's hooks: per hook, the short hash of the Palisade template there
    ("" for a Palisade program of a template this pin directory does not hold), None for none."""

    from_container: str | None
    to_container: str | None
    #: "tcx" or "tc": how the programs found are attached (None: none found).
    mechanism: str | None = None
    #: Palisade programs found on the two hooks (2 when each hook runs exactly one).
    programs: int = 0

    @property
    def complete(self) -> bool:
        return self.from_container is not None and self.to_container is not None

    def template(self) -> str | None:
        """The short template hash, when both hooks run the same known template."""
        if not self.complete or not self.from_container or self.from_container != self.to_container:
            return None
        return self.from_container


def default_attach(config: ProgramConfig) -> str:
    """How a datapath of this configuration attaches unless told: tc filters with local delivery
    (a packet crosses one hook; a pod's start waits no grace period), tcx links where the kernel
    has them without it (every packet crosses both hooks, and tcx's per-hook saving shows)."""
    return DEFAULT_ATTACH if config.local_delivery else "auto"


class Loader:
    """Owns the program templates of one pin directory and the attachments to pod veths."""

    def __init__(self, pin_dir: str, attach: str = DEFAULT_ATTACH) -> None:
        if attach not in ATTACH_MODES:
            raise ValueError(f"attach mode {attach!r}: give one of {', '.join(ATTACH_MODES)}")
        self.pin_dir = pin_dir
        self.attach_mode = attach
        self._tcx_missing = False
        self._templates: dict[str, Template] = {}
        self._lock = threading.Lock()
        self._ipr: Any = None  # pyroute2, for reading the tc filters back
        self._nl: Rtnl | None = None  # for attaching and detaching them

    def _programs_dir(self, digest: str) -> str:
        return os.path.join(self.pin_dir, PROGRAMS_DIR, digest[:32])

    def template(self, config: ProgramConfig) -> Template:
        source = program_source()
        cflags = config.cflags(self.pin_dir)
        digest = template_hash(source, cflags)
        with self._lock:
            cached = self._templates.get(digest)
            if cached is not None:
                return cached
            template = self._open_pinned(digest) or self._compile(digest, source, cflags)
            self._templates[digest] = template
            return template

    def _open_pinned(self, digest: str) -> Template | None:
        directory = self._programs_dir(digest)
        paths = [os.path.join(directory, name) for name in (*PROGRAMS, CALLS)]
        if not all(os.path.exists(p) for p in paths):
            return None
        fds = [obj_get(p) for p in paths]
        log.info("template reused", template=digest[:12], dir=directory)
        return Template.of_fds(digest, fds, origin="pinned", compile_seconds=0.0)

    def _compile(self, digest: str, source: str, cflags: list[str]) -> Template:
        # Only this module imports bcc, and only when a template must be built.
        from bcc import BPF

        start = time.perf_counter()
        bpf = BPF(text=source.encode(), cflags=cflags)
        try:
            functions = [bpf.load_func(name.encode(), BPF.SCHED_CLS) for name in PROGRAMS]
            calls = bpf.get_table(CALLS.encode())
            for name, slot in CALL_SLOTS.items():
                calls[ctypes.c_int(slot)] = ctypes.c_int(functions[PROGRAMS.index(name)].fd)
            directory = self._programs_dir(digest)
            os.makedirs(directory, exist_ok=True)
            # The program array last: its pin is what _open_pinned takes for a finished template.
            for name, fd in [*((n, fn.fd) for n, fn in zip(PROGRAMS, functions, strict=True)), (CALLS, calls.map_fd)]:
                path = os.path.join(directory, name)
                if os.path.exists(path):  # a half-finished earlier attempt
                    os.unlink(path)
                obj_pin(fd, path)
            fds = [obj_get(os.path.join(directory, name)) for name in (*PROGRAMS, CALLS)]
        finally:
            # The pins keep the programs (and through them the maps) loaded, and the program
            # array filled.
            bpf.cleanup()
        seconds = time.perf_counter() - start
        log.info("template compiled", template=digest[:12], seconds=round(seconds, 3))
        return Template.of_fds(digest, fds, origin="compiled", compile_seconds=seconds)

    def prune(self, keep: set[str]) -> list[str]:
        """Unpin templates not in ``keep`` (full hashes); programs still attached stay loaded."""
        root = os.path.join(self.pin_dir, PROGRAMS_DIR)
        kept = {digest[:32] for digest in keep}
        removed: list[str] = []
        if not os.path.isdir(root):
            return removed
        for name in os.listdir(root):
            if name not in kept:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(name)
        return removed

    # -- attaching -------------------------------------------------------------

    def _iproute(self) -> Any:
        if self._ipr is None:
            from pyroute2 import IPRoute

            self._ipr = IPRoute()
        return self._ipr

    @property
    def mechanism(self) -> str:
        """How this loader attaches: "tcx", or "tc" (chosen, or found to be all the kernel has)."""
        return "tc" if self.attach_mode == "tc" or self._tcx_missing else "tcx"

    def attach(self, template: Template, ifindex: int) -> None:
        """Attach (or atomically replace) both programs on the veth ``ifindex``."""
        with self._lock:
            if self.mechanism == "tcx":
                try:
                    self._tcx_attach(template, ifindex)
                except BpfError as exc:
                    if self.attach_mode != "auto" or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    # A kernel before 6.6 has no tcx attach types: tc filters do the same job.
                    self._tcx_missing = True
                    log.warning("tcx is not supported by this kernel; attaching with tc filters", error=str(exc))
                else:
                    # An attachment an earlier agent made with tc filters: tcx runs first and passes or
                    # drops for good, so they would never run again; remove them.
                    self._tc_detach(ifindex)
                    return
            self._tc_attach(template, ifindex)
            self._tcx_detach(ifindex)

    def detach(self, ifindex: int) -> bool:
        """Remove both programs (links and tc filters alike); False if there was none."""
        with self._lock:
            found = self._tcx_detach(ifindex)
            return self._tc_detach(ifindex) or found

    def release_links(self, keep: set[int]) -> list[int]:
        """Detach and unpin the tcx links of every veth but those in ``keep``; the ifindexes released."""
        with self._lock:
            root = os.path.join(self.pin_dir, LINKS_DIR)
            found = sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []
            released = [ifindex for ifindex in found if ifindex not in keep]
            for ifindex in released:
                self._tcx_detach(ifindex)
            return released

    def attachment(self, ifindex: int) -> Attachment:
        """Which Palisade programs run on the hooks of ``ifindex``, as the kernel reports them."""
        with self._lock:
            for found in (self._tcx_attachment(ifindex), self._tc_attachment(ifindex)):
                if found.programs:
                    return found
            return Attachment(None, None)

    # tcx: one BPF link per hook, pinned so it outlives this process ------------------

    def _link_path(self, ifindex: int, name: str) -> str:
        return os.path.join(self.pin_dir, LINKS_DIR, str(ifindex), name)

    def _tcx_attach(self, template: Template, ifindex: int) -> None:
        for name, attach_type, _parent in HOOKS:
            prog_fd = template.fd(name)
            path = self._link_path(ifindex, name)
            if os.path.exists(path):
                link = obj_get(path)
                try:
                    info = link_info(link)
                    if info.tcx_ifindex == ifindex and info.tcx_attach_type == attach_type:
                        link_update(link, prog_fd)
                        continue
                    # Defunct: its veth was deleted (a new one may have its ifindex now).
                    with contextlib.suppress(BpfError):
                        link_detach(link)
                finally:
                    os.close(link)
                os.unlink(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            link = link_create(prog_fd, ifindex, attach_type)
            try:
                obj_pin(link, path)
            finally:
                # Unpinned, the link would go with the fd: the program never stays attached unowned.
                os.close(link)

    def _tcx_detach(self, ifindex: int) -> bool:
        found = False
        for name, _attach_type, _parent in HOOKS:
            path = self._link_path(ifindex, name)
            if not os.path.exists(path):
                continue
            link = obj_get(path)
            try:
                found |= link_info(link).tcx_ifindex == ifindex
                with contextlib.suppress(BpfError):  # defunct already
                    link_detach(link)
            finally:
                os.close(link)
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self._link_path(ifindex, FROM_CONTAINER)))
        return found

    def _tcx_attachment(self, ifindex: int) -> Attachment:
        found: dict[str, str | None] = {FROM_CONTAINER: None, TO_CONTAINER: None}
        count = 0
        templates: dict[int, str] | None = None  # listed only once a Palisade program is found
        for name, attach_type, _parent in HOOKS:
            try:
                ids = prog_query(ifindex, attach_type)
            except BpfError:  # no such device, or a kernel without tcx
                continue
            for prog_id in ids:
                info = prog_info_by_id(prog_id)
                if info is None or info.name.decode() != name:
                    continue
                count += 1
                if templates is None:
                    templates = self._template_ids()
                found[name] = templates.get(prog_id, "")
        return Attachment(found[FROM_CONTAINER], found[TO_CONTAINER], mechanism="tcx", programs=count)

    def _template_ids(self) -> dict[int, str]:
        """Program id -> short template hash, for every template pinned under this pin directory."""
        out: dict[int, str] = {}
        root = os.path.join(self.pin_dir, PROGRAMS_DIR)
        for directory in os.listdir(root) if os.path.isdir(root) else []:
            for name in (FROM_CONTAINER, TO_CONTAINER):
                try:
                    fd = obj_get(os.path.join(root, directory, name))
                except BpfError:
                    continue
                try:
                    out[int(prog_info(fd).id)] = directory[:12]
                finally:
                    os.close(fd)
        for template in self._templates.values():
            if template.from_container_fd >= 0:
                for fd in (template.from_container_fd, template.to_container_fd):
                    out[int(prog_info(fd).id)] = template.short
        return out

    # tc: a clsact qdisc with one direct-action bpf filter per hook -------------------

    def _rtnl(self) -> Rtnl:
        if self._nl is None:
            self._nl = Rtnl()
        return self._nl

    def _tc_attach(self, template: Template, ifindex: int) -> None:
        """The qdisc (if not there yet) and both filters, in one send."""
        filters = [
            rtnl.replace_bpf_filter(
                ifindex,
                parent=parent,
                prio=FILTER_PRIO,
                handle=FILTER_HANDLE,
                protocol=ETH_P_ALL,
                prog_fd=template.fd(name),
                name=f"{FILTER_NAME_PREFIX}_{name}_{template.short}",
            )
            for name, _attach_type, parent in HOOKS
        ]
        self._rtnl().request(rtnl.add_clsact(ifindex), *filters)

    def _tc_detach(self, ifindex: int) -> bool:
        """Remove the clsact qdisc (and with it both filters); False if there was none."""
        gone = frozenset({errno.ENODEV, errno.ENOENT, errno.EINVAL})
        (answer,) = self._rtnl().request(rtnl.del_clsact(ifindex, expected=gone))
        return answer.error == 0

    def _tc_attachment(self, ifindex: int) -> Attachment:
        from pyroute2.netlink.exceptions import NetlinkError

        found: dict[str, str | None] = {FROM_CONTAINER: None, TO_CONTAINER: None}
        count = 0
        for name, _attach_type, parent in HOOKS:
            try:
                filters = list(self._iproute().get_filters(index=ifindex, parent=parent))
            except NetlinkError:
                continue
            for flt in filters:
                if flt.get_attr("TCA_KIND") != "bpf":
                    continue
                options = flt.get_attr("TCA_OPTIONS")
                label = options.get_attr("TCA_BPF_NAME") if options is not None else None
                if label and label.startswith(f"{FILTER_NAME_PREFIX}_{name}_"):
                    count += 1
                    found[name] = label.rsplit("_", 1)[-1]
        return Attachment(found[FROM_CONTAINER], found[TO_CONTAINER], mechanism="tc", programs=count)

    def close(self) -> None:
        with self._lock:
            for template in self._templates.values():
                template.close()
            self._templates.clear()
            if self._ipr is not None:
                self._ipr.close()
                self._ipr = None
            if self._nl is not None:
                self._nl.close()
                self._nl = None


def program_ids(template: Template) -> tuple[int, int]:
    """Kernel ids of the template's programs (from_container, to_container)."""
    if template.from_container_fd < 0:
        raise BpfError(errno.EBADF, "template is closed")
    return int(prog_info(template.from_container_fd).id), int(prog_info(template.to_container_fd).id)
