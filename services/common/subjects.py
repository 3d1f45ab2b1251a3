"""Every NATS subject Palisade uses, and every filter over them, in one place.

Layout (one token per name; :func:`token` makes a name or address one token)::

    palisade.k8s.<kind>.<namespace>.<name>   K8sDelta, one per object ("_" for no namespace)
    palisade.k8s.synced                      SyncedMarker: the watcher has listed every kind
    palisade.k8s.status.<source>             SourceStatus of a watcher source
    palisade.identity.<number>               IdentityUpdate
    palisade.ipcache.<prefix>                IpcacheEntry ("/" of the prefix written "_")
    palisade.regen.<node>                    RegenerationOrder for one node

``<kind>`` is the lower-case kind (``pod``, ``networkpolicy``, ...). Filters end in
``>`` (every subject below). Pure: no I/O; :mod:`services.common.bus` does the rest.
"""

from __future__ import annotations

K8S_PREFIX = "palisade.k8s."
IDENTITY_PREFIX = "palisade.identity."
IPCACHE_PREFIX = "palisade.ipcache."
REGEN_PREFIX = "palisade.regen."

#: The watcher's marker: every object of every watched kind is on the stream before it.
SYNCED_SUBJECT = K8S_PREFIX + "synced"
#: Followed by a source's token: that watcher source's status.
STATUS_SUBJECT_PREFIX = K8S_PREFIX + "status."

#: Every identity, every ipcache entry, every node's orders.
IDENTITY_ALL = IDENTITY_PREFIX + ">"
IPCACHE_ALL = IPCACHE_PREFIX + ">"
REGEN_ALL = REGEN_PREFIX + ">"


def token(value: str) -> str:
    """One subject token for a name or address (dots are not allowed inside a token)."""
    if not value:
        return "_"
    return value.replace(".", "_").replace(" ", "_").replace("*", "_").replace(">", "_")


def k8s_subject(kind_token: str, namespace: str, name: str) -> str:
    return f"{K8S_PREFIX}{kind_token}.{token(namespace)}.{token(name)}"


def k8s_filter(kind_token: str | None = None) -> str:
    """Every object of one kind, or (no kind) everything on the k8s stream, marker and status included."""
    return f"{K8S_PREFIX}{kind_token}.>" if kind_token else K8S_PREFIX + ">"


def k8s_object_kind(subject: str) -> str | None:
    """The kind token of an object subject; None for the synced marker, statuses and foreign subjects."""
    parts = subject.split(".")
    if len(parts) != 5 or f"{parts[0]}.{parts[1]}." != K8S_PREFIX:
        return None
    return parts[2]


def status_subject(status_token: str) -> str:
    return STATUS_SUBJECT_PREFIX + token(status_token)


def identity_subject(identity: int) -> str:
    return f"{IDENTITY_PREFIX}{identity}"


def ipcache_subject(prefix: str) -> str:
    return IPCACHE_PREFIX + token(prefix.replace("/", "_"))


def regen_subject(node: str) -> str:
    return REGEN_PREFIX + token(node)
