"""DNS names and the selectors of ``toFQDNs`` and DNS rules: validation, normal form, matching. Pure.

One matcher for the whole product: the policy engine validates and normalizes what a policy
writes, ``palisade analyze``/``trace`` and the node's DNS proxy decide with :func:`matches`
whether a name is selected. No I/O and no wire format here, so every service may import it.

A *selector* is the normal form of a ``matchName`` or ``matchPattern``: lower case, no
surrounding white space, no trailing dot. Its semantics follow Cilium's
``pkg/fqdn/matchpattern``:

* ``*`` alone selects every name.
* ``*`` inside a label stands for any run (possibly empty) of the characters a label may hold
  (``[-a-z0-9_]``), never a dot: ``*.example.com`` selects ``api.example.com`` but neither
  ``example.com`` nor ``a.b.example.com``; ``api-*.example.com`` selects ``api-1.example.com``.
* ``**.`` as the first label (Cilium 1.18) stands for one or more whole labels:
  ``**.example.com`` selects ``a.example.com`` and ``a.b.example.com``, not ``example.com``.
* A selector without ``*`` (every ``matchName``) selects exactly that name.

Names compare case-insensitively and with or without their trailing dot (``API.Example.com.``
is ``api.example.com``).
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = [
    "MAX_NAME_LENGTH",
    "FqdnError",
    "matches",
    "normalize",
    "selects_any",
    "validate_name",
    "validate_pattern",
]

#: The longest name DNS can carry, in its text form without the trailing dot.
MAX_NAME_LENGTH = 253
#: The one destination port a node steers to its DNS proxy (the BPF program's pre-check; a DNS rule
#: on another port is allowed at L4, its names neither filtered nor learned, and reported so).
DNS_PORT = 53
#: The longest label.
MAX_LABEL_LENGTH = 63

_LABEL_CHARS = "[-a-z0-9_]"
_NAME_LABEL = re.compile(r"[-a-z0-9_]+")
_PATTERN_LABEL = re.compile(r"[-a-z0-9_*]+")
_MULTI_LABEL = "**"


class FqdnError(ValueError):
    """A name or pattern is not valid; the message says what is wrong and what is allowed."""


def normalize(text: str) -> str:
    """The normal form of a name or pattern: stripped, lower case, without its trailing dot."""
    out = text.strip().lower()
    return out[:-1] if out.endswith(".") and out != "." else out


def _check(text: str, *, what: str, label: re.Pattern[str], allowed: str) -> str:
    name = normalize(text)
    if not name or name == ".":
        raise FqdnError(f"{what} is empty; write a DNS name such as api.example.com")
    if len(name) > MAX_NAME_LENGTH:
        raise FqdnError(f"{what} {text!r} is longer than {MAX_NAME_LENGTH} characters")
    for part in name.split("."):
        if not part:
            raise FqdnError(f"{what} {text!r} has an empty label (two dots in a row, or a leading dot)")
        if not label.fullmatch(part):
            bad = sorted({c for c in part if not re.fullmatch(allowed, c)})
            raise FqdnError(
                f"{what} {text!r} holds {''.join(bad)!r}: only letters, digits, '-', '_' and '.'"
                + (" and '*'" if label is _PATTERN_LABEL else "")
                + " are allowed"
            )
        if len(part) > MAX_LABEL_LENGTH and "*" not in part:
            raise FqdnError(f"{what} {text!r} has a label longer than {MAX_LABEL_LENGTH} characters")
    return name


def validate_name(text: str) -> str:
    """A ``matchName`` (or a name to resolve) in normal form; :class:`FqdnError` when invalid."""
    return _check(text, what="name", label=_NAME_LABEL, allowed=_LABEL_CHARS)


def validate_pattern(text: str) -> str:
    """A ``matchPattern`` in normal form; :class:`FqdnError` when invalid.

    Allowed: ``*`` alone, ``*`` anywhere inside labels, and ``**`` only as the whole first label.
    """
    name = normalize(text)
    if name == "*":
        return name
    if name == _MULTI_LABEL:
        raise FqdnError(f"pattern {text!r}: '**' must be followed by a domain, as in **.example.com")
    first, _, rest = name.partition(".")
    body = rest if first == _MULTI_LABEL else name
    if _MULTI_LABEL in body:
        raise FqdnError(f"pattern {text!r}: '**' is only allowed as the whole first label (**.example.com)")
    _check(body, what="pattern", label=_PATTERN_LABEL, allowed=r"[-a-z0-9_*]")
    return name


@lru_cache(maxsize=4096)
def _regex(selector: str) -> re.Pattern[str]:
    if selector == "*":
        return re.compile(rf"(?:{_LABEL_CHARS}+\.)*{_LABEL_CHARS}+")
    prefix = ""
    body = selector
    if selector.startswith(_MULTI_LABEL + "."):
        prefix = rf"(?:{_LABEL_CHARS}+\.)+"
        body = selector[len(_MULTI_LABEL) + 1 :]
    return re.compile(prefix + _glob(body))


def _glob(body: str) -> str:
    return f"{_LABEL_CHARS}*".join(re.escape(p) for p in body.split("*"))


def matches(selector: str, name: str) -> bool:
    """Whether ``selector`` (normal form, see :func:`validate_pattern`) selects DNS ``name``.

    ``name`` may be in any case and carry its trailing dot; a name that is not a valid DNS name
    is selected by nothing.
    """
    try:
        wanted = validate_name(name)
    except FqdnError:
        return False
    return _regex(selector).fullmatch(wanted) is not None


def selects_any(selectors: tuple[str, ...] | list[str], name: str) -> str | None:
    """The first of ``selectors`` selecting ``name``, or None."""
    for s in selectors:
        if matches(s, name):
            return s
    return None
