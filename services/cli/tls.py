"""`palisade tls init`: create an installation's CA and component certificates (compose, Kubernetes)."""

from __future__ import annotations

import argparse
import sys

from services.cli.client import run
from services.common.trust import COMPONENTS, ensure_pki


@run
def cmd_init(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.component) - set(COMPONENTS))
    if unknown:
        known = ", ".join(COMPONENTS)
        print(f"palisade: error: unknown component(s) {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    root = ensure_pki(args.dir, args.component or COMPONENTS, extra_hosts=args.host)
    print(f"certificates in {root}: {', '.join(sorted(p.name for p in root.iterdir()))}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tls", help="certificates of an installation")
    tls_sub = p.add_subparsers(dest="tls_command", metavar="COMMAND", required=True)
    init = tls_sub.add_parser(
        "init",
        help="create the CA and one certificate per component in a directory (idempotent)",
        description="Create the installation's CA (ca.crt, ca.key) and <component>.crt/.key for "
        f"{', '.join(COMPONENTS)} in DIR, owner-only. Existing ones are kept; a new CA reissues all.",
    )
    init.add_argument("--dir", required=True, help="directory to create them in (made owner-only)")
    init.add_argument("--host", action="append", default=[], help="extra name or address in every certificate")
    init.add_argument("--component", action="append", default=[], help="only these components (repeatable)")
    init.set_defaults(func=cmd_init)
