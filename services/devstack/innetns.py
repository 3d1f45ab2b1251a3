"""Run a Python module inside a network namespace: ``python -m services.devstack.innetns NETNS MODULE ARGS...``.

The namespace is joined first, in a fresh process, before any thread or socket
exists; then the module runs as ``python -m MODULE ARGS...`` would. This is how a dev
node's datapath runs on its own "host".
"""

from __future__ import annotations

import runpy
import sys

from services.devstack.netnsexec import enter


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m services.devstack.innetns NETNS MODULE [ARGS...]")
    netns, module, *args = argv
    enter(netns)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
