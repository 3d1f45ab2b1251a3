"""The container engine and the image `make image` builds, for the tests that run them.

The engine is the one `DOCKER_HOST` names when it answers, else the project's own
(scripts/engine.sh: Debian's dockerd on its own data root and socket), started for the
module and stopped after it when this started it. The image is built by `make image`
(scripts/image.sh), which does nothing when an image of the same sources exists.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from testkit.harness import ROOT

PROJECT = "palisade-test"
IMAGE = "palisade:dev"


@dataclass(frozen=True)
class Engine:
    host: str
    started: bool

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0", "COMPOSE_PROJECT_NAME": PROJECT}

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(args, env=self.env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check:
            assert result.returncode == 0, f"{' '.join(args)}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
        return result


def _answers(host: str) -> bool:
    env = {**os.environ, "DOCKER_HOST": host}
    return subprocess.run(["docker", "version"], env=env, capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    given = os.environ.get("DOCKER_HOST")
    if given and _answers(given):
        yield Engine(given, started=False)
        return
    if os.geteuid() != 0:
        pytest.skip(
            "no container engine: DOCKER_HOST is unset or does not answer, and starting the project's "
            "own (scripts/engine.sh) needs root; run `make test` as root"
        )
    own = subprocess.run(["scripts/engine.sh", "host"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    running = _answers(own)
    result = subprocess.run(["scripts/engine.sh", "start"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    try:
        yield Engine(own, started=not running)
    finally:
        if not running:
            subprocess.run(["scripts/engine.sh", "stop"], cwd=ROOT, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    engine.run("bash", "scripts/image.sh", timeout=3000)
    return IMAGE
