"""``palisade analyze``: run the policy engine offline on manifests and print a matrix."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from services.common.manifests import Document, DocumentError, split_documents
from services.policy.engine.analyze import AnalyzeError, DnsTable, Probe, ProbeResult, analyze

_YAML_SUFFIXES = (".yaml", ".yml", ".json")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="compute the connectivity matrix of manifests offline",
        description=(
            "Read Namespace, Pod and (Cilium)NetworkPolicy manifests and print, for each "
            "probe, whether each pod may open a connection to each pod. With --dns, also whether "
            "each pod may reach each name of the table (toFQDNs and DNS rules judged as the node "
            "judges them: an address is allowed by its own identity, or by a toFQDNs rule selecting "
            "the name on the probe's port when the pod's DNS rules let it resolve the name)."
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
    parser.add_argument(
        "--dns",
        dest="dns",
        action="append",
        default=[],
        metavar="NAME=IP[,IP...]",
        help=(
            "what a DNS name resolves to (repeatable), e.g. --dns api.example.test=192.0.2.10; the JSON "
            "output then has names[src][name] per probe: may src connect to every address of name"
        ),
    )
    parser.add_argument("-o", "--output", choices=("json", "table"), default="table")
    parser.add_argument(
        "--enforce-self",
        action="store_true",
        help="evaluate pod-to-itself traffic through policy (default: always allowed)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="report an invalid policy and analyze the rest without it (exit status 1) instead of stopping",
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
    """Every object in the given files/folders (``kind: List`` items included). Raises AnalyzeError."""
    docs: list[Document] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise AnalyzeError(raw, "no such file or directory")
        for file in _files(path):
            try:
                text = file.read_text()
            except (OSError, UnicodeDecodeError) as err:
                raise AnalyzeError(str(file), f"cannot read: {err}") from None
            try:
                docs += split_documents(text, str(file), json_file=file.suffix == ".json")
            except DocumentError as err:
                raise AnalyzeError("", err.message) from None
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
        if res.names:
            names = list(next(iter(res.names.values())))
            out.write(f"Names on {res.probe.port}/{res.probe.protocol.name} (row = source pod, column = name)\n")
            src_width = max([len(p) for p in res.names] + [4])
            widths = [max(len(n), 3) for n in names]
            out.write(" " * src_width + " | " + " ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)) + "\n")
            for src, row in res.names.items():
                cells = " ".join(("yes" if row[n] else "-").ljust(w) for n, w in zip(names, widths, strict=True))
                out.write(src.ljust(src_width) + " | " + cells + "\n")
            out.write("\n")


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 analyzed; 1 analyzed without the invalid policies (``--keep-going``); 2 bad input."""
    try:
        probes = [Probe.parse(p) for p in args.probes]
        table = DnsTable.parse(args.dns)
        docs = load_documents(args.paths)
        results, model = analyze(
            docs, probes, self_traffic_allowed=not args.enforce_self, keep_going=args.keep_going, dns=table
        )
    except AnalyzeError as err:
        print(f"palisade analyze: {err}", file=sys.stderr)
        return 2
    for warning in model.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for policy in model.policies:
        for item in policy.unsupported:
            print(f"warning: {policy.key}: unsupported, not enforced: {item}", file=sys.stderr)
    for error in model.invalid:
        print(f"palisade analyze: {error} (left out: the matrix is computed without it)", file=sys.stderr)
    paths = " ".join(args.paths)
    if not model.pods:
        print(
            f"palisade analyze: no Pod objects in {paths}: there is no matrix to compute; "
            "add the pods (kind: Pod, with metadata.labels) to the input",
            file=sys.stderr,
        )
        return 2
    if not model.policies:
        print(
            f"palisade analyze: note: no valid NetworkPolicy, CiliumNetworkPolicy or CiliumClusterwideNetworkPolicy "
            f"in {paths}: every connection is allowed",
            file=sys.stderr,
        )
    if args.output == "json":
        payload: dict[str, Any] = {"probes": [r.to_json() for r in results]}
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        _table(results, sys.stdout)
    return 1 if model.invalid else 0
