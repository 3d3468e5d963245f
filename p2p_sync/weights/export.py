"""The ``--export`` directory: the current weights as ``model.safetensors`` for engines that
reload from disk, swapped atomically per version, rewritten in place when nobody reads it.

Why not a fresh file per version: on a Linux page cache, writing a new 1.9 GB file costs
3.3-3.9 s on this project's test machine (pages allocated and zeroed, the old file's freed,
writeback throttling the writer), and two rollouts sharing a disk took 6-8 s each; rewriting
the same bytes over a file whose pages are cached takes 0.3 s. Why not in place on the file
the engine reads: a reader would see a mix of two versions.

So two buffers, ``.p2psync/a.safetensors`` and ``.p2psync/b.safetensors``, and
``model.safetensors`` is a symlink to one of them. A version is written into the other one,
then the link is replaced by rename (atomic: a reader opening ``model.safetensors`` gets the
old buffer or the new one, whole). The buffer written into held the version before last; it is
rewritten in place only if **no process has it open or mapped** (Linux grants a write lease on
a file only then: ``fcntl(F_SETLEASE, F_WRLCK)``); otherwise (an engine still loading it, a
tool copying it, a filesystem or OS without leases) a fresh file replaces it by rename, so a
reader keeps the bytes it opened, as before double buffering. What stays possible: a process
that opens a buffer *by its hidden name* between the probe and the rewrite. Engines open
``model.safetensors``, whose link never points at the buffer being written.

``version.json`` (what the node says the weights are: ``node/rollout.py``) follows the same
way, after the weights: ``.p2psync/a.json`` or ``b.json`` beside its buffer, rewritten in place,
then the ``version.json`` link swapped. Why not a temp file renamed over it: while the disk
writes a model back, ext4 made that rename wait up to 1.1 s on this machine (it flushes a
renamed-over file's new data first), where a link swap waited 0.1 s and an in-place write 0.
Not fsynced: the export is rebuilt from the store at start whenever ``version.json`` does not
match the state.
The first export writes both buffers (the same version twice, after the link points at the first):
a join is slow anyway (it downloads the model), where a fresh buffer at the next version cost that
version 2-5 s at 1B. Disk: two copies of the model in the export directory. Engines glob
``*.safetensors`` in it; the buffers sit in a hidden subdirectory, out of that glob. The files
follow the process umask (readable by an engine running as another user under the usual 022;
``umask 077`` keeps them private).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from p2p_sync.weights.weights_io import save_weights, write_to

try:
    import fcntl
except ImportError:  # not POSIX: no leases, every version is a fresh file
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LINK = "model.safetensors"
INFO = "version.json"
BUFFERS = (".p2psync/a.safetensors", ".p2psync/b.safetensors")
SHARED = 0o666  # export files follow the umask: an engine may run as another user


def write_export(
    directory: Path, tensors: Mapping[str, torch.Tensor], info: bytes | None = None
) -> Path:
    """Make ``directory/model.safetensors`` hold ``tensors``, then ``directory/version.json``
    hold ``info`` (when given); returns the buffer written."""
    target = directory / spare_buffer(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    how = "rewritten in place"
    if not rewrite_in_place(target, tensors):
        how = "written afresh (held by a reader, or new)"
        save_weights(target, tensors, None, durable=False, mode=SHARED)
    _point(directory, LINK, target)
    if info is not None:
        beside = target.with_suffix(".json")
        fd = os.open(beside, os.O_WRONLY | os.O_CREAT, SHARED)
        try:
            os.pwrite(fd, info, 0)
            os.ftruncate(fd, len(info))
        finally:
            os.close(fd)
        _point(directory, INFO, beside)
    spare = directory / spare_buffer(directory)
    if not spare.exists():  # the first export: the other buffer now, so no version makes one
        save_weights(spare, tensors, None, durable=False, mode=SHARED)
        how += ", and the spare buffer created"
    log.info("export %s %s in %.2fs", target.name, how, time.perf_counter() - t0)
    return target


def spare_buffer(directory: Path) -> str:
    """The buffer ``model.safetensors`` does not point at (``a`` if it is no link of ours: a
    first export, or a regular file written before double buffering)."""
    try:
        current = os.readlink(directory / LINK)
    except OSError:
        current = None
    return BUFFERS[1] if current == BUFFERS[0] else BUFFERS[0]


def unused(path: Path) -> bool:
    """Whether no process (this one included) has ``path`` open or mapped. A write lease is
    granted only on a file nobody else holds; it is released at once (held, it would make
    other processes' ``open`` wait for us and signal us)."""
    if fcntl is None or not hasattr(fcntl, "F_SETLEASE"):
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:  # EAGAIN: held; EINVAL: leases unsupported here
        return False
    finally:
        os.close(fd)


def rewrite_in_place(path: Path, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Overwrite ``path`` with ``tensors`` if nobody holds it; ``False`` if it was left alone."""
    if path.is_symlink() or not unused(path):
        return False
    with open(path, "r+b") as f:
        f.truncate(write_to(f, tensors))
    return True


def _point(directory: Path, name: str, target: Path) -> None:
    """Replace the link ``name`` by one to ``target``, atomically (rename)."""
    tmp = directory / f".{name}.{os.getpid()}.link"
    tmp.unlink(missing_ok=True)
    os.symlink(target.relative_to(directory), tmp)
    os.replace(tmp, directory / name)
