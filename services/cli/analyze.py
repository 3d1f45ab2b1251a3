"""``palisade analyze``: run the policy engine offline on manifests and print a matrix."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from services.policy.engine.analyze import AnalyzeError, Document, Probe, ProbeResult, analyze

_YAML_SUFFIXES = (".yaml", ".yml", ".json")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="compute the connectivity matrix of manifests offline",
        description=(
            "Read Namespace, Pod and (Cilium)NetworkPolicy manifests and print, for each "
            "probe, whether each pod may open a connection to each pod."
        ),
    )
    parser.add_argument(
        "-f",
        "--filename",
        dest="paths",
        action="append",
        required=True,
        metavar="PATH",
        help="YAML file or folder (repeatable)",
    )
    parser.add_argument(
        "--probe",
        dest="probes",
        action="append",
        required=True,
        metavar="PORT/PROTO",
        help="port and protocol to probe, e.g. 80/TCP (repeatable)",
    )
    parser.add_argument("-o", "--output", choices=("json", "table"), default="table")
    parser.add_argument(
        "--enforce-self",
        action="store_true",
        help="evaluate pod-to-itself traffic through policy (default: always allowed)",
    )
    parser.set_defaults(func=run)


def _files(path: Path) -> Iterator[Path]:
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file() and child.suffix in _YAML_SUFFIXES:
                yield child
    else:
        yield path


def load_documents(paths: Sequence[str]) -> list[Document]:
    """Read every YAML document of the given files/folders. Raises AnalyzeError."""
    docs: list[Document] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise AnalyzeError(raw, "no such file or directory")
        for file in _files(path):
            try:
                loaded = list(yaml.safe_load_all(file.read_text()))
            except (OSError, UnicodeDecodeError) as err:
                raise AnalyzeError(str(file), f"cannot read: {err}") from None
            except yaml.YAMLError as err:
                raise AnalyzeError(str(file), f"invalid YAML: {err}") from None
            for i, body in enumerate(loaded):
                if body is None:
                    continue
                if not isinstance(body, dict):
                    raise AnalyzeError(f"{file}[{i}]", "document is not a mapping")
                items = body.get("items") if body.get("kind") == "List" else None
                if isinstance(items, list):
                    for j, item in enumerate(items):
                        if isinstance(item, dict):
                            docs.append(Document(f"{file}[{i}].items[{j}]", item))
                    continue
                docs.append(Document(f"{file}[{i}]" if len(loaded) > 1 else str(file), body))
    return docs


def _table(results: Sequence[ProbeResult], out: TextIO) -> None:
    for res in results:
        pods = list(res.matrix)
        out.write(f"Probe {res.probe.port}/{res.probe.protocol.name} (row = source, column = destination)\n")
        width = max([len(p) for p in pods] + [4])
        out.write(" " * width + " | " + " ".join(p.ljust(width) for p in pods) + "\n")
        for src in pods:
            cells = " ".join(("yes" if res.matrix[src][dst] else "-").ljust(width) for dst in pods)
            out.write(src.ljust(width) + " | " + cells + "\n")
        out.write("\n")


def run(args: argparse.Namespace) -> int:
    try:
        probes = [Probe.parse(p) for p in args.probes]
        docs = load_documents(args.paths)
        results, model = analyze(docs, probes, self_traffic_allowed=not args.enforce_self)
    except AnalyzeError as err:
        print(f"palisade analyze: {err}", file=sys.stderr)
        return 2
    for warning in model.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for policy in model.policies:
        for item in policy.unsupported:
            print(f"warning: {policy.key}: unsupported: {item}", file=sys.stderr)
    if args.output == "json":
        payload: dict[str, Any] = {"probes": [r.to_json() for r in results]}
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        _table(results, sys.stdout)
    return 0
