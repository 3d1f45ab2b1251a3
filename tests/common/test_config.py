"""Typed configuration from flags and PALISADE_* variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.ipam.config import IPAMConfig
from services.watcher.config import WatcherConfig


@pytest.mark.parametrize(
    ("argv", "env", "field", "expected"),
    [
        ([], {}, "node_mask_v4", 24),
        ([], {"PALISADE_NODE_MASK_V4": "26"}, "node_mask_v4", 26),
        (["--node-mask-v4", "25"], {"PALISADE_NODE_MASK_V4": "26"}, "node_mask_v4", 25),
        (["--nats-url", "nats://a:1,nats://b:2"], {}, "nats_url", "nats://a:1,nats://b:2"),
        ([], {"PALISADE_SHUTDOWN_GRACE": "1.5"}, "shutdown_grace", 1.5),
    ],
)
def test_precedence_flag_env_default(argv: list[str], env: dict[str, str], field: str, expected: object) -> None:
    cfg = load_config(IPAMConfig, argv, env)
    assert getattr(cfg, field) == expected


def test_bad_env_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="PALISADE_CONNECT_RETRIES"):
        load_config(IPAMConfig, [], {"PALISADE_CONNECT_RETRIES": "x"})


def test_etcd_endpoints_parsed_and_checked() -> None:
    cfg = load_config(IPAMConfig, ["--etcd-endpoints", "127.0.0.1:2379, http://h:1"], {})
    assert cfg.etcd_endpoint_list() == [("127.0.0.1", 2379), ("h", 1)]
    with pytest.raises(ConfigError, match="not host:port"):
        load_config(IPAMConfig, ["--etcd-endpoints", "nohost"], {}).etcd_endpoint_list()


def test_watcher_backoff_max_below_initial_is_refused(tmp_path: Path) -> None:
    argv = ["--manifests", str(tmp_path), "--backoff-initial", "2", "--backoff-max", "1"]
    with pytest.raises(ConfigError, match=r"--backoff-max \(1.0\) is below --backoff-initial \(2.0\)"):
        load_config(WatcherConfig, argv, {})
