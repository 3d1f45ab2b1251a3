"""Every command in README.md and deploy/README.md, checked by running it where it can run here.

The commands are read from the documents' ``sh`` blocks (a change to the docs changes what is
checked). Where a command cannot run on this machine (kubectl and kind need a cluster; compose
runs in tests/deploy/test_stack.py; ``make run``/``make test`` are the whole system), what it
names is checked instead: the Makefile target, the files and folders, and the `palisade`
arguments, which the CLI's own parser must accept. The README walkthrough's `palisade`
commands run for real against a `make run` stack serving a copy of examples/. The datapath's
in-cluster recipe (``kubectl exec ds/palisade-datapath -- palisade ...``) runs in the
DaemonSet's container in tests/deploy/test_pod_specs.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.main import build_parser
from testkit.harness import BIN, ROOT
from testkit.stack import SERVICES, Stack, running_stack

DOCS = ("README.md", "deploy/README.md")


def commands(doc: str) -> list[str]:
    """The commands of a document's sh blocks: comments dropped, continuations joined, heredoc bodies skipped."""
    text = (ROOT / doc).read_text()
    out: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        lines = iter(block.splitlines())
        pending = ""
        for raw in lines:
            line = re.sub(r"\s+#.*$", "", raw).strip()
            if not line or line.startswith("#"):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = pending + line, ""
            heredoc = re.search(r"<<'?(\w+)'?", line)
            if heredoc:
                for body in lines:
                    if body.strip() == heredoc.group(1):
                        break
            out.append(line)
    return out


def palisade_args(command: str) -> list[str] | None:
    """The arguments of a `palisade` invocation in ``command`` (after sudo and settings, or kubectl exec's ``--``)."""
    words = shlex.split(re.split(r"&&|\|\||>", command)[0])
    if words and words[0] == "kubectl" and "--" in words:
        words = words[words.index("--") + 1 :]
    while words and (words[0] == "sudo" or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
        words = words[1:]
    if words and (words[0] == "palisade" or words[0].endswith("/bin/palisade")):
        return words[1:]
    return None


ALL = [(doc, c) for doc in DOCS for c in commands(doc)]


def test_the_documents_have_commands() -> None:
    assert len(commands("README.md")) >= 10 and len(commands("deploy/README.md")) >= 30


@pytest.mark.parametrize(("doc", "command"), ALL, ids=[f"{d}:{i}" for i, (d, _) in enumerate(ALL)])
def test_each_command_names_what_exists(doc: str, command: str) -> None:
    """The check that needs no cluster: arguments the CLI accepts, targets, files and folders that exist."""
    args = palisade_args(command)
    if args is not None:
        if "--help" in args or "-h" in args:
            return
        parser = build_parser()
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                parser.parse_args(args)
            except SystemExit as exc:
                assert exc.code == 0, f"{doc}: `{command}`: the CLI refuses it: {err.getvalue()}"
        return
    words = shlex.split(command.replace("<", " ").replace(">", " "))
    if words[0] == "make":
        # make itself judges the targets, variables and options (`make run --cni` is refused).
        result = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{doc}: `{command}`: {result.stderr}"
    for flag in ("-f", "-k", "--config"):
        for i, word in enumerate(words[:-1]):
            target = words[i + 1]
            if word == flag and target != "-" and "/" in target and not target.startswith("palisade-tls/"):
                assert (ROOT / target).exists(), f"{doc}: `{command}`: {target} does not exist"
    if words[0] == "kubectl" and "-k" in words:
        assert (ROOT / words[words.index("-k") + 1] / "kustomization.yaml").exists()


def test_the_cli_is_named_where_a_user_has_it() -> None:
    """A user of a checkout has the CLI in .venv/bin (make setup); `palisade` bare is for the image's
    containers (kubectl exec) or a user who says how they put it on their PATH."""
    bare = [c for c in commands("README.md") if palisade_args(c) is not None and not c.startswith(".venv/bin/")]
    assert bare == []
    for command in commands("deploy/README.md"):
        if command.startswith("sudo "):
            assert ".venv/bin/palisade" in command, command


# ---------------------------------------------------------------------------
# the README walkthrough, run


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("docs"), ROOT / "examples") as s:
        yield s


#: Exit codes the README gives: a DENIED trace exits 1; a diff exits 3 when observed traffic
#: would be newly dropped (which flows the stack saw decides), else 0.
EXPECTED_EXIT = {"policy trace": {1}, "policy diff": {0, 3}}


@pytest.mark.root
@pytest.mark.bcc
def test_the_readme_walkthrough_runs(stack: Stack, tmp_path: Path) -> None:
    ran = 0
    waited: list[str] = []
    for command in commands("README.md"):
        args = palisade_args(command)
        if args is None:
            continue
        # The walkthrough's folder is the stack's copy of examples/.
        args = [str(stack.manifests) if a == "examples" else a for a in args]
        if args[:1] == ["observe"] and ("--follow" in args or not {"--last", "--since"} & set(args)):
            # Live until interrupted: it must stream (not fail) for as long as we watch.
            proc = subprocess.Popen(
                [str(BIN / "palisade"), *args], cwd=ROOT, env=stack_env(stack), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                assert proc.poll() is None, f"`{command}` ended: {proc.stderr.read() if proc.stderr else ''}"
            finally:
                proc.terminate()
                proc.wait(10)
            ran += 1
            continue
        result = subprocess.run(
            [str(BIN / "palisade"), *args], cwd=ROOT, env=stack_env(stack), capture_output=True, text=True, timeout=120
        )
        want = EXPECTED_EXIT.get(" ".join(args[:2]), {0})
        assert result.returncode in want, f"`{command}`: {result.stdout}{result.stderr}"
        if args[:2] == ["policy", "import"] and "--wait" in args:
            # It returned 0: every endpoint the import touched realized its revision in time.
            waited.append(command)
        ran += 1
    assert ran >= 9
    # The rollout's step 2 imports the audited policy and waits for it to be realized.
    assert [c for c in waited if "docs/rollout/db-audit.yaml" in c], "the walkthrough's audit import does not --wait"


def stack_env(stack: Stack) -> dict[str, str]:
    """What `make run` gives the CLI through .run/ (its certificates, its services' addresses), as settings."""
    addresses = {f"PALISADE_{name.upper()}_ADDRESS": stack.address(name) for name in SERVICES}
    return {**os.environ, "PALISADE_TLS_DIR": str(stack.tls_dir), **addresses}
