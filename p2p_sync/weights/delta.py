"""The in-memory form of a patch: per-tensor deltas and the patch that holds them.

A :class:`TensorDelta` records which elements of one tensor change and by how much, as
wrapping integer differences of their bit patterns; a :class:`Patch` adds the base and target
state hashes. Diffing and applying them is :mod:`p2p_sync.weights.patch`, merging
:mod:`p2p_sync.weights.merge`, their wire format :mod:`p2p_sync.codec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from p2p_sync.errors import IndexOutOfRangeError, LayoutMismatchError, MalformedPatchError
from p2p_sync.weights.statehash import StateDigest
from p2p_sync.weights.tensors import Layout, TensorSpec, bits_dtype, layout_fingerprint

# A tensor whose changed fraction exceeds this is held dense in memory: a sparse entry costs
# 8 bytes of position plus the delta, a dense one just the delta.
DENSE_IN_MEMORY_FRACTION = 0.25


def _extremes(values: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty int tensor: numpy's SIMD reductions on the host (torch's int64
    min and max each took ~10x longer there, and every patch validates its positions several
    times a version), one ``aminmax`` (one device sync) elsewhere."""
    if values.device.type == "cpu":
        v = values.numpy()
        return int(v.min()), int(v.max())
    lo, hi = torch.aminmax(values)
    return int(lo), int(hi)


@dataclass(frozen=True, eq=False)
class TensorDelta:
    """The change of one tensor: sorted flat positions and their bit deltas, or dense deltas.

    ``positions`` is None for the dense form, where ``deltas`` has one entry per element (zero
    where unchanged). Both live on the host as int64 positions and ``bits_dtype`` deltas.
    """

    spec: TensorSpec
    positions: torch.Tensor | None
    deltas: torch.Tensor

    @property
    def dense(self) -> bool:
        return self.positions is None

    @property
    def count(self) -> int:
        """How many elements change."""
        if self.positions is None:
            return int(torch.count_nonzero(self.deltas))
        return int(self.positions.numel())

    def validate(self) -> None:
        """Raise unless applying this delta stays inside its tensor."""
        spec, want = self.spec, bits_dtype(self.spec.dtype)
        if self.deltas.dtype != want or self.deltas.dim() != 1:
            raise MalformedPatchError(f"{spec.name}: deltas must be a flat {want} tensor")
        if self.positions is None:
            if self.deltas.numel() != spec.numel:
                raise MalformedPatchError(
                    f"{spec.name}: dense delta has {self.deltas.numel()} entries, "
                    f"tensor has {spec.numel}"
                )
            return
        self._validate_positions()

    def _validate_positions(self) -> None:
        pos, spec = self.positions, self.spec
        assert pos is not None
        if pos.dtype != torch.int64 or pos.dim() != 1 or pos.numel() != self.deltas.numel():
            raise MalformedPatchError(
                f"{spec.name}: positions must be flat int64 matching the deltas"
            )
        if not pos.numel():
            return
        lo, hi = _extremes(pos)
        if lo < 0 or hi >= spec.numel:
            raise IndexOutOfRangeError(
                f"{spec.name}: position range [{lo}, {hi}] outside a tensor of {spec.numel} "
                "elements"
            )

    def host(self) -> TensorDelta:
        """This delta with its tensors on the host (itself when they already are)."""
        if self.deltas.device.type == "cpu":
            return self
        pos = None if self.positions is None else self.positions.cpu()
        return TensorDelta(self.spec, pos, self.deltas.cpu())

    def to_sparse(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and deltas of the changed elements only."""
        if self.positions is not None:
            return self.positions, self.deltas
        pos = np.flatnonzero(self.deltas.numpy() != 0)  # a bool mask is numpy's fast path
        return torch.from_numpy(pos), torch.from_numpy(self.deltas.numpy()[pos])

    def to_dense(self) -> torch.Tensor:
        """Deltas for every element (zero where unchanged)."""
        if self.positions is None:
            return self.deltas
        out = torch.zeros(self.spec.numel, dtype=self.deltas.dtype)
        out[self.positions] = self.deltas
        return out

    def same_change(self, other: TensorDelta) -> bool:
        """True when both describe the identical change (whatever their in-memory form)."""
        if self.spec != other.spec:
            return False
        return bool(torch.equal(self.to_dense(), other.to_dense()))


def canonical_delta(spec: TensorSpec, positions: torch.Tensor, deltas: torch.Tensor) -> TensorDelta:
    """Choose the in-memory form by density, so equal changes always look alike."""
    if positions.numel() > DENSE_IN_MEMORY_FRACTION * spec.numel:
        out = torch.zeros(spec.numel, dtype=deltas.dtype)
        out[positions] = deltas
        return TensorDelta(spec, None, out)
    return TensorDelta(spec, positions, deltas)


@dataclass(frozen=True, eq=False)
class Patch:
    """A complete patch: the base it applies to, the target it produces, per-tensor changes.

    ``deltas`` holds only tensors with at least one change, keyed by name.
    """

    layout: Layout
    base_hash: bytes
    target_hash: bytes
    deltas: Mapping[str, TensorDelta] = field(default_factory=dict)
    # The target's per-tensor sums when a diff computed them (never on the wire).
    target_digest: StateDigest | None = field(default=None, repr=False)

    @property
    def fingerprint(self) -> bytes:
        return layout_fingerprint(self.layout)

    @property
    def changed(self) -> int:
        return sum(d.count for d in self.deltas.values())

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.layout)

    def validate(self) -> None:
        specs = {s.name: s for s in self.layout}
        for name, delta in self.deltas.items():
            if specs.get(name) != delta.spec:
                raise MalformedPatchError(f"{name}: delta does not match the patch layout")
            delta.validate()


def check_layout(expected: Layout, actual: Layout, what: str) -> None:
    if expected == actual:
        return
    want = {s.name: s for s in expected}
    have = {s.name: s for s in actual}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            w = want[name].describe() if name in want else "absent"
            h = have[name].describe() if name in have else "absent"
            raise LayoutMismatchError(f"{what}: tensor {name!r} is {h}, expected {w}")
    raise LayoutMismatchError(f"{what}: tensor order differs")
