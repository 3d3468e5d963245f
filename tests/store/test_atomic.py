"""Atomic writes: the writer fills the temp file ``mkstemp`` opened (never a second, truncating
open of its name, which makes ext4 flush the whole file on close and stall the next fsync on
the disk), and a failed write leaves the old file and no temp behind."""

from __future__ import annotations

import builtins
import io
import os
from pathlib import Path

import pytest
import torch

from p2p_sync.atomic import atomic_write_bytes, atomic_write_with
from p2p_sync.weights.weights_io import load_weights, save_weights


@pytest.fixture
def reopens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every open of a file *by name* for writing, or with ``O_TRUNC``, during the test."""
    seen: list[str] = []
    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open

    def spy(real):
        def wrapped(file, mode="r", *args, **kwargs):
            if not isinstance(file, int) and any(c in mode for c in "wa+"):
                seen.append(f"open({file}, {mode!r})")
            return real(file, mode, *args, **kwargs)

        return wrapped

    def os_spy(path, flags, *args, **kwargs):
        if flags & os.O_TRUNC:
            seen.append(f"os.open({path}, O_TRUNC)")
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy(real_open))
    monkeypatch.setattr(io, "open", spy(real_io_open))
    monkeypatch.setattr(os, "open", os_spy)
    return seen


def test_bytes_and_weights_are_written_through_the_temp_files_own_descriptor(
    tmp_path: Path, reopens: list[str]
) -> None:
    atomic_write_bytes(tmp_path / "doc.json", b'{"v": 1}')
    atomic_write_bytes(tmp_path / "doc.json", b'{"v": 2}')  # over an existing file
    weights = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    save_weights(tmp_path / "w.safetensors", weights, durable=False)
    assert reopens == []
    assert (tmp_path / "doc.json").read_bytes() == b'{"v": 2}'
    assert torch.equal(load_weights(tmp_path / "w.safetensors")["w"], weights["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json", "w.safetensors"]


def test_a_durable_write_fsyncs_the_file_it_wrote_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    written: list[int] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append(f"fsync {fd}"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append("rename"), real_replace(a, b))[1])

    def write(f) -> None:
        written.append(f.fileno())
        f.write(b"x" * 10)

    atomic_write_with(tmp_path / "f", write)
    assert order[:2] == [f"fsync {written[0]}", "rename"]  # then the directory's fsync
    assert len(order) == 3 and (tmp_path / "f").read_bytes() == b"x" * 10


def test_a_writer_that_fails_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def write(f) -> None:
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write_with(target, write)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
