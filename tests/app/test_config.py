"""A node's config as a user writes it: a bad field is named, the shipped examples load, flags
override one field of a section, and the CLI says a bad config in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.cli import main
from p2p_sync.runtime.config import ConfigError, NodeConfig
from p2p_sync.runtime.configfile import load
from simulations.localswarm import ROOT


@pytest.mark.parametrize(
    ("toml", "flags", "message"),
    [
        ("colour = 'blue'\n", {}, "colour: unknown setting"),
        ("role = 'rollout'\ntrust = ['k']\npeers = ['ftp://x']\n", {}, "peers:"),
        ("role = 'rollout'\n", {}, "trust:"),
        ("role = 'trainer'\n", {}, "key:"),
        ("role = 'boss'\n", {}, "role:"),
        ("role = 'rollout'\ntrust = ['k']\nlisten = 'nope'\n", {}, "listen:"),
        ("role = 'rollout'\ntrust = ['k']\n[publish]\nchunk_size = 10\n", {}, "publish: chunk"),
        (
            "role = 'rollout'\ntrust = ['k']\n[publish]\nseed_quiet_factor = -1\n",
            {},
            "publish: seed_quiet_factor must be >= 0",
        ),
        (
            "role = 'rollout'\ntrust = ['k']\n[directory]\npoll_interval_s = 'x'\n",
            {},
            "directory.p",
        ),
        (
            "role = 'rollout'\ntrust = ['k']\n[download]\nmax_requests_total = 0\n",
            {},
            "total: must",
        ),
        ("role = 'rollout'\ntrust = ['k']\n[download]\nwarp = 9\n", {}, "download.warp: unknown"),
        ("role = 'rollout'\ntrust = ['k']\ndownload = 3\n", {}, "download: expected a table"),
        ("role = 'rollout'\ntrust = ['k']\nstore_max_gb = 2\n", {}, r"max_gb in the \[store\]"),
        ("role = 'rollout'\ntrust = ['k']\n", {"store.max_gb": -1.0}, "store.max_gb: must be pos"),
        ("role = 'rollout'\ntrust = ['k']\nworkers = -1\n", {}, "workers: -1 must be >= 0"),
        ("role = 'rollout'\ntrust = ['k']\nworkers = 'x'\n", {}, "workers: expected int"),
        (
            "role = 'rollout'\ntrust = ['k']\n[http]\ntcp_congestion = 'warp'\n",
            {},
            "http.tcp_congestion: 'warp' is not offered by this kernel",
        ),
        ("role = [\n", {}, "not valid TOML"),
        ("role = 'trainer'\nkey = 'k'\n", {"role": "rollout"}, "trust:"),  # flags override
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, toml: str, flags: dict, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load(path, flags)


def test_example_configs_load() -> None:
    for name in ("trainer", "rollout", "bootstrap"):
        cfg = load(ROOT / "configs" / f"{name}.toml", {})
        assert cfg.role == name
    assert load(ROOT / "configs" / "bootstrap.toml", {}).libp2p.max_connections == 64


def test_sections_come_from_the_file_and_flags_override_one_field(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("role = 'rollout'\ntrust = ['k']\n[download]\nmax_requests_total = 9\n")
    cfg = load(path, {"download.stall_timeout_s": 4, "publish.catchup_spans": "2,8"})
    assert cfg.download.max_requests_total == 9 and cfg.download.stall_timeout_s == 4.0
    assert cfg.publish.catchup_spans == (2, 8)
    assert cfg.download.min_requests_per_peer == NodeConfig().download.min_requests_per_peer


def test_cli_bad_config_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    assert main(["node", "--role", "rollout", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2psync: error: config: trust:") and err.count("\n") == 1
    assert main(["status", "http://127.0.0.1:9"]) == 1
    assert "no status" in capsys.readouterr().err
