"""The p2psync CLI on real safetensors files: create, apply, inspect, and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from node.cli import main
from p2p_sync.weights.weights_io import load_weights
from tests.helpers import bit_equal, heavy_modules_after


@pytest.fixture()
def files(tmp_path: Path, tiny_versions: list) -> dict[str, Path]:
    paths = {}
    for i in (0, 1, 2):
        paths[f"v{i}"] = tmp_path / f"v{i}.safetensors"
        save_file(tiny_versions[i], paths[f"v{i}"])
    paths["patch"] = tmp_path / "p01.patch"
    return paths


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def create(files: dict[str, Path], capsys: pytest.CaptureFixture, fmt: int = 2) -> None:
    code, out, _ = run(
        capsys,
        "patch",
        "create",
        "--base",
        files["v0"],
        "--new",
        files["v1"],
        "--out",
        files["patch"],
        "--device",
        "cpu",
        "--format",
        fmt,
    )
    assert code == 0 and "smaller than dense" in out


@pytest.mark.parametrize("fmt", [1, 2, 3])
def test_create_then_apply_reproduces_the_new_file(files, capsys, tmp_path, tiny_versions, fmt):
    from p2p_sync import codec

    create(files, capsys, fmt)
    assert codec.read_header(files["patch"].read_bytes()).version == fmt
    out_path = tmp_path / "out.safetensors"
    code, out, _ = run(
        capsys,
        "patch",
        "apply",
        "--base",
        files["v0"],
        "--patch",
        files["patch"],
        "--out",
        out_path,
    )
    assert code == 0, out
    assert bit_equal(load_weights(out_path), tiny_versions[1])


def test_apply_on_another_base_is_refused_with_a_clear_message(files, capsys, tmp_path):
    create(files, capsys)
    out_path = tmp_path / "out.safetensors"
    code, _, err = run(
        capsys,
        "patch",
        "apply",
        "--base",
        files["v2"],
        "--patch",
        files["patch"],
        "--out",
        out_path,
    )
    assert code == 1
    assert err.startswith("p2psync: error: ") and "was made for base" in err and "v2" in err
    assert err.count("\n") == 1 and not out_path.exists()


def test_inspect_reports_counts_density_and_ratio(files, capsys, tiny_versions):
    create(files, capsys)
    code, out, _ = run(
        capsys, "patch", "inspect", files["patch"], "--json", "--verify", "--base", files["v0"]
    )
    assert code == 0
    report = json.loads(out)
    changed = sum(
        int((tiny_versions[0][k].view(torch.int16) != tiny_versions[1][k].view(torch.int16)).sum())
        for k in tiny_versions[0]
    )
    assert report["changed"] == changed
    assert report["bytes"] == files["patch"].stat().st_size
    assert report["ratio_vs_dense"] == pytest.approx(report["dense_bytes"] / report["bytes"])
    assert sum(r["changed"] for r in report["rows"]) == changed
    code, out, _ = run(capsys, "patch", "inspect", files["patch"])
    assert code == 0 and "bits per changed element" in out and "embed.weight" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["patch", "inspect", "{v0}"], "bad magic"),
        (["patch", "inspect", "{missing}"], "cannot read patch"),
        (["patch", "apply", "--base", "{missing}", "--patch", "{v0}", "--out", "{out}"], "magic"),
        (
            ["patch", "create", "--base", "{missing}", "--new", "{v1}", "--out", "{out}"],
            "no such file",
        ),
        (
            ["patch", "create", "--base", "{junk}", "--new", "{v1}", "--out", "{out}"],
            "not a readable safetensors",
        ),
        (
            [
                "patch",
                "create",
                "--base",
                "{v0}",
                "--new",
                "{v1}",
                "--out",
                "{out}",
                "--device",
                "cuda:7",
            ]
            if not torch.cuda.is_available()
            else ["patch", "inspect", "{v0}"],
            "CUDA is not available" if not torch.cuda.is_available() else "bad magic",
        ),
    ],
)
def test_bad_input_gets_a_one_line_error(files, capsys, tmp_path, argv, message):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    names = {**files, "missing": tmp_path / "missing", "out": tmp_path / "o", "junk": junk}
    code, _, err = run(capsys, *(a.format(**names) for a in argv))
    assert code == 1
    assert err.startswith("p2psync: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_bad_flags_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["patch", "create", "--base", "x"])
    assert exc.value.code == 2
    assert "required" in capsys.readouterr().err


def test_help_imports_no_command_and_a_command_s_imports_are_frozen(tmp_path: Path) -> None:
    """``p2psync`` / ``python -m node`` (``node.entry``): ``--help`` builds every command's
    flags without their modules (no torch, no numba: it answers in a fraction of a second);
    a command imports its own when it runs, with the collector off, what they made frozen out
    of later collections, and the collector on again for its work (``node.lazy``). In a fresh
    interpreter: this one has imported it all."""
    done = heavy_modules_after(
        "import gc\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, [m for m in ('torch', 'numba') if m in sys.modules])\n"
        f"code = main(['patch', 'inspect', {str(tmp_path / 'none.patch')!r}])\n"
        "print(code, gc.isenabled(), gc.get_freeze_count() > 100_000)"
    )
    assert "usage:" in done.stdout  # the CLI ran (``python -m node`` starts every test node)
    lines = done.stdout.splitlines()
    assert lines[-3] == "0 []", done.stdout
    assert lines[-2] == "1 True True", done.stdout + done.stderr  # no such file: 1
    assert "torch" in lines[-1]
    assert "cannot read patch" in done.stderr


def _flipped(path: Path, offset: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    out = path.with_name(f"flipped-{offset}.patch")
    out.write_bytes(bytes(data))
    return out


def test_inspect_verify_without_the_base_checks_what_needs_none(files, capsys) -> None:
    """A format-2 patch: with one byte flipped inside a frame, --verify fails without --base
    (checksums and structure); intact, it passes and says what only --base can check."""
    from p2p_sync import codec

    create(files, capsys)
    info = codec.read_header(files["patch"].read_bytes())
    assert info.version == 2 and any(r.coding == codec.CLASSED for r in info.rows)
    code, _, err = run(capsys, "patch", "inspect", files["patch"], "--json", "--verify")
    assert code == 0 and "need --base" in err
    biggest = max(info.rows, key=lambda r: r.size)
    bad = _flipped(files["patch"], biggest.offset + biggest.size // 2)
    code, out, err = run(capsys, "patch", "inspect", bad, "--json", "--verify")
    assert code == 1 and err.startswith("p2psync: error: ") and err.count("\n") == 1, err
    assert biggest.spec.name in err and not out


def test_a_damaged_header_is_told_apart_from_another_base(files, capsys) -> None:
    """The header has no checksum: a flipped base-hash byte used to read as "made for another
    base". Decoding against the given base tells which of the two is wrong."""
    create(files, capsys)
    bad = _flipped(files["patch"], 40)  # the header's base state hash
    code, _, err = run(capsys, "patch", "inspect", bad, "--verify", "--base", files["v0"])
    assert code == 1 and "is corrupt: its header names base" in err, err
    out = files["v0"].with_name("out.safetensors")
    argv = ["apply", "--base", files["v0"], "--patch", bad, "--out", out]
    code, _, err = run(capsys, "patch", *argv)
    assert code == 1 and "is corrupt" in err and not out.exists(), err
    code, _, err = run(
        capsys, "patch", "inspect", files["patch"], "--verify", "--base", files["v2"]
    )
    assert code == 1 and "another base" in err, err
    code, _, err = run(
        capsys, "patch", "inspect", files["patch"], "--verify", "--base", files["v0"]
    )
    assert code == 0 and "target hash reached" in err, err


def test_a_sharded_trainers_patch_inspects_and_applies(files, capsys, tiny_versions) -> None:
    """A format-version-4 patch (each tensor's frame joined from parts, as a sharded trainer's
    ranks write it): inspect names the coding and verifies it without a base; apply rebuilds
    the new version."""
    from p2p_sync import codec
    from p2p_sync.weights.patch import diff
    from tests.codec.test_codec_parts import _as_parts

    files["patch"].write_bytes(_as_parts(diff(tiny_versions[0], tiny_versions[1]), [100, 900]))
    code, out, err = run(capsys, "patch", "inspect", files["patch"], "--json", "--verify")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert {r["coding"] for r in rows if r["changed"]} == {"parts"}
    assert codec.read_header(files["patch"].read_bytes()).version == 4
    out_path = files["v0"].with_name("out.safetensors")
    args = ("--base", files["v0"], "--patch", files["patch"], "--out", out_path)
    assert run(capsys, "patch", "apply", *args)[0] == 0
    assert bit_equal(load_weights(out_path), tiny_versions[1])


def test_patch_create_s_default_level_is_the_codec_s() -> None:
    """``--level``'s default is written in the parser, which does without the codec."""
    from node import patch_cmd
    from p2p_sync import codec

    assert patch_cmd.DEFAULT_LEVEL == codec.DEFAULT_LEVEL
