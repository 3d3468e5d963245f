"""`p2psync node` as a new user meets it: start-up failures are one line and exit 2, every flag
the docs show exists and says its default, and every command line in the docs parses."""

from __future__ import annotations

import re
import shlex
import socket
from pathlib import Path

import pytest

from node.cli import build_parser, main
from node.node_cmd import add_parsers

ROOT = Path(__file__).resolve().parents[2]
TRUST = ("--trust", "ed25519:" + "00" * 32)


def run(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert err.startswith("p2psync: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(w.lower() in err.lower() for w in words), err


def test_a_port_in_use_is_one_line_and_exit_2(capsys, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, err = run(
            capsys,
            *("node", "--role", "rollout", *TRUST, "--no-p2p"),
            *("--listen", f"127.0.0.1:{port}", "--data-dir", tmp_path / "d"),
        )
    one_line_error(code, err, str(port), "address already in use")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--role", "trainer", "--key", "{tmp}/nokey"], ["nokey"]),
        (["--role", "trainer", "--key", "{tmp}/key", "--watch", "{tmp}/outgoign"], ["outgoign"]),
        (["--role", "rollout", *TRUST, "--peers", "not-a-url"], ["peers", "not-a-url"]),
        (["--role", "rollout", *TRUST, "--data-dir", "{tmp}/afile"], ["afile"]),
    ],
    ids=["missing key", "missing watch dir", "bad peers URL", "data dir is a file"],
)
def test_every_start_up_failure_is_one_line_and_exit_2(
    argv: list[str], words: list[str], capsys, tmp_path: Path
) -> None:
    from p2p_sync.trust.keys import SigningKey, write_keypair

    write_keypair(SigningKey.generate(), tmp_path / "key")
    (tmp_path / "afile").write_text("not a directory")
    filled = [a.format(tmp=tmp_path) for a in argv]
    if "--data-dir" not in filled:
        filled += ["--data-dir", str(tmp_path / "d")]
    code, err = run(capsys, "node", "--no-p2p", *filled)
    one_line_error(code, err, *words)
    assert not (tmp_path / "outgoign").exists()  # a mistyped watch dir is not created


def _node_parser():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    add_parsers(sub)
    return sub.choices["node"]


def test_every_node_flag_has_help_that_shows_its_default() -> None:
    for action in _node_parser()._actions:
        if action.dest == "help":
            continue
        assert action.help and "(default: " in action.help, action.option_strings


# ------------------------------------------------------------- the docs' command lines


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:sh|bash|console|shell)\n(.*?)```", text, flags=re.S)


def _command_lines(block: str) -> list[list[str]]:
    """Each ``p2psync ...`` command of a shell block: continuations joined, the comment and
    the ``...`` that stands for flags shown elsewhere dropped."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line.startswith("p2psync "):
            continue
        words = shlex.split(line, comments=True)[1:]
        commands.append([w for w in words if w != "..."])
    return commands


def _inline(text: str) -> list[str]:
    return re.findall(r"`(p2psync [^`]+|--[a-z][a-z0-9-]*[^`]*)`", text)


def test_every_command_line_in_the_docs_parses_with_the_real_parser() -> None:
    parser = build_parser()
    seen = 0
    for doc in _docs():
        text = doc.read_text()
        inline = [shlex.split(s)[1:] for s in _inline(text) if s.startswith("p2psync ")]
        for argv in [c for b in _shell_blocks(text) for c in _command_lines(b)] + inline:
            if argv[:1] == ["node"] and "--role" not in argv:
                argv = [*argv, "--role", "rollout"]
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                raise AssertionError(f"{doc.name}: p2psync {' '.join(argv)}") from exc
            seen += 1
    assert seen >= 15  # the README's swarm, libp2p, patch and simulate lines at least


def test_every_flag_the_docs_name_is_a_real_flag() -> None:
    """A flag in backticks is one of ``p2psync``'s, or one a script in the repository takes
    (the benchmarks and the emulated tier have their own)."""
    known = {
        o
        for sub in build_parser()._subparsers._group_actions[0].choices.values()
        for a in sub._actions
        for o in a.option_strings
    }
    scripts = "".join(
        p.read_text() for d in ("benchmarks", "simulations") for p in (ROOT / d).glob("*.py")
    )
    for doc in _docs():
        for span in _inline(doc.read_text()):
            flag = span.split()[0] if span.startswith("--") else None
            if flag and flag not in known:
                assert f'"{flag}"' in scripts, f"{doc.name}: {span} is no flag of p2psync's"
    assert "--advertise-host" in known
