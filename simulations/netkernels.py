"""The bandwidth model's hot loop, compiled: :mod:`simulations.network`'s max-min re-rating, and
one heap for its finish events and the simulator clock's own (:mod:`simulations.fastclock`).

Every step is the reference model's, in the same order and with the same float operations
(no fast-math, so no fused or reordered arithmetic), so a run gives the same events at the
same times, bit for bit (``tests/simulations/test_fastnet.py``). Links keep their flows in
insertion order (a doubly linked list a link, as the reference keeps a dict), since the order
in which raises are granted decides who gets a link's last room.

The state is one tuple of arrays, ``S``, indexed by the column names below. A heap entry is
``(time, seq, flow)``, ordered by (time, seq) as the reference clock's heap is, so finishes and
the clock's events interleave as they do there. ``flow`` -1 is a clock event (its callback
stays in Python); a finish is live while its flow's ``EVENT`` is its ``seq`` (one cancelled or
superseded is skipped when it comes up, and the heap is rebuilt without them once they are a
quarter of it). Contiguous arrays matter at scale: 10,000 peers keep ~900,000 events waiting,
and a heap of Python lists missed the caches on every comparison. Most of those are messages
on the swarm's one latency, which the clock keeps in delay lines of its own
(:class:`simulations.fastclock.FastClock`): :func:`step` stops at the first of them (its
``bound``), and every entry point that changes the heap says what its top now is."""

from __future__ import annotations

from math import inf

import numba
import numpy as np

# nf: a node's floats
UPLINK, DOWNLINK, UP_LEVEL, DOWN_LEVEL, UP_USED, DOWN_USED, SENT, RECEIVED = range(8)
# ni: a node's ints (its flows out and in as linked lists, batch marks)
OUT_HEAD, OUT_TAIL, IN_HEAD, IN_TAIL, OUT_N, IN_N, MARK_UP, MARK_DOWN = range(8)
# ff: a flow's floats (MOVED: bytes it moved up to ``SINCE``)
REMAINING, RATE, SINCE, MOVED = range(4)
# fi: a flow's ints (EVENT: the seq of its pending finish, -1 when none; MARK: de-duplication)
SRC, DST, EVENT, OPREV, ONEXT, IPREV, INEXT, MARK = range(8)
# st: scalars
HEAP_N, STALE, BATCH, NB_UP, NB_DOWN, EPOCH, BATCH_EPOCH = range(7)
STATE_SCALARS = 8
COMPACT_AT = 4_096  # as the clock's: a heap this long, a quarter of it stale, is rebuilt
STOPPED, CLOCK_EVENT, COMPLETED, BOUND = range(4)  # what :func:`step` came to

jit = numba.njit(cache=True)


def new_state(flows: int, heap: int) -> tuple:
    """Arrays for no nodes yet (:func:`with_nodes`), ``flows`` concurrent flows and a heap of
    ``heap`` entries."""
    ff, fi, sf, si = _flow_arrays(flows)
    ht, hs = np.zeros(heap), np.zeros((heap, 2), np.int64)
    st, bl = np.zeros(STATE_SCALARS, np.int64), np.zeros(2, np.int64)
    return (*_node_arrays([], []), ff, fi, ht, hs, sf, si, st, bl)


def _flow_arrays(flows: int) -> tuple:
    """A flow's floats and ints (no flow in any slot), and the scratch a re-rating needs."""
    fi = np.full((flows, 8), -1, np.int64)
    fi[:, MARK] = 0
    return np.zeros((flows, 4)), fi, np.zeros(flows), np.zeros(flows, np.int64)


def _node_arrays(uplink: list[float], downlink: list[float]) -> tuple:
    n = len(uplink)
    nf = np.zeros((n, 8))
    nf[:, UPLINK], nf[:, DOWNLINK] = uplink, downlink
    nf[:, UP_LEVEL] = nf[:, DOWN_LEVEL] = inf
    ni = np.full((n, 8), -1, np.int64)
    ni[:, OUT_N] = ni[:, IN_N] = 0
    return nf, ni


def with_nodes(state: tuple, uplink: list[float], downlink: list[float]) -> tuple:
    """``state`` with these nodes' links (and their lists of links to re-rate: ``bl``)."""
    nf, ni = _node_arrays(uplink, downlink)
    return (nf, ni, *state[2:9], np.zeros(2 * len(nf) + 2, np.int64))


def more_flows(state: tuple, flows: int) -> tuple:
    """``state`` with room for ``flows`` flows, those running kept."""
    nf, ni, ff, fi, ht, hs, sf, si, st, bl = state
    nff, nfi, nsf, nsi = _flow_arrays(flows)
    nff[: len(ff)], nfi[: len(fi)] = ff, fi
    return (nf, ni, nff, nfi, ht, hs, nsf, nsi, st, bl)


def bigger_heap(state: tuple, heap: int) -> tuple:
    """``state`` with room for ``heap`` entries, those waiting kept."""
    nf, ni, ff, fi, ht, hs, sf, si, st, bl = state
    nht, nhs = np.zeros(heap), np.zeros((heap, 2), np.int64)
    nht[: len(ht)], nhs[: len(hs)] = ht, hs
    return (nf, ni, ff, fi, nht, nhs, sf, si, st, bl)


# ------------------------------------------------ the heap: finishes and the clock's events


ARITY = 4  # children a heap entry: half the levels of a binary heap, and side by side


@jit
def _sift_down(ht, hs, i, n):
    """Move entry ``i`` down to its place: the least child moves up into the hole."""
    t, s, f = ht[i], hs[i, 0], hs[i, 1]
    while True:
        first = ARITY * i + 1
        if first >= n:
            break
        low, lt, ls = first, ht[first], hs[first, 0]
        for c in range(first + 1, min(first + ARITY, n)):
            if ht[c] < lt or (ht[c] == lt and hs[c, 0] < ls):
                low, lt, ls = c, ht[c], hs[c, 0]
        if not (lt < t or (lt == t and ls < s)):
            break
        ht[i], hs[i, 0], hs[i, 1] = lt, ls, hs[low, 1]
        i = low
    ht[i], hs[i, 0], hs[i, 1] = t, s, f


@jit
def _pop(ht, hs, st):
    n = st[HEAP_N] - 1
    st[HEAP_N] = n
    if n > 0:
        ht[0], hs[0, 0], hs[0, 1] = ht[n], hs[n, 0], hs[n, 1]
        _sift_down(ht, hs, 0, n)


@jit
def _compact(fi, ht, hs, st):
    """Drop the stale entries; the live ones keep their (time, seq) order."""
    k = 0
    for i in range(st[HEAP_N]):
        if hs[i, 1] < 0 or fi[hs[i, 1], EVENT] == hs[i, 0]:
            ht[k], hs[k, 0], hs[k, 1] = ht[i], hs[i, 0], hs[i, 1]
            k += 1
    st[HEAP_N], st[STALE] = k, 0
    for i in range((k - 2) // ARITY, -1, -1):
        _sift_down(ht, hs, i, k)


@jit
def _push(fi, ht, hs, st, t, seq, f):
    if st[HEAP_N] == len(ht):
        _compact(fi, ht, hs, st)
    i = st[HEAP_N]
    st[HEAP_N] = i + 1
    while i > 0:  # the parents after it move down into the hole
        parent = (i - 1) // ARITY
        pt, ps = ht[parent], hs[parent, 0]
        if not (t < pt or (t == pt and seq < ps)):
            break
        ht[i], hs[i, 0], hs[i, 1] = pt, ps, hs[parent, 1]
        i = parent
    ht[i], hs[i, 0], hs[i, 1] = t, seq, f


@jit
def _top(fi, ht, hs, st):
    """The next live entry's (time, seq); (inf, 0) when none. Stale entries on top go. Each
    entry point returns it to the clock, which compares it with its delay lines (only a kernel
    makes an entry stale, so the clock's copy is live)."""
    while st[HEAP_N] > 0 and hs[0, 1] >= 0 and fi[hs[0, 1], EVENT] != hs[0, 0]:
        _pop(ht, hs, st)
        st[STALE] -= 1
    if st[HEAP_N] == 0:
        return inf, 0
    return ht[0], hs[0, 0]


# ---------------------------------------------------------------- one flow


@jit
def _settle(S, f, now):
    nf, ff, fi = S[0], S[2], S[3]
    since = ff[f, SINCE]
    if since == now:
        return
    moved = ff[f, RATE] * (now - since)
    if moved > ff[f, REMAINING]:
        moved = ff[f, REMAINING]
    ff[f, REMAINING] -= moved
    ff[f, MOVED] += moved
    ff[f, SINCE] = now
    nf[fi[f, SRC], SENT] += moved
    nf[fi[f, DST], RECEIVED] += moved


@jit
def _arm(S, f, now, seq):
    ff, fi, ht, hs, st = S[2], S[3], S[4], S[5], S[8]
    t = now + ff[f, REMAINING] / ff[f, RATE]
    seq += 1
    fi[f, EVENT] = seq
    _push(fi, ht, hs, st, t if t > now else now, seq, f)
    return seq


@jit
def _disarm(S, f):
    fi, ht, hs, st = S[3], S[4], S[5], S[8]
    if fi[f, EVENT] >= 0:
        fi[f, EVENT] = -1
        st[STALE] += 1
        if st[STALE] > COMPACT_AT and 4 * st[STALE] > st[HEAP_N]:
            _compact(fi, ht, hs, st)


@jit
def _set_rate(S, f, rate, now, seq):
    nf, ff, fi = S[0], S[2], S[3]
    _settle(S, f, now)
    old = ff[f, RATE]
    nf[fi[f, SRC], UP_USED] += rate - old
    nf[fi[f, DST], DOWN_USED] += rate - old
    ff[f, RATE] = rate
    if rate > old:
        _disarm(S, f)
        seq = _arm(S, f, now, seq)
    return seq


# ---------------------------------------------------------------- levels and rates


@jit
def _level(capacity, caps, k):
    caps[:k].sort()
    left, n = capacity, k
    for i in range(k):
        if caps[i] * n >= left:
            return left / n
        left -= caps[i]
        n -= 1
    return inf


@jit
def _link_level(S, node, head, nxt, far, far_level, capacity, level):
    """The level of ``node``'s uplink (its flows out: ``head``/``nxt`` are OUT_HEAD/ONEXT, each
    capped by the downlink level at its ``far`` end, DST) or downlink (IN_HEAD/INEXT, SRC)."""
    nf, ni, fi, sf = S[0], S[1], S[3], S[6]
    k, f = 0, ni[node, head]
    while f >= 0:
        sf[k] = nf[fi[f, far], far_level]
        k += 1
        f = fi[f, nxt]
    nf[node, level] = _level(nf[node, capacity], sf, k)


@jit
def _gather(S, lo_up, n_up, lo_down, n_down):
    """The flows on the uplinks ``bl[lo_up:lo_up + n_up]`` then on the downlinks, each once,
    in order, into ``si``; their count."""
    ni, fi, si, st, bl = S[1], S[3], S[7], S[8], S[9]
    st[EPOCH] += 1
    epoch, k = st[EPOCH], 0
    for j in range(n_up):
        f = ni[bl[lo_up + j], OUT_HEAD]
        while f >= 0:
            fi[f, MARK] = epoch
            si[k] = f
            k += 1
            f = fi[f, ONEXT]
    for j in range(n_down):
        f = ni[bl[lo_down + j], IN_HEAD]
        while f >= 0:
            if fi[f, MARK] != epoch:
                fi[f, MARK] = epoch
                si[k] = f
                k += 1
            f = fi[f, INEXT]
    return k


@jit
def _rerate_links(S, lo_up, n_up, lo_down, n_down, now, seq):
    """New levels for the listed links, then new rates for their flows: decreases first, so
    the increases find their room (``Network._rerate_links``)."""
    nf, ff, fi, sf, si, bl = S[0], S[2], S[3], S[6], S[7], S[9]
    for j in range(n_up):
        _link_level(S, bl[lo_up + j], OUT_HEAD, ONEXT, DST, DOWN_LEVEL, UPLINK, UP_LEVEL)
    for j in range(n_down):
        _link_level(S, bl[lo_down + j], IN_HEAD, INEXT, SRC, UP_LEVEL, DOWNLINK, DOWN_LEVEL)
    k = _gather(S, lo_up, n_up, lo_down, n_down)
    raises = 0
    for j in range(k):
        f = si[j]
        up, down = nf[fi[f, SRC], UP_LEVEL], nf[fi[f, DST], DOWN_LEVEL]
        want = up if up <= down else down
        if want < ff[f, RATE]:
            seq = _set_rate(S, f, want, now, seq)
        elif want > ff[f, RATE]:
            si[raises], sf[raises] = f, want  # si[j] was read: raises <= j
            raises += 1
    for j in range(raises):
        f, want = si[j], sf[j]
        src, dst, rate = fi[f, SRC], fi[f, DST], ff[f, RATE]
        room_up = nf[src, UPLINK] - nf[src, UP_USED] + rate
        room_down = nf[dst, DOWNLINK] - nf[dst, DOWN_USED] + rate
        new = want if want <= room_up else room_up
        new = new if new <= room_down else room_down
        if new > rate * (1 + 1e-9):
            seq = _set_rate(S, f, new, now, seq)
    return seq


@jit
def _note(ni, st, bl, node, mark, count, lo):
    if ni[node, mark] != st[BATCH_EPOCH]:
        ni[node, mark] = st[BATCH_EPOCH]
        bl[lo + st[count]] = node
        st[count] += 1


@jit
def _rerate(S, src, dst, now, seq):
    """Re-rate ``src``'s uplink and ``dst``'s downlink, or note them while a batch is open."""
    ni, st, bl = S[1], S[8], S[9]
    n = len(ni)
    if st[BATCH]:
        _note(ni, st, bl, src, MARK_UP, NB_UP, 0)
        _note(ni, st, bl, dst, MARK_DOWN, NB_DOWN, n)
        return seq
    bl[2 * n], bl[2 * n + 1] = src, dst
    return _rerate_links(S, 2 * n, 1, 2 * n + 1, 1, now, seq)


# ---------------------------------------------------------------- links' flow lists


@jit
def _append(ni, fi, f, node, head, tail, count, prev, nxt):
    """Flow ``f`` joins the end of ``node``'s list (out: OUT_HEAD, OUT_TAIL, OUT_N, OPREV,
    ONEXT; in: the IN_ and I columns)."""
    fi[f, prev], fi[f, nxt] = ni[node, tail], -1
    if ni[node, tail] >= 0:
        fi[ni[node, tail], nxt] = f
    else:
        ni[node, head] = f
    ni[node, tail] = f
    ni[node, count] += 1


@jit
def _detach(ni, fi, f, node, head, tail, count, prev, nxt):
    """Flow ``f`` leaves ``node``'s list; the others keep their order."""
    before, after = fi[f, prev], fi[f, nxt]
    if before >= 0:
        fi[before, nxt] = after
    else:
        ni[node, head] = after
    if after >= 0:
        fi[after, prev] = before
    else:
        ni[node, tail] = before
    ni[node, count] -= 1


@jit
def _link(ni, fi, f, src, dst):
    _append(ni, fi, f, src, OUT_HEAD, OUT_TAIL, OUT_N, OPREV, ONEXT)
    _append(ni, fi, f, dst, IN_HEAD, IN_TAIL, IN_N, IPREV, INEXT)


@jit
def _unlink(ni, fi, f):
    _detach(ni, fi, f, fi[f, SRC], OUT_HEAD, OUT_TAIL, OUT_N, OPREV, ONEXT)
    _detach(ni, fi, f, fi[f, DST], IN_HEAD, IN_TAIL, IN_N, IPREV, INEXT)


@jit
def _remove(S, f, now, seq):
    nf, ni, ff, fi = S[0], S[1], S[2], S[3]
    src, dst = fi[f, SRC], fi[f, DST]
    _unlink(ni, fi, f)
    _disarm(S, f)
    rate = ff[f, RATE]
    left = nf[src, UP_USED] - rate
    nf[src, UP_USED] = (0.0 if 0.0 > left else left) if ni[src, OUT_N] else 0.0
    left = nf[dst, DOWN_USED] - rate
    nf[dst, DOWN_USED] = (0.0 if 0.0 > left else left) if ni[dst, IN_N] else 0.0
    ff[f, RATE] = 0.0
    return _rerate(S, src, dst, now, seq)


# ---------------------------------------------------------------- the entry points


@jit
def push_event(S, t, seq):
    """The clock's event ``seq`` at ``t`` (its callback is the clock's): the heap's length."""
    fi, ht, hs, st = S[3], S[4], S[5], S[8]
    _push(fi, ht, hs, st, t, seq, -1)
    return st[HEAP_N]


@jit
def start(S, f, src, dst, nbytes, now, seq):
    """Flow ``f`` (a free slot) starts ``nbytes`` from ``src`` to ``dst``: (seq, heap length,
    heap's first live entry)."""
    ni, ff, fi, st = S[1], S[2], S[3], S[8]
    ff[f, REMAINING], ff[f, RATE], ff[f, SINCE], ff[f, MOVED] = nbytes, 0.0, now, 0.0
    fi[f, SRC], fi[f, DST], fi[f, EVENT] = src, dst, -1
    _link(ni, fi, f, src, dst)
    seq = _rerate(S, src, dst, now, seq)
    top = _top(S[3], S[4], S[5], st)
    return seq, st[HEAP_N], top


@jit
def cancel(S, f, now, seq):
    """Stop flow ``f``: (bytes it moved, seq, heap length, heap's first live entry)."""
    ff, st = S[2], S[8]
    _settle(S, f, now)
    seq = _remove(S, f, now, seq)
    top = _top(S[3], S[4], S[5], st)
    return ff[f, MOVED], seq, st[HEAP_N], top


@jit
def step(S, deadline, seq, bound):
    """Run finish events up to the next of the clock's events, the first finish that completes
    a flow, or ``bound`` (the clock's delay lines' first entry, (time, seq); (inf, 0): none),
    by ``deadline``. A completed flow is removed, with its links' re-rating held for
    :func:`end_batch` (its callback may start the slot's next chunk).
    Returns (what came: STOPPED, CLOCK_EVENT, COMPLETED or BOUND; the event's seq or the flow;
    its time; the bytes the flow moved; finish events run; seq; heap length; heap's first live)."""
    ff, fi, ht, hs, st = S[2], S[3], S[4], S[5], S[8]
    bt, bs = bound
    events = 0
    while True:
        t, s = _top(fi, ht, hs, st)
        if bs and (st[HEAP_N] == 0 or t > bt or (t == bt and s > bs)):
            came = BOUND if bt <= deadline else STOPPED
            return came, 0, bt, 0.0, events, seq, st[HEAP_N], (t, s)
        if st[HEAP_N] == 0 or t > deadline:
            return STOPPED, 0, t, 0.0, events, seq, st[HEAP_N], (t, s)
        f = hs[0, 1]
        _pop(ht, hs, st)
        if f < 0:
            top = _top(fi, ht, hs, st)
            return CLOCK_EVENT, s, t, 0.0, events, seq, st[HEAP_N], top
        fi[f, EVENT] = -1
        events += 1
        _settle(S, f, t)
        if ff[f, REMAINING] > 1e-6 * (1.0 if 1.0 > ff[f, MOVED] else ff[f, MOVED]):
            if ff[f, RATE] > 0:  # slowed down since: at 0 the raise that gives room re-arms
                seq = _arm(S, f, t, seq)
            continue
        ff[f, REMAINING] = 0.0
        st[BATCH], st[NB_UP], st[NB_DOWN] = 1, 0, 0
        st[BATCH_EPOCH] += 1
        seq = _remove(S, f, t, seq)
        top = _top(fi, ht, hs, st)
        return COMPLETED, f, t, ff[f, MOVED], events, seq, st[HEAP_N], top


@jit
def end_batch(S, now, seq):
    """Re-rate the links noted since :func:`step` completed a flow: (seq, heap length, heap's
    first entry)."""
    ni, st = S[1], S[8]
    st[BATCH] = 0
    seq = _rerate_links(S, 0, st[NB_UP], len(ni), st[NB_DOWN], now, seq)
    top = _top(S[3], S[4], S[5], st)
    return seq, st[HEAP_N], top


@jit
def uploads(S, node):
    """The flows leaving ``node``, oldest first."""
    ni, fi = S[1], S[3]
    out = np.empty(ni[node, OUT_N], np.int64)
    k, f = 0, ni[node, OUT_HEAD]
    while f >= 0:
        out[k] = f
        k += 1
        f = fi[f, ONEXT]
    return out
