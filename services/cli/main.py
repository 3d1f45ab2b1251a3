"""`palisade`: the one command line. Each subcommand lives in its own module here and
exposes ``register(subparsers)``, which adds its parser and sets ``func`` (args -> exit code)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `palisade --help` lists them. A module missing here
# (not yet built) is skipped so the rest of the CLI keeps working.
COMMANDS = (
    "status",
    "policy",
    "identity",
    "endpoint",
    "service",
    "bpf",
    "fqdn",
    "observe",
    "analyze",
    "connectivity",
    "tls",
    "install",
    "version",
    "sysdump",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="palisade",
        description="Palisade: identity-based network policy for Kubernetes pods, enforced with eBPF.",
    )
    parser.add_argument(
        "--version", action="store_true", help="print the CLI's version and every component's (as `palisade version`)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"services.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"services.cli.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version and not getattr(args, "func", None):
        args = parser.parse_args(["version"])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
