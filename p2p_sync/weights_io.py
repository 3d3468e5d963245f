"""Load and save weight files (safetensors), with errors that name the file and the problem."""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from p2p_sync.atomic import atomic_write_with
from p2p_sync.errors import P2PSyncError


class WeightsFileError(P2PSyncError):
    """A weights file is missing, unreadable or not valid safetensors."""


def load_weights(path: str | os.PathLike[str], device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on ``device``."""
    try:
        return load_file(os.fspath(path), device=device)
    except FileNotFoundError:
        raise WeightsFileError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsFileError(f"{path}: not a readable safetensors file ({exc})") from None


def save_weights(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` to ``path`` atomically (old file or new, never a mix)."""
    host = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    atomic_write_with(path, lambda tmp: save_file(host, os.fspath(tmp)))
