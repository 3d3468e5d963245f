"""The ``--export`` directory (``p2p_sync.weights.export``): the link swaps between two buffers,
the spare
one is rewritten in place only when nobody holds it, and a reader always keeps what it opened."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from p2p_sync.weights import export
from p2p_sync.weights.export import BUFFERS, LINK, spare_buffer, write_export
from p2p_sync.weights.weights_io import save_weights
from tests.helpers import bit_equal


def weights(seed: int, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(rows, 32, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(32, generator=g).to(torch.bfloat16),
    }


def exported(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / LINK)


def test_versions_alternate_buffers_and_the_spare_is_rewritten_in_place(tmp_path: Path) -> None:
    versions = [weights(v) for v in range(4)]
    inodes = []
    write_export(tmp_path, versions[0])  # the first export makes the spare too, holding v0
    spare = tmp_path / BUFFERS[1]
    made = spare.stat().st_ino
    assert bit_equal(load_file(spare), versions[0])
    for v in versions:
        written = write_export(tmp_path, v)
        assert os.readlink(tmp_path / LINK) == str(written.relative_to(tmp_path))
        assert bit_equal(exported(tmp_path), v)
        inodes.append(written.stat().st_ino)
    assert os.readlink(tmp_path / LINK) == BUFFERS[0]
    assert spare_buffer(tmp_path) == BUFFERS[1]
    assert inodes[0] == inodes[2] == made and inodes[1] == inodes[3]  # no new file after the first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".p2psync", LINK]


def test_a_reader_of_a_buffer_keeps_its_version(tmp_path: Path) -> None:
    """An engine still loading version 1 (safetensors maps the file) when version 3 comes,
    which goes into the buffer it holds: that buffer is replaced, not overwritten."""
    v1, v2, v3 = weights(1), weights(2), weights(3)
    first = write_export(tmp_path, v1)
    ino = first.stat().st_ino
    with safe_open(str(tmp_path / LINK), framework="pt") as held:
        write_export(tmp_path, v2)
        assert write_export(tmp_path, v3) == first
        assert first.stat().st_ino != ino
        assert bit_equal({k: held.get_tensor(k) for k in held.keys()}, v1)
    assert bit_equal(exported(tmp_path), v3)


def test_a_held_buffer_gets_a_new_file_and_a_free_one_does_not(tmp_path: Path) -> None:
    write_export(tmp_path, weights(1))
    a = tmp_path / BUFFERS[0]
    ino = a.stat().st_ino
    write_export(tmp_path, weights(2))
    with open(a, "rb") as reader:
        write_export(tmp_path, weights(3))
        assert a.stat().st_ino != ino  # replaced by rename: the reader's file is untouched
        assert os.fstat(reader.fileno()).st_ino == ino
    ino = a.stat().st_ino
    write_export(tmp_path, weights(4))
    write_export(tmp_path, weights(5))
    assert a.stat().st_ino == ino  # nobody held it: rewritten in place
    assert bit_equal(exported(tmp_path), weights(5))


def test_a_plain_file_from_before_double_buffering_is_kept_for_its_reader(tmp_path: Path) -> None:
    old = weights(0)
    save_weights(tmp_path / LINK, old)
    with safe_open(str(tmp_path / LINK), framework="pt") as held:
        write_export(tmp_path, weights(1))
        assert bit_equal({k: held.get_tensor(k) for k in held.keys()}, old)
    assert (tmp_path / LINK).is_symlink()
    assert bit_equal(exported(tmp_path), weights(1))


def test_a_smaller_version_leaves_no_tail_of_the_larger_one(tmp_path: Path) -> None:
    write_export(tmp_path, weights(1, rows=256))
    write_export(tmp_path, weights(2))
    small = write_export(tmp_path, weights(3, rows=8))
    save_weights(tmp_path / "expected.safetensors", weights(3, rows=8))
    assert small.read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


def test_without_leases_every_version_is_a_fresh_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export, "unused", lambda path: False)
    write_export(tmp_path, weights(1))
    ino = (tmp_path / BUFFERS[0]).stat().st_ino
    write_export(tmp_path, weights(2))
    write_export(tmp_path, weights(3))
    assert (tmp_path / BUFFERS[0]).stat().st_ino != ino
    assert bit_equal(exported(tmp_path), weights(3))


def test_version_json_follows_the_weights_by_a_link_swap(tmp_path: Path) -> None:
    """``version.json`` is a link to a small file beside the buffer just written, rewritten in
    place (a temp file renamed over it waited up to 1.1 s behind the model's writeback)."""
    (tmp_path / "version.json").write_text("{}")  # a regular file from an older node
    inodes = []
    for v in range(4):
        info = f'{{"version": {v}}}'.encode() + b" " * (3 - v)  # a shorter one leaves no tail
        written = write_export(tmp_path, weights(v), info)
        assert (tmp_path / "version.json").read_bytes() == info
        beside = written.with_suffix(".json")
        assert os.readlink(tmp_path / "version.json") == str(beside.relative_to(tmp_path))
        inodes.append(beside.stat().st_ino)
    assert inodes[0] == inodes[2] and inodes[1] == inodes[3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".p2psync", LINK, "version.json"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_files_follow_the_umask(
    tmp_path: Path, umask: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine running as another user reads the export under the usual umask 022; 077
    keeps it private. Both buffers and version.json, first export and fresh files alike."""
    old = os.umask(umask)
    try:
        write_export(tmp_path, weights(1), b'{"version": 1}')
        monkeypatch.setattr(export, "unused", lambda path: False)  # a reader holds the spare
        write_export(tmp_path, weights(2), b'{"version": 2}')
    finally:
        os.umask(old)
    files = [tmp_path / b for b in BUFFERS] + [(tmp_path / b).with_suffix(".json") for b in BUFFERS]
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {oct(0o666 & ~umask)}


def test_the_hook_gets_the_export_dir_as_an_absolute_path(tmp_path: Path, monkeypatch) -> None:
    from p2p_sync.runtime.rollout import hook_env

    monkeypatch.chdir(tmp_path)
    env = hook_env(3, "ab" * 32, Path("w1/"))
    assert env["P2PSYNC_EXPORT"] == str(tmp_path / "w1") and env["P2PSYNC_VERSION"] == "3"
    assert "P2PSYNC_EXPORT" not in hook_env(3, "ab" * 32, None)
