"""Split YAML/JSON text into Kubernetes objects: the one rule every service and the CLI use.

A text holds one or more documents (YAML ``---`` separated; JSON is one document).
Empty documents are skipped. A document that is a ``kind: *List`` object with an
``items`` array (``List``, ``PodList``, ``CiliumNetworkPolicyList``, ...) stands
for its items, and so does a document that is an array; every object that comes
out must be a mapping. Nothing else is interpreted here: whether an object has a
kind, a name or a known API is for the caller to say.

Each object is labelled with where it came from, for messages:
``origin`` alone for a text with one document, ``origin[i]`` for document ``i``
(from 0, empty documents not counted) of several, then ``.items[j]`` for an item
of a List and ``[j]`` for an item of an array.

Deeply nested documents are refused (more than :data:`MAX_DEPTH` levels, or
deeper than the parser can go): no manifest needs them, and the recursive code
that handles objects downstream (dumping, converting) would fail on them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from services.common.errors import Code, PalisadeError

#: Deepest nesting of mappings and arrays accepted in a document; real manifests stay far below.
MAX_DEPTH = 100

#: Nesting refused before any object is built (the depth above is checked per document after).
#: Below libyaml's own limit (1000 in 0.2.5), so the message is the same whichever libyaml is installed.
PARSER_DEPTH = 500

# libyaml's C loader when PyYAML has it: a 5 MB file loads in seconds instead of tens of seconds.
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TOO_DEEP = "document nested too deeply"


class DocumentError(PalisadeError, ValueError):
    """The text does not hold Kubernetes objects; the message names the origin and the document."""

    code = Code.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class Document:
    """One object and where it came from (``file[1].items[0]``)."""

    source: str
    body: Mapping[str, Any]


def split_documents(text: str, origin: str, *, json_file: bool = False) -> list[Document]:
    """The objects of ``text`` (see the module docstring); raises :class:`DocumentError`.

    ``json_file`` parses strict JSON; otherwise YAML (which reads JSON too).
    """
    where = origin or "documents"
    loaded = [d for d in _load(text, where, json_file) if d is not None]
    out: list[Document] = []
    for i, doc in enumerate(loaded):
        label = f"{where}[{i}]" if len(loaded) > 1 else where
        _check_depth(doc, label)
        if isinstance(doc, list):
            out.extend(_item(item, f"{label}[{j}]") for j, item in enumerate(doc))
        elif _is_list_kind(doc):
            out.extend(_item(item, f"{label}.items[{j}]") for j, item in enumerate(doc["items"]))
        else:
            out.append(_item(doc, label))
    return out


def _load(text: str, where: str, json_file: bool) -> list[Any]:
    try:
        if json_file:
            return [json.loads(text)]
        at = _too_deep_at(text)
        if at is not None:
            raise DocumentError(f"{where}: {_TOO_DEEP} for the parser (at {at}); flatten it")
        return list(yaml.load_all(text, Loader=_Loader))
    except RecursionError:
        raise DocumentError(f"{where}: {_TOO_DEEP} for the parser; flatten it") from None
    except json.JSONDecodeError as exc:
        raise DocumentError(f"{where}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if "nesting depth" in problem:  # libyaml's own limit, where it has one
            place = at.strip() or "at its start"
            raise DocumentError(f"{where}: {_TOO_DEEP} for the parser ({place}); flatten it") from None
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None:
            problem += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
        raise DocumentError(f"{where}: not valid YAML or JSON{at}: {problem}") from None


def _too_deep_at(text: str) -> str | None:
    """Where ``text`` nests deeper than PARSER_DEPTH, from parser events alone.

    Runs before anything builds objects: libyaml's composer recurses in C and would
    crash the process on a document nested a hundred thousand levels deep.
    """
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > PARSER_DEPTH:
                    mark = event.start_mark
                    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "its start"
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as exc:
        if "nesting depth" in str(getattr(exc, "problem", "")):
            mark = getattr(exc, "problem_mark", None)
            return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "its start"
        return None  # the load that follows reports it with its position
    return None


def _is_list_kind(doc: Any) -> bool:
    if not isinstance(doc, Mapping):
        return False
    kind = doc.get("kind")
    return isinstance(kind, str) and kind.endswith("List") and isinstance(doc.get("items"), list)


def _item(value: Any, label: str) -> Document:
    if not isinstance(value, Mapping):
        raise DocumentError(
            f"{label}: expected an object with apiVersion, kind and metadata, got {type(value).__name__}"
        )
    return Document(label, value)


def _children(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [v for v in value.values() if _is_container(v)]
    return [v for v in value if _is_container(v)]


def _is_container(value: Any) -> bool:
    return isinstance(value, Mapping) or (isinstance(value, Sequence) and not isinstance(value, str | bytes))


def _check_depth(doc: Any, label: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH, and objects that contain themselves (YAML anchors).

    Iterative, and every container is walked once even when YAML aliases share it, so
    neither deep nor alias-bomb documents cost more than their size.
    """
    too_deep = DocumentError(f"{label}: {_TOO_DEEP} (more than {MAX_DEPTH} levels); flatten it")
    if not _is_container(doc):
        return
    heights: dict[int, int] = {}  # container id -> levels at and below it
    path: list[tuple[Any, Iterator[Any]]] = [(doc, iter(_children(doc)))]
    on_path = {id(doc)}
    while path:
        node, pending = path[-1]
        for child in pending:
            if id(child) in on_path:
                raise DocumentError(f"{label}: an object contains itself (a YAML alias to its own anchor)")
            if id(child) in heights:
                if len(path) + heights[id(child)] > MAX_DEPTH:
                    raise too_deep
                continue
            if len(path) + 1 > MAX_DEPTH:
                raise too_deep
            path.append((child, iter(_children(child))))
            on_path.add(id(child))
            break
        else:
            path.pop()
            on_path.discard(id(node))
            heights[id(node)] = 1 + max((heights[id(c)] for c in _children(node)), default=0)
