"""The state hash's host kernels: the sums of its terms, compiled by numba on first use.

One pass over a tensor's words (a full hash), over listed words or element positions, while
applying deltas (APPLY) or while diffing two versions (DIFF): each word's terms are summed
while it is in cache. The terms are defined in :mod:`p2p_sync.weights.statehash`; their
constants live here, where the kernels compile them in.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from p2p_sync import jit

MASK = (1 << 64) - 1
K0, K1 = 0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93
F1, F2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # fmix64
S1, S2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64
_ZERO = np.uint64(0)

ALL, WORDS, ELEMENTS, APPLY = 0, 1, 2, 3  # what the host kernel does with ``idx``
# Words (DIFF) or positions (APPLY) a host kernel takes at a time: listed branch-free, then
# visited while in cache (32 KiB of temporaries).
SCAN_BLOCK = 1024

_K0, _K1 = np.uint64(K0), np.uint64(K1)
_F1, _F2, _S1, _S2 = np.uint64(F1), np.uint64(F2), np.uint64(S1), np.uint64(S2)


@jit.step
def _lane0(u: np.uint64, j: np.uint64) -> np.uint64:
    """Lane 0's term of word ``u`` at index ``j``: fmix64 (uint64 arithmetic wraps)."""
    x = u ^ (j * _K0)
    x ^= x >> np.uint64(33)
    x *= _F1
    x ^= x >> np.uint64(33)
    x *= _F2
    return x ^ (x >> np.uint64(33))


@jit.step
def _lane1(u: np.uint64, j: np.uint64) -> np.uint64:
    """Lane 1's term of word ``u`` at index ``j``: SplitMix64's finalizer (uint64 wraps)."""
    y = u ^ (j * _K1)
    y ^= y >> np.uint64(30)
    y *= _S1
    y ^= y >> np.uint64(27)
    y *= _S2
    return y ^ (y >> np.uint64(31))


@jit.step
def _sum_all(body: np.ndarray) -> tuple[np.uint64, np.uint64]:
    """Both lanes' sums over every word: the hot loop of a full hash, no index, no branch."""
    a, b = _ZERO, _ZERO
    for i in range(body.size):
        a += _lane0(body[i], np.uint64(i))
        b += _lane1(body[i], np.uint64(i))
    return a, b


@jit.step
def _sum_listed(
    body: np.ndarray, idx: np.ndarray, mode: int, shift: int, tail: np.uint64
) -> tuple[np.uint64, np.uint64]:
    """Both lanes' sums over the words ``idx`` names (WORDS), or over the distinct words holding
    the sorted element positions ``idx`` (ELEMENTS), a word past ``body`` being ``tail``."""
    a, b = _ZERO, _ZERO
    last = -1
    for n in range(idx.size):
        i = idx[n] >> shift if mode == ELEMENTS else idx[n]
        if i == last:  # sorted positions: a word's elements are neighbours
            continue
        last = i if mode == ELEMENTS else -1
        u = body[i] if i < body.size else tail
        a += _lane0(u, np.uint64(i))
        b += _lane1(u, np.uint64(i))
    return a, b


@jit.step
def _sum_words(body: np.ndarray, words: np.ndarray, m: int) -> tuple[np.uint64, np.uint64]:
    """Both lanes' sums over the first ``m`` word indices of ``words``."""
    a, b = _ZERO, _ZERO
    for i in range(m):
        w = words[i]
        a += _lane0(body[w], np.uint64(w))
        b += _lane1(body[w], np.uint64(w))
    return a, b


@jit.step
def _sum_apply(
    body: np.ndarray, idx: np.ndarray, shift: int, elems: np.ndarray, deltas: np.ndarray
) -> tuple:
    """APPLY (see :func:`_sums_py`), ``SCAN_BLOCK`` positions at a time: their distinct words
    listed branch-free, summed, patched, summed again, all in cache. A word whose elements
    straddle two blocks is summed in both; the digest moves by after - before, so its middle
    terms cancel. (before0, before1, after0, after1, positions consumed)."""
    a, b, c, d = _ZERO, _ZERO, _ZERO, _ZERO
    n = idx.size
    while n > 0 and idx[n - 1] >> shift >= body.size:  # the tail word's: the caller's
        n -= 1
    words = np.empty(SCAN_BLOCK, np.int64)
    for start in range(0, n, SCAN_BLOCK):
        end = min(start + SCAN_BLOCK, n)
        m, last = 0, -1
        for k in range(start, end):  # sorted positions: a word's elements are neighbours
            w = idx[k] >> shift
            words[m] = w
            m += w != last
            last = w
        u0, u1 = _sum_words(body, words, m)
        for k in range(start, end):
            elems[idx[k]] += deltas[k]
        v0, v1 = _sum_words(body, words, m)
        a, b, c, d = a + u0, b + u1, c + v0, d + v1
    return a, b, c, d, n


def _sums_py(
    body: np.ndarray,
    idx: np.ndarray,
    mode: int,
    shift: int,
    tail: np.uint64,
    elems: np.ndarray,
    deltas: np.ndarray,
) -> tuple:
    """The host kernel (numba compiles this and its steps; uint64 arithmetic wraps). Sums of the
    terms of: every word of ``body`` (ALL); the words ``body[idx]`` (WORDS); the distinct words
    holding the sorted element positions ``idx``, word = position >> ``shift`` (ELEMENTS), a
    word past ``body`` being the zero-padded ``tail``. APPLY adds ``deltas`` to ``elems`` (the
    same memory, element by element) at positions ``idx`` and sums each touched word just
    before and just after, in one pass; it stops at the first position in the tail word.
    Returns (sum0, sum1, after0, after1, positions consumed)."""
    if mode == APPLY:
        return _sum_apply(body, idx, shift, elems, deltas)
    if mode == ALL:
        a, b = _sum_all(body)
    else:
        a, b = _sum_listed(body, idx, mode, shift, tail)
    return a, b, _ZERO, _ZERO, 0


@jit.step
def _changed_words(
    old: np.ndarray,
    new: np.ndarray,
    start: int,
    end: int,
    us: np.ndarray,
    vs: np.ndarray,
    at: np.ndarray,
) -> int:
    """Copy the words from ``start`` to ``end`` where ``old`` and ``new`` differ into ``us``,
    ``vs`` (their old and new values) and ``at`` (their indices); returns how many. Branch-free:
    every word is written, and kept only if it changed (a branch per word mispredicts on every
    changed one)."""
    m = 0
    for w in range(start, end):
        u, v = old[w], new[w]
        us[m], vs[m], at[m] = u, v, w
        m += u != v
    return m


@jit.step
def _list_word(
    u: np.uint64,
    v: np.uint64,
    first: int,
    per_word: int,
    positions: np.ndarray,
    deltas: np.ndarray,
    k: int,
) -> int:
    """List the changed elements of word ``u`` -> ``v`` (element e holds bits e*b to (e+1)*b,
    little-endian; its first element is ``first``) at entry ``k`` on, from the words in
    registers; returns the next entry. Branch-free, and unrolled for 16-bit elements."""
    x = u ^ v
    if per_word == 4:  # bf16 / fp16: the common case, unrolled
        m = np.uint64(0xFFFF)
        for e in range(4):
            s = np.uint64(16 * e)
            positions[k] = first + e
            deltas[k] = ((v >> s) - (u >> s)) & m
            k += (x >> s) & m != 0
        return k
    bits = 64 // per_word
    m = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - bits)
    for e in range(per_word):
        s = np.uint64(e * bits)
        positions[k] = first + e
        deltas[k] = ((v >> s) - (u >> s)) & m  # the low bits of a wrapping difference
        k += (x >> s) & m != 0
    return k


@jit.step
def _list_changed(
    us: np.ndarray,
    vs: np.ndarray,
    at: np.ndarray,
    m: int,
    per_word: int,
    positions: np.ndarray,
    deltas: np.ndarray,
    k: int,
    old: np.ndarray,
    advance: bool,
) -> int:
    """List the changed elements of the ``m`` gathered words into ``positions``/``deltas``
    from entry ``k`` and, with ``advance``, write each new word over ``old``'s. The next
    entry."""
    for i in range(m):
        k = _list_word(us[i], vs[i], at[i] * per_word, per_word, positions, deltas, k)
        if advance:
            old[at[i]] = vs[i]
    return k


def _diff_py(
    old: np.ndarray,
    new: np.ndarray,
    start: int,
    per_word: int,
    positions: np.ndarray,
    deltas: np.ndarray,
    advance: bool,
    word0: int,
) -> tuple:
    """DIFF (kernel of :func:`scan_diff`): from word ``start``, ``SCAN_BLOCK`` words at a time,
    each word where ``old`` and ``new`` differ gets its terms summed before and after, its
    changed elements listed and, with ``advance``, ``new`` written over ``old``. Stops at the
    end or before a block that might not fit the outputs (shrunk to fit, at least a word).
    ``word0``: word 0's index in the state hash. Returns (next word, entries, sums x4)."""
    a, b, c, d, k, w = _ZERO, _ZERO, _ZERO, _ZERO, 0, start
    us, vs = np.empty(SCAN_BLOCK, np.uint64), np.empty(SCAN_BLOCK, np.uint64)
    at = np.empty(SCAN_BLOCK, np.int64)
    while w < old.size:
        end = min(w + SCAN_BLOCK, old.size, w + (positions.size - k) // per_word)
        if end <= w:
            break
        m = _changed_words(old, new, w, end, us, vs, at)
        for i in range(m):  # gathered, then visited while in cache: 2x a branch per word
            j = np.uint64(at[i] + word0)
            a, b = a + _lane0(us[i], j), b + _lane1(us[i], j)
            c, d = c + _lane0(vs[i], j), d + _lane1(vs[i], j)
        k = _list_changed(us, vs, at, m, per_word, positions, deltas, k, old, advance)
        w = end
    return w, k, a, b, c, d


def _pairs_py(u: np.ndarray, j: np.ndarray) -> tuple:
    """The host kernel for a shard's words: both lanes' sums of the terms of words ``u`` at
    indices ``j`` (their places in the whole tensor, ``weights.shards``)."""
    a, b = _ZERO, _ZERO
    for k in range(u.size):
        a += _lane0(u[k], j[k])
        b += _lane1(u[k], j[k])
    return a, b


_KERNELS: dict[str, Callable] = {}


def _kernels() -> dict[str, Callable]:
    """The host scans, compiled by numba (cached on disk) on first use; without numba, the
    Python kernel (correct, and very slow)."""
    if not _KERNELS:
        kernels = {"sums": _sums_py, "diff": _diff_py, "pairs": _pairs_py}
        _KERNELS.update(jit.compile_kernels(kernels) or kernels)
    return _KERNELS
