"""Rice codes of the class ranks (coding 3): parameters, unary and remainder streams.

Per class the gaps between coded ranks, the Rice parameter that minimises their bits, and the
bulk packing and unpacking of the unary stream and remainder planes (docs/format.md, "Codes").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from p2p_sync.codec.classes import _complement
from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.limits import _COMPLEMENT, _GROUP, _MAX_RICE, GROUP1_FRACTION, N_CLASSES
from p2p_sync.errors import CountMismatchError, IndexOutOfRangeError


def _rice_candidates(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per used class (``sums`` of its gaps, ``counts`` of them), the 5 Rice parameters
    searched: within 2 of log2 of the mean gap (the optimum for a geometric gap lies there)."""
    guess = np.log2(sums / counts + 1).astype(np.int64)
    return np.clip(guess[:, None] + np.arange(-2, 3), 0, _MAX_RICE)


def _rice_pick(candidates: np.ndarray, shifted: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per used class, the column of the candidate that minimises its bits (ties to the
    smaller parameter); ``shifted[c, o]``: the sum of its gaps shifted by ``candidates[c, o]``."""
    cost = shifted + counts[:, None] * (1 + candidates)
    return np.argmin(cost, axis=1)


def _rice_params(gaps: np.ndarray, coded: np.ndarray) -> np.ndarray:
    """Per class, the Rice parameter that minimises its bits among :func:`_rice_candidates`.
    ``gaps`` holds the classes' gaps back to back, ``coded`` how many each has."""
    best = np.zeros(N_CLASSES, np.int64)
    used = np.flatnonzero(coded)
    if used.size == 0:
        return best
    starts, counts = (np.cumsum(coded) - coded)[used], coded[used]
    candidates = _rice_candidates(np.add.reduceat(gaps, starts), counts)
    shifted = np.stack(
        [
            np.add.reduceat(gaps >> np.repeat(candidates[:, o], counts), starts)
            for o in range(candidates.shape[1])
        ],
        axis=1,
    )
    best[used] = candidates[np.arange(used.size), _rice_pick(candidates, shifted, counts)]
    return best


def _unary(quotients: np.ndarray) -> bytes:
    """q zero bits then a one bit per entry, LSB-first."""
    if quotients.size == 0:
        return b""
    ends = np.cumsum(quotients + 1) - 1
    bits = np.zeros(int(ends[-1]) + 1, dtype=bool)
    bits[ends] = True
    return np.packbits(bits, bitorder="little").tobytes()


def _plane_sizes(k: np.ndarray, coded: np.ndarray) -> list[int]:
    """Entries in each remainder plane j: the codes of classes whose parameter exceeds j."""
    return [int(coded[k > j].sum()) for j in range(int(k.max(initial=0)))]


def _remainder_planes(rem: np.ndarray, k_of: np.ndarray) -> bytes:
    """Plane j: bit j of every remainder whose code has k > j, in code order, LSB-first."""
    out = []
    for j in range(int(k_of.max(initial=0))):
        out.append(np.packbits((rem[k_of > j] >> j) & 1 != 0, bitorder="little").tobytes())
    return b"".join(out)


@dataclass(frozen=True)
class _ClassCodes:
    """The position part of a coding-3 frame: per class the number of coded ranks, the Rice
    parameter and the mode; per code (class after class) its gap, and the sum of the gaps'
    quotients (the unary stream's zeros)."""

    coded: np.ndarray
    k: np.ndarray
    mode: np.ndarray
    gaps: np.ndarray
    zeros: int

    def streams(self) -> tuple[bytes, bytes]:
        """(unary stream, remainder planes)."""
        kernels = _kernels()
        if kernels["fast"]:
            sizes = [(m + 7) // 8 for m in _plane_sizes(self.k, self.coded)]
            unary = np.zeros((self.zeros + self.gaps.size + 7) // 8, np.uint8)
            planes = np.zeros(sum(sizes), np.uint8)
            plane_start = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
            kernels["rice_encode"](self.gaps, self.coded, self.k, unary, planes, plane_start)
            return unary.tobytes(), planes.tobytes()
        k_of = np.repeat(self.k, self.coded)
        return _unary(self.gaps >> k_of), _remainder_planes(self.gaps & ((1 << k_of) - 1), k_of)


def _code_classes(rank: np.ndarray, bounds: np.ndarray, members: np.ndarray) -> _ClassCodes:
    """Rice-code every class's ranks (``rank[bounds[c]:bounds[c+1]]``, sorted). A class where
    most members change codes the ranks of those that do not (mode bit 0); one where at least
    GROUP1_FRACTION changes sends its values in group 1 (mode bit 1)."""
    changed = np.diff(bounds)
    group = (changed > 0) & (changed >= GROUP1_FRACTION * members)
    complement = 2 * changed > members
    parts = [rank[bounds[c] : bounds[c + 1]] for c in range(N_CLASSES)]
    for c in np.flatnonzero(complement):
        parts[c] = _complement(parts[c], int(members[c]))
    coded = np.array([p.size for p in parts], np.int64)
    ranks = np.concatenate(parts)
    prev = np.empty_like(ranks)
    prev[1:] = ranks[:-1]
    starts = np.cumsum(coded) - coded
    prev[starts[coded > 0]] = -1
    gaps = ranks - prev - 1
    k = _rice_params(gaps, coded)
    mode = complement * _COMPLEMENT + group * _GROUP
    return _ClassCodes(coded, k, mode, gaps, int((gaps >> np.repeat(k, coded)).sum()))


def _class_codes(
    cls: np.ndarray, rank: np.ndarray, d: np.ndarray, members: np.ndarray
) -> tuple[_ClassCodes, np.ndarray, np.ndarray]:
    """The changes (in position order: class ``cls``, class rank ``rank``, delta ``d``) coded
    class by class: (codes, each class's changed count, the deltas in class order). Compiled:
    a tally, then one gather (a stable counting sort) that also sums each gap's shifts by the
    Rice candidates; the numpy way is a stable sort by class, then per-class arrays."""
    kernels = _kernels()
    if kernels["fast"]:
        return _gathered_codes(kernels, cls, rank, d, members)
    order = np.argsort(cls, kind="stable")
    cls, rank, d = cls[order], rank[order], d[order]
    bounds = np.searchsorted(cls, np.arange(N_CLASSES + 1))
    return _code_classes(rank, bounds, members), np.diff(bounds), d


def _gathered_codes(
    kernels: dict[str, Callable],
    cls: np.ndarray,
    rank: np.ndarray,
    d: np.ndarray,
    members: np.ndarray,
) -> tuple[_ClassCodes, np.ndarray, np.ndarray]:
    """:func:`_class_codes` by the compiled kernels. A class's changed gaps sum to its last
    rank + 1 - its count, which fixes its Rice candidates before the gather pass; a class that
    codes its complement (small classes of tiny weights, where most members change) is
    re-coded from its gathered gaps after it."""
    counts, last = np.zeros(N_CLASSES, np.int64), np.full(N_CLASSES, -1, np.int64)
    kernels["class_tally"](cls, rank, counts, last)
    complement = 2 * counts > members
    plain = np.flatnonzero((counts > 0) & ~complement)
    candidates = np.zeros((N_CLASSES, 5), np.int64)
    if plain.size:
        candidates[plain] = _rice_candidates(last[plain] + 1 - counts[plain], counts[plain])
    starts = np.cumsum(counts) - counts
    gaps, d_out = np.empty(rank.size, np.int64), np.empty_like(d)
    shifted = np.zeros((N_CLASSES, 5), np.int64)
    kernels["class_gather"](cls, rank, d, starts, candidates, gaps, d_out, shifted)
    coded = counts
    if complement.any():
        gaps, coded = _complement_gaps(gaps, starts, counts, members, complement)
        _recount_complements(gaps, coded, complement, candidates, shifted)
    k, zeros = _picked_params(candidates, shifted, coded)
    group = (counts > 0) & (counts >= GROUP1_FRACTION * members)
    mode = complement * _COMPLEMENT + group * _GROUP
    return _ClassCodes(coded, k, mode, gaps, zeros), counts, d_out


def _recount_complements(
    gaps: np.ndarray,
    coded: np.ndarray,
    complement: np.ndarray,
    candidates: np.ndarray,
    shifted: np.ndarray,
) -> None:
    """Each complement class's Rice candidates and shifted gap sums, in place, from the gaps
    it codes (``gaps``, back to back, ``coded`` per class): its unchanged members'."""
    at = np.cumsum(coded) - coded
    for c in np.flatnonzero(complement & (coded > 0)):
        seg = gaps[at[c] : at[c] + coded[c]]
        candidates[c] = _rice_candidates(seg.sum(keepdims=True), coded[c : c + 1])[0]
        shifted[c] = [int((seg >> int(k)).sum()) for k in candidates[c]]


def _picked_params(
    candidates: np.ndarray, shifted: np.ndarray, coded: np.ndarray
) -> tuple[np.ndarray, int]:
    """Per class, the Rice parameter among its candidates that minimises its bits; and the
    unary stream's zeros (the sum of the chosen shifted gaps)."""
    k, zeros, used = np.zeros(N_CLASSES, np.int64), 0, np.flatnonzero(coded)
    if used.size:
        pick = _rice_pick(candidates[used], shifted[used], coded[used])
        k[used] = candidates[used, pick]
        zeros = int(shifted[used, pick].sum())
    return k, zeros


def _complement_gaps(
    gaps: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    members: np.ndarray,
    complement: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The classes' gaps back to back, each complement class's changed gaps replaced by the
    gaps of its members that did not change; and how many gaps each class now codes."""
    parts = []
    for c in range(N_CLASSES):
        seg = gaps[starts[c] : starts[c] + counts[c]]
        if complement[c]:
            unchanged = _complement(np.cumsum(seg + 1) - 1, int(members[c]))
            seg = np.diff(unchanged, prepend=-1) - 1
        parts.append(seg)
    return np.concatenate(parts), np.array([p.size for p in parts], np.int64)


def _read_unary(buf: memoryview, total: int, name: str) -> np.ndarray:
    """Quotients from the unary stream: exactly ``total`` one bits, zero padding only."""
    bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")
    ones = np.flatnonzero(bits)
    if ones.size != total or (total and int(ones[-1]) < bits.size - 8) or (not total and len(buf)):
        raise CountMismatchError(f"{name}: unary stream holds {ones.size} codes, expected {total}")
    return np.diff(ones, prepend=-1) - 1


_RICE_ERRORS = {
    1: (CountMismatchError, "unary stream ends before its last code"),
    2: (IndexOutOfRangeError, "a coded position lies outside the tensor"),
    3: (CountMismatchError, "unary stream holds bits after its last code"),
}


def _read_remainders(buf: memoryview, k_of: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Inverse of :func:`_remainder_planes` (``buf`` holds exactly the planes)."""
    rem = np.zeros(k_of.size, np.int64)
    off = 0
    for j, m in enumerate(sizes):
        bits = np.unpackbits(
            np.frombuffer(buf, np.uint8, (m + 7) // 8, off), count=m, bitorder="little"
        )
        rem[k_of > j] |= bits.astype(np.int64) << j
        off += (m + 7) // 8
    return rem
