"""Whether a toFQDNs/DNS selector matches a name. Pure.

Stand-in for the policy engine's ``services/policy/engine/fqdn.py`` (``match``), which
the datapath must use once it is on main; this copy follows the same contract (the
``FqdnRule.selector`` comment in common.proto) so the two agree until then.

Selectors and names are lower-case without a trailing dot. ``*`` alone matches every
name; a ``*`` inside a label matches any run of the characters allowed in a label
(letters, digits, ``-`` and ``_``), never a dot, as Cilium's ``matchPattern``.
"""

from __future__ import annotations

import functools
import re

_LABEL_CHARS = "[-a-z0-9_]"


def normalize(name: str) -> str:
    """A name as selectors see it: lower-case, no trailing dot."""
    return name.lower().rstrip(".")


@functools.lru_cache(maxsize=4096)
def _compile(selector: str) -> re.Pattern[str]:
    parts = (re.escape(p) for p in selector.split("*"))
    return re.compile(f"{_LABEL_CHARS}*".join(parts))


def match(selector: str, name: str) -> bool:
    """True when ``selector`` (an exact name or a pattern) matches ``name``."""
    name = normalize(name)
    if selector == "*":
        return bool(name)
    if "*" not in selector:
        return selector == name
    return _compile(selector).fullmatch(name) is not None


def any_match(selectors: tuple[str, ...] | list[str], name: str) -> bool:
    return any(match(s, name) for s in selectors)
