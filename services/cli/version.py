"""`palisade version` (and `palisade --version`): the CLI's version and every component's.

Each service (every replica, every node's datapath) reports its package version in its
status; a component that does not answer is listed as unreachable, never left out.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from services import __version__
from services.cli.client import (
    SERVICES,
    CLIError,
    add_address_flags,
    add_output_flag,
    address,
    credentials,
    print_json,
    run,
)
from services.cli.client import print_table as table
from services.cli.status import probe


@dataclass(frozen=True)
class ComponentVersion:
    component: str
    address: str
    node: str
    version: str
    #: "" when it answered; else what went wrong ("unreachable").
    error: str = ""


def collect(args: argparse.Namespace) -> list[ComponentVersion]:
    """The CLI's version, then every replica's and node's, as they report it."""
    out = [ComponentVersion("cli", "", "", __version__)]
    try:
        creds = credentials(args)
    except CLIError as exc:
        # The CLI's own version is known all the same; the components say why theirs is not.
        for name in SERVICES:
            targets = [t.strip() for t in address(args, name).split(",")]
            out += [ComponentVersion(name, t, "", "", f"not asked: {exc}") for t in targets]
        return out
    for name in SERVICES:
        for target in (t.strip() for t in address(args, name).split(",")):
            health, status = probe(target, name, creds)
            if status is None:
                out.append(ComponentVersion(name, target, "", "", health))
            else:
                out.append(ComponentVersion(name, target, status.node, status.version))
    return out


@run
def cmd_version(args: argparse.Namespace) -> int:
    versions = collect(args)
    if args.output == "json":
        print_json({"versions": [asdict(v) for v in versions]})
    else:
        table(
            ("COMPONENT", "ADDRESS", "NODE", "VERSION"),
            [(v.component, v.address, v.node, v.version or v.error.partition(":")[0]) for v in versions],
        )
        for error in dict.fromkeys(v.error for v in versions if ":" in v.error):
            print(f"\n{error.partition(': ')[2]}")
        skew = sorted({v.version for v in versions if v.version} - {__version__})
        if skew:
            print(f"\nversions differ from the CLI's ({__version__}): {', '.join(skew)}")
    return 1 if any(v.error for v in versions) else 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("version", help="the CLI's version and every component's")
    add_address_flags(p)
    add_output_flag(p)
    p.set_defaults(func=cmd_version)
