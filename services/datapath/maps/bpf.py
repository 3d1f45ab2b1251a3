"""Pinned BPF maps through libbpf (``libbpf.so.1``, a dependency of Debian's bcc) via ctypes.

The agent creates and pins every map itself (as Cilium's agent does), so a
restarted process, or one that reuses pinned programs without compiling, opens
them by path; the program source only refers to the pins. ``libbpf`` is loaded
on first use so importing this module needs neither root nor libbpf.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import os
import threading
from collections.abc import Iterator
from enum import IntEnum
from typing import Any, TypeVar

#: statfs f_type of a bpf filesystem.
BPF_FS_MAGIC = 0xCAFE4A11
BPF_ANY = 0
BPF_NOEXIST = 1
BPF_F_NO_PREALLOC = 1

S = TypeVar("S", bound=ctypes.Structure)


class MapType(IntEnum):
    HASH = 1
    ARRAY = 2
    PROG_ARRAY = 3
    PERCPU_HASH = 5
    PERCPU_ARRAY = 6
    LRU_HASH = 9
    LPM_TRIE = 11
    RINGBUF = 27


class BpfError(OSError):
    """A bpf(2) operation failed."""


class MapLayoutError(BpfError):
    """A pinned map exists but its type or sizes differ from what this code expects."""


@dataclasses.dataclass(frozen=True)
class MapSpec:
    """How to create one map; the pinned name is ``name`` under the pin directory."""

    name: str
    type: MapType
    key_size: int
    value_size: int
    max_entries: int
    flags: int = 0


class _CreateOpts(ctypes.Structure):
    # struct bpf_map_create_opts (libbpf 1.x, bpf.h)
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("btf_fd", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("map_extra", ctypes.c_uint64),
        ("numa_node", ctypes.c_uint32),
        ("map_ifindex", ctypes.c_uint32),
    ]


class MapInfo(ctypes.Structure):
    # The head of struct bpf_map_info (uapi/linux/bpf.h); the kernel fills what fits.
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


class ProgInfo(ctypes.Structure):
    # The head of struct bpf_prog_info (uapi/linux/bpf.h), up to the run counters.
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
        ("_middle", ctypes.c_uint8 * 112),
        # Kernel-accounted run time and count (while BPF_ENABLE_STATS is on).
        ("run_time_ns", ctypes.c_uint64),
        ("run_cnt", ctypes.c_uint64),
    ]


class LinkInfo(ctypes.Structure):
    # The head of struct bpf_link_info with its tcx member (the union is 8-byte aligned).
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("tcx_ifindex", ctypes.c_uint32),
        ("tcx_attach_type", ctypes.c_uint32),
    ]


#: enum bpf_attach_type: the tc hooks as BPF links (tcx, kernel 6.6+).
BPF_TCX_INGRESS = 46
BPF_TCX_EGRESS = 47


_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

#: Signature of libbpf's ring_buffer_sample_fn.
RingBufferCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class _TestRunOpts(ctypes.Structure):
    # struct bpf_test_run_opts (libbpf 1.x, bpf.h)
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


def libbpf() -> ctypes.CDLL:
    """The libbpf shared library with the prototypes Palisade uses."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        lib = ctypes.CDLL(name, use_errno=True)
        c_int, c_void_p, c_char_p, c_u32, c_u64 = (
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_uint32,
            ctypes.c_uint64,
        )
        protos: dict[str, tuple[Any, list[Any]]] = {
            "bpf_map_create": (c_int, [c_int, c_char_p, c_u32, c_u32, c_u32, ctypes.POINTER(_CreateOpts)]),
            "bpf_obj_pin": (c_int, [c_int, c_char_p]),
            "bpf_obj_get": (c_int, [c_char_p]),
            "bpf_map_update_elem": (c_int, [c_int, c_void_p, c_void_p, c_u64]),
            "bpf_map_lookup_elem": (c_int, [c_int, c_void_p, c_void_p]),
            "bpf_map_delete_elem": (c_int, [c_int, c_void_p]),
            "bpf_map_get_next_key": (c_int, [c_int, c_void_p, c_void_p]),
            "bpf_obj_get_info_by_fd": (c_int, [c_int, c_void_p, ctypes.POINTER(c_u32)]),
            "libbpf_num_possible_cpus": (c_int, []),
            "bpf_prog_test_run_opts": (c_int, [c_int, ctypes.POINTER(_TestRunOpts)]),
            "bpf_link_create": (c_int, [c_int, c_int, c_int, c_void_p]),
            "bpf_link_update": (c_int, [c_int, c_int, c_void_p]),
            "bpf_link_detach": (c_int, [c_int]),
            "bpf_prog_get_fd_by_id": (c_int, [c_u32]),
            "bpf_prog_query": (
                c_int,
                [c_int, c_int, c_u32, ctypes.POINTER(c_u32), ctypes.POINTER(c_u32), ctypes.POINTER(c_u32)],
            ),
            "ring_buffer__new": (c_void_p, [c_int, RingBufferCallback, c_void_p, c_void_p]),
            "ring_buffer__poll": (c_int, [c_void_p, c_int]),
            "ring_buffer__consume": (c_int, [c_void_p]),
            "ring_buffer__free": (None, [c_void_p]),
        }
        for fn_name, (restype, argtypes) in protos.items():
            fn = getattr(lib, fn_name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = lib
        return lib


def check(ret: int, what: str, path: str = "") -> int:
    """Raise BpfError for a negative libbpf return (libbpf 1.x returns -errno)."""
    if ret < 0:
        code = -ret
        raise BpfError(code, f"{what}: {os.strerror(code)}", path or None)
    return ret


def obj_get(path: str) -> int:
    """An fd for a pinned map or program."""
    return check(libbpf().bpf_obj_get(path.encode()), "bpf_obj_get", path)


def obj_pin(fd: int, path: str) -> None:
    check(libbpf().bpf_obj_pin(fd, path.encode()), "bpf_obj_pin", path)


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    check(libbpf().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "map info")
    return info


def prog_info(fd: int) -> ProgInfo:
    info = ProgInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    check(libbpf().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "prog info")
    return info


def prog_info_by_id(prog_id: int) -> ProgInfo | None:
    """The info of a loaded program by id; None if it was unloaded meanwhile."""
    fd = libbpf().bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:
        return None
    try:
        return prog_info(fd)
    finally:
        os.close(fd)


def link_create(prog_fd: int, ifindex: int, attach_type: int) -> int:
    """Attach a program to a tc hook of ``ifindex`` as a BPF link (tcx); the link's fd."""
    return check(libbpf().bpf_link_create(prog_fd, ifindex, attach_type, None), "bpf_link_create")


def link_update(link_fd: int, prog_fd: int) -> None:
    """Swap the link's program atomically (no moment without one)."""
    check(libbpf().bpf_link_update(link_fd, prog_fd, None), "bpf_link_update")


def link_detach(link_fd: int) -> None:
    check(libbpf().bpf_link_detach(link_fd), "bpf_link_detach")


def link_info(fd: int) -> LinkInfo:
    info = LinkInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    check(libbpf().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "link info")
    return info


def prog_query(ifindex: int, attach_type: int, capacity: int = 64) -> list[int]:
    """Ids of the programs attached to a hook of ``ifindex``, in run order."""
    ids = (ctypes.c_uint32 * capacity)()
    count = ctypes.c_uint32(capacity)
    flags = ctypes.c_uint32(0)
    check(
        libbpf().bpf_prog_query(ifindex, attach_type, 0, ctypes.byref(flags), ids, ctypes.byref(count)),
        "bpf_prog_query",
    )
    return list(ids[: count.value])


#: sizeof(struct __sk_buff) and the offset of its ``ifindex``, the one context field set.
_SK_BUFF_SIZE = 192
_SK_BUFF_IFINDEX = 40


def prog_test_run(fd: int, frame: bytes, ifindex: int, repeat: int) -> tuple[int, int]:
    """Run a tc program ``repeat`` times on one Ethernet frame arriving on ``ifindex``
    (BPF_PROG_TEST_RUN): its return code and the mean nanoseconds per run."""
    code, ns, _ = _test_run(fd, frame, ifindex, repeat)
    return code, ns


def prog_test_run_frame(fd: int, frame: bytes, ifindex: int) -> tuple[int, bytes]:
    """Run a tc program once on one Ethernet frame arriving on ``ifindex``: its return code and the
    frame as the program left it."""
    code, _, out = _test_run(fd, frame, ifindex, 1)
    return code, out


def _test_run(fd: int, frame: bytes, ifindex: int, repeat: int) -> tuple[int, int, bytes]:
    ctx = ctypes.create_string_buffer(_SK_BUFF_SIZE)
    ctypes.c_uint32.from_buffer(ctx, _SK_BUFF_IFINDEX).value = ifindex
    data = ctypes.create_string_buffer(frame, len(frame))
    out = ctypes.create_string_buffer(len(frame) + 256)
    opts = _TestRunOpts(
        sz=ctypes.sizeof(_TestRunOpts),
        data_in=ctypes.cast(data, ctypes.c_void_p),
        data_out=ctypes.cast(out, ctypes.c_void_p),
        data_size_in=len(frame),
        data_size_out=len(out),
        ctx_in=ctypes.cast(ctx, ctypes.c_void_p),
        ctx_size_in=_SK_BUFF_SIZE,
        repeat=repeat,
    )
    check(libbpf().bpf_prog_test_run_opts(fd, ctypes.byref(opts)), "prog test run")
    return int(opts.retval), int(opts.duration), out.raw[: opts.data_size_out]


def possible_cpus() -> int:
    return check(libbpf().libbpf_num_possible_cpus(), "possible cpus")


def is_bpffs(path: str) -> bool:
    """Whether ``path`` (an existing directory) lives on a bpf filesystem."""
    return _statfs_type(path) == BPF_FS_MAGIC


class _Statfs(ctypes.Structure):
    # struct statfs (x86_64 and arm64 share this layout); only f_type is read.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def _statfs_type(path: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = _Statfs()
    if libc.statfs(path.encode(), ctypes.byref(buf)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(buf.f_type) & 0xFFFFFFFF


def mount_bpffs(target: str) -> None:
    """``mount -t bpf bpf <target>``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    if libc.mount(b"bpf", target.encode(), b"bpf", 0, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount bpffs: {os.strerror(code)}", target)


def ensure_bpffs(base_dir: str, mountpoint: str = "/sys/fs/bpf") -> None:
    """Make ``base_dir`` a directory on a bpf filesystem, mounting bpffs at ``mountpoint`` if needed."""
    base = os.path.abspath(base_dir)
    probe = base
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    if not is_bpffs(probe):
        inside = os.path.commonpath([base, mountpoint]) == mountpoint
        if not inside:
            raise BpfError(errno.EINVAL, "pin directory is not on a bpf filesystem", base)
        os.makedirs(mountpoint, exist_ok=True)
        if not is_bpffs(mountpoint):
            mount_bpffs(mountpoint)
    os.makedirs(base, exist_ok=True)


class PinnedMap:
    """One pinned map, opened (or created and pinned) by path."""

    def __init__(self, fd: int, spec: MapSpec, path: str) -> None:
        self.fd = fd
        self.spec = spec
        self.path = path
        info = map_info(fd)
        self.id = int(info.id)
        self._ncpus = possible_cpus() if spec.type in (MapType.PERCPU_HASH, MapType.PERCPU_ARRAY) else 1

    @classmethod
    def open_or_create(cls, directory: str, spec: MapSpec) -> PinnedMap:
        """Reuse the pin at ``directory/spec.name`` if its layout matches, else create and pin the map."""
        path = os.path.join(directory, spec.name)
        if os.path.exists(path):
            return cls.open(directory, spec)
        opts = _CreateOpts(sz=ctypes.sizeof(_CreateOpts), map_flags=spec.flags)
        fd = check(
            libbpf().bpf_map_create(
                int(spec.type), spec.name[:15].encode(), spec.key_size, spec.value_size, spec.max_entries, opts
            ),
            "bpf_map_create",
            path,
        )
        try:
            obj_pin(fd, path)
        except BpfError as exc:
            os.close(fd)
            if exc.errno == errno.EEXIST:  # pinned concurrently: use theirs
                return cls.open(directory, spec)
            raise
        return cls(fd, spec, path)

    @classmethod
    def open(cls, directory: str, spec: MapSpec) -> PinnedMap:
        """Open an existing pin and check its layout."""
        path = os.path.join(directory, spec.name)
        fd = obj_get(path)
        info = map_info(fd)
        want = (int(spec.type), spec.key_size, spec.value_size, spec.max_entries, spec.flags)
        have = (int(info.type), int(info.key_size), int(info.value_size), int(info.max_entries), int(info.map_flags))
        if have != want:
            os.close(fd)
            raise MapLayoutError(
                errno.EINVAL,
                f"pinned map layout (type, key, value, max, flags) is {have}, expected {want}; "
                "tear the datapath down to recreate it",
                path,
            )
        return cls(fd, spec, path)

    @classmethod
    def open_any(cls, directory: str, name: str) -> PinnedMap:
        """Open a pin whatever its size (for cleanup); the spec is read from the kernel."""
        path = os.path.join(directory, name)
        fd = obj_get(path)
        info = map_info(fd)
        spec = MapSpec(
            name,
            MapType(int(info.type)),
            int(info.key_size),
            int(info.value_size),
            int(info.max_entries),
            int(info.map_flags),
        )
        return cls(fd, spec, path)

    @property
    def ncpus(self) -> int:
        """Values per key: the possible CPUs for a per-CPU map, else 1."""
        return self._ncpus

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _value_buffer(self) -> ctypes.Array[ctypes.c_char]:
        # Per-CPU maps read one 8-byte-aligned slot per possible CPU.
        slot = (self.spec.value_size + 7) & ~7
        return ctypes.create_string_buffer(slot * self._ncpus if self._ncpus > 1 else self.spec.value_size)

    def lookup_raw(self, key: ctypes.Structure) -> bytes | None:
        buf = self._value_buffer()
        ret = libbpf().bpf_map_lookup_elem(self.fd, ctypes.byref(key), buf)
        if ret == -errno.ENOENT:
            return None
        check(ret, "lookup", self.path)
        return buf.raw

    def lookup(self, key: ctypes.Structure, value_type: type[S]) -> S | None:
        raw = self.lookup_raw(key)
        return None if raw is None else value_type.from_buffer_copy(raw[: ctypes.sizeof(value_type)])

    def lookup_percpu(self, key: ctypes.Structure, value_type: type[S]) -> list[S]:
        raw = self.lookup_raw(key)
        if raw is None:
            return []
        slot = (ctypes.sizeof(value_type) + 7) & ~7
        return [
            value_type.from_buffer_copy(raw[i * slot : i * slot + ctypes.sizeof(value_type)])
            for i in range(self._ncpus)
        ]

    def update(self, key: ctypes.Structure, value: ctypes.Structure | ctypes.Array[Any], flags: int = BPF_ANY) -> None:
        check(libbpf().bpf_map_update_elem(self.fd, ctypes.byref(key), ctypes.byref(value), flags), "update", self.path)

    def delete(self, key: ctypes.Structure) -> bool:
        """Delete ``key``; False if it was not there."""
        ret = libbpf().bpf_map_delete_elem(self.fd, ctypes.byref(key))
        if ret == -errno.ENOENT:
            return False
        check(ret, "delete", self.path)
        return True

    def keys(self, key_type: type[S]) -> Iterator[S]:
        """Every key; a key deleted meanwhile may end the walk early (the kernel restarts it)."""
        lib = libbpf()
        cur: S | None = None
        while True:
            nxt = key_type()
            ret = lib.bpf_map_get_next_key(self.fd, None if cur is None else ctypes.byref(cur), ctypes.byref(nxt))
            if ret == -errno.ENOENT:
                return
            check(ret, "get_next_key", self.path)
            yield nxt
            cur = nxt

    def items(self, key_type: type[S], value_type: type[Any]) -> Iterator[tuple[S, Any]]:
        for key in list(self.keys(key_type)):
            value = self.lookup(key, value_type)
            if value is not None:  # deleted since the walk
                yield key, value

    def clear(self, key_type: type[ctypes.Structure]) -> int:
        count = 0
        for key in list(self.keys(key_type)):
            count += self.delete(key)
        return count


def unpin(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def c_layout(struct: type[ctypes.Structure], c_name: str) -> list[str]:
    """C11 static asserts that pin the C struct ``c_name`` to this ctypes layout."""
    lines = [
        f'_Static_assert(sizeof(struct {c_name}) == {ctypes.sizeof(struct)}, "size of struct {c_name}");',
    ]
    anonymous = getattr(struct, "_anonymous_", ())
    for field in struct._fields_:
        name = field[0]
        offset = getattr(struct, name).offset
        # An anonymous union (C11): its members are the struct's, at the union's offset.
        kind = field[1]
        if name in anonymous and issubclass(kind, ctypes.Union):
            members = [(m[0], offset) for m in kind._fields_]
        else:
            members = [(name, offset)]
        for member, at in members:
            lines.append(
                f'_Static_assert(__builtin_offsetof(struct {c_name}, {member}) == {at}, "offset of {c_name}.{member}");'
            )
    return lines
