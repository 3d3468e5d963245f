"""The README's private-swarm commands, run as shown (``p2psync`` in-process, real files):
init, identity, admit, a node refused with exit 2 when its membership cannot work, revoke."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

from node.cli import main
from p2p_sync.errors import RevokedMemberError
from p2p_sync.trust.membership import Membership

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[list[str]]:
    """The ``p2psync`` lines of the README's private-swarm block, continuations joined."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A private swarm") :]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S)
    assert block is not None
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("p2psync")]


def test_the_readmes_private_swarm_commands_run_as_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["keygen", "--out", "trainer.key"]) == 0
    init, identity, admit, node, revoke, status = _readme_commands()
    assert status[:2] == ["status", "http://trainer:8700"] and "--admission" in status
    assert main(init) == 0
    capsys.readouterr()
    assert main(identity) == 0
    peer_id = capsys.readouterr().out.strip()
    assert peer_id.startswith("12D3KooW")
    assert main([peer_id if w == "12D3KooW..." else w for w in admit]) == 0
    membership = Membership(
        Path("swarm-ca.pem").read_bytes(), Path("revocations.pem").read_bytes(), 0
    )
    admission = Path("rollout.pem").read_bytes()
    assert membership.check(admission, time.time()).peer_id == peer_id
    assert node[:2] == ["node", "--role"] and "--private" in node
    assert main(revoke) == 0
    membership.update_revocations(Path("revocations.pem").read_bytes(), time.time())
    with pytest.raises(RevokedMemberError):
        membership.check(admission, time.time())


def _node(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "node",
        "--role",
        "rollout",
        "--trust",
        "trainer.key.pub",
        "--swarm",
        "team",
        "--data-dir",
        str(tmp_path / "data"),
        "--listen",
        "127.0.0.1:0",
        "--no-p2p",
        *extra,
    ]


def test_a_private_node_that_cannot_work_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    main(["keygen", "--out", "trainer.key"])
    main(["swarm", "init", "--admin-key", "trainer.key", "--swarm", "team"])
    other = Path("other")
    main(["identity", "--data-dir", str(other)])
    peer_id = capsys.readouterr().out.strip().splitlines()[-1]
    main(["admit", "--admin-key", "trainer.key", "--peer", peer_id, "--out", "other.pem"])
    files = ["--swarm-ca", "swarm-ca.pem", "--revocations", "revocations.pem"]
    cases = {
        "needs admission": _node(tmp_path, "--private", *files),
        "admits another identity": _node(tmp_path, "--private", *files, "--admission", "other.pem"),
        "No such file": _node(tmp_path, "--private", *files, "--admission", "missing.pem"),
        "private is not set": _node(tmp_path, *files, "--admission", "other.pem"),
    }
    for words, argv in cases.items():
        capsys.readouterr()
        assert main(argv) == 2, words
        err = capsys.readouterr().err
        assert err.startswith("p2psync: error: ") and words in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    for argv in (
        ["admit", "--admin-key", "trainer.key", "--peer", "nope", "--out", "x.pem"],
        ["admit", "--admin-key", "missing.key", "--peer", peer_id, "--out", "x.pem"],
        ["revoke", "--admin-key", "trainer.key", "trainer.key.pub"],
        ["swarm", "init", "--admin-key", "trainer.key"],  # files exist: no --force
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("p2psync: error: ") and err.count("\n") == 1, err
    assert not Path("x.pem").exists()
