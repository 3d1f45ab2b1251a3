"""What a stopped `make run` leaves in its run directory: the logs of the run, nothing else."""

from __future__ import annotations

from pathlib import Path

from services.devstack.__main__ import clear_run_dir


def test_a_stop_keeps_the_logs_and_removes_the_rest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "policy-1.log").write_text("policy-1 exited (1)\n")
    for folder in ("tls", "nats-1", "etcd-1", "datapath"):
        (run / folder).mkdir()
        (run / folder / "data").write_text("x")
    (run / "addresses.json").write_text("{}")
    (run / "nats-1.conf").write_text("")
    clear_run_dir(run)
    assert [p.name for p in run.iterdir()] == ["logs"]
    assert (run / "logs" / "policy-1.log").read_text() == "policy-1 exited (1)\n"
    clear_run_dir(tmp_path / "absent")  # a run that never started: nothing to do
