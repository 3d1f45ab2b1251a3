"""`palisade tls init`: create an installation's CA and component certificates (compose, Kubernetes)."""

from __future__ import annotations

import argparse
import sys

from services.cli.client import run
from services.common.trust import COMPONENTS, Owner, TrustError, ensure_pki, write_bundle


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


@run
def cmd_bundle(args: argparse.Namespace) -> int:
    unknown = sorted({args.component, *args.extra} - set(COMPONENTS))
    if unknown:
        known = ", ".join(COMPONENTS)
        print(f"palisade: error: unknown component(s) {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    try:
        owner = Owner.parse(args.owner)
    except ValueError as exc:
        print(f"palisade: error: --owner: {exc}", file=sys.stderr)
        return 2
    try:
        to = args.to or f"{args.dir}/{args.component}"
        dest = write_bundle(args.dir, args.component, to, owner, extra=args.extra)
    except (TrustError, OSError) as exc:
        print(f"palisade: error: {exc}", file=sys.stderr)
        return 1
    files = ", ".join(sorted(p.name for p in dest.iterdir()))
    print(f"{args.component} bundle in {dest} for {owner.uid}:{owner.gid}: {files}")
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
    bundle = tls_sub.add_parser(
        "bundle",
        help="copy one component's certificate and key, with ca.crt, into a directory of its own",
        description="What one container mounts: ca.crt, <component>.crt and <component>.key from DIR "
        "in TO (default DIR/<component>), owned by OWNER and readable by it only, and no other key.",
    )
    bundle.add_argument("--dir", required=True, help="the directory `palisade tls init` wrote")
    bundle.add_argument("--component", required=True, help="whose certificate and key")
    bundle.add_argument("--owner", required=True, help="numeric UID[:GID] the component runs as")
    bundle.add_argument("--to", help="the bundle's directory (default DIR/<component>)")
    bundle.add_argument(
        "--extra", action="append", default=[], help="also this component's pair (e.g. for a health check)"
    )
    bundle.set_defaults(func=cmd_bundle)
