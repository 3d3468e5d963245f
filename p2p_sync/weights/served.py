"""A state dict read as the engines serve it: floating tensors cast to the served dtype.

Trainers keep fp32 master weights; engines serve bf16. Publishing the fp32 tensors makes every
patch carry 32-bit values the engines never use (docs/performance.md has the figure). A
:class:`ServedWeights` casts each floating tensor when it is read, on the tensor's own device,
so a publish holds one cast tensor per worker at a time, never a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from p2p_sync.weights.tensors import Layout, TensorSpec, bits_dtype


class ServedWeights(Mapping[str, torch.Tensor]):
    """``tensors`` as served in ``dtype``: floating tensors of another dtype cast on read,
    the rest (integer buffers, tensors already in ``dtype``) as they are."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"serve_dtype must be a floating dtype, not {dtype}")
        bits_dtype(dtype)  # raises for a dtype patches cannot carry
        self.tensors, self.dtype = tensors, dtype

    def _casts(self, t: torch.Tensor) -> bool:
        return t.is_floating_point() and t.dtype != self.dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name].detach()
        return t.to(self.dtype) if self._casts(t) else t

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def owned(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as served, in memory of its own (a cast is; the rest are copied)."""
        t = self.tensors[name].detach()
        return t.to(self.dtype) if self._casts(t) else t.clone()

    def layout(self) -> Layout:
        """The served layout, read off the originals: nothing is cast to learn it."""
        specs = []
        for name in sorted(self.tensors):
            t = self.tensors[name]
            dtype = self.dtype if self._casts(t) else t.dtype
            bits_dtype(dtype)
            specs.append(TensorSpec(name, tuple(int(d) for d in t.shape), dtype))
        return tuple(specs)


def detached(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``tensors`` to read for a publish: served weights as they are (cast as read), any
    other state dict as its detached tensors."""
    if isinstance(tensors, ServedWeights):
        return tensors
    return {k: v.detach() for k, v in tensors.items()}


def copy_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` in memory of its own (served weights: each cast is one)."""
    if isinstance(tensors, ServedWeights):
        return {k: tensors.owned(k) for k in tensors}
    return {k: v.detach().clone() for k, v in tensors.items()}


__all__ = ["ServedWeights", "copy_of", "detached"]
