"""Soak: many versions through a trainer and rollout processes on loopback, watching what each
process and data dir holds as they go.

A few versions cannot show what grows per version: memory or descriptors a process never gives back,
files or bytes a store keeps beyond its bound. Here a trainer (``--watch``) and ``--rollouts``
rollouts (``--export``) run as ``p2psync node`` processes, started as the demo and ``scale.py``
start them (``simulations.localswarm.Swarm``). A small model (``--mb`` of bf16 in four tensors)
takes a small random step on ``--changed`` of its elements per version; each version is written
aside and renamed into the watch dir, waited for at every rollout (``/status``), and its file
removed once there. At v0, half-way, every ``--every`` versions and at the end it prints, per
process, RSS and open descriptors (psutil), and per data dir (and export dir) the files and bytes it
holds; at the end, the growth per version over the whole run and over its second half (past the
warm-up: the first anchors, checkpoints and evictions), and whether every rollout ends on the
trainer's state hash.

    python benchmarks/soak.py                          # 200 versions, 4 MB, 2 rollouts
    python benchmarks/soak.py --versions 40 --rollouts 1 --dir /tmp/soak
"""

from __future__ import annotations

import argparse
import os
import stat
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.localswarm import Proc, Swarm  # noqa: E402

TENSORS = 4
ROW = 256  # elements per row of each tensor


class Drift:
    """``mb`` MB of bf16 in four tensors; ``step`` moves ``changed`` of each tensor's elements
    by a random ~1% (enough to flip their bf16 bits), seeded: two runs see the same versions."""

    def __init__(self, mb: float, changed: float, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        rows = max(1, int(mb * 2**20 / 2 / TENSORS / ROW))
        self.weights = {
            f"layers.{i}.weight": torch.randn(rows, ROW, generator=self.gen).to(torch.bfloat16)
            for i in range(TENSORS)
        }
        self.changed = changed

    def step(self) -> dict[str, torch.Tensor]:
        for t in self.weights.values():
            flat = t.view(-1)
            k = max(1, int(flat.numel() * self.changed))
            at = torch.randint(flat.numel(), (k,), generator=self.gen)
            scale = 1 + 0.01 * torch.randn(k, generator=self.gen)
            flat[at] = (flat[at].float() * scale).to(torch.bfloat16)
        return self.weights


def dir_usage(path: Path | None) -> tuple[int, int]:
    """Regular files under ``path`` and their bytes (links not followed; a file removed while
    it is walked is not counted)."""
    files = size = 0
    for root, _, names in os.walk(path) if path is not None else ():
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                files, size = files + 1, size + st.st_size
    return files, size


@dataclass(frozen=True)
class Look:
    """One process and its dirs: RSS (bytes), open descriptors, and the (files, bytes) of its
    data dir and of its export dir (None for the trainer)."""

    rss: int
    fds: int
    data: tuple[int, int]
    export: tuple[int, int] | None

    @classmethod
    def of(cls, p: Proc) -> Look:
        ps = psutil.Process(p.popen.pid)
        export = dir_usage(p.export) if p.export is not None else None
        return cls(ps.memory_info().rss, ps.num_fds(), dir_usage(p.data_dir), export)


@dataclass(frozen=True)
class Sample:
    """Every process once ``version`` reached every rollout, and the hand-offs (file renamed
    in -> at every rollout) of the versions since the last sample."""

    version: int
    procs: dict[str, Look]
    handoff_s: list[float]


def print_sample(console: Console, s: Sample) -> None:
    took = s.handoff_s
    line = f"[bold]at v{s.version}[/]"
    if took:
        line += (
            f": hand-off median {statistics.median(took):.2f} s, max {max(took):.2f} s "
            f"over the last {len(took)} version(s)"
        )
    console.print(line)
    table = Table("process", "RSS MB", "fds", "data files", "data MB", "export files", "export MB")
    for name, look in s.procs.items():
        ex = look.export
        table.add_row(
            name,
            f"{look.rss / 1e6:.1f}",
            str(look.fds),
            str(look.data[0]),
            f"{look.data[1] / 1e6:.2f}",
            str(ex[0]) if ex else "-",
            f"{ex[1] / 1e6:.2f}" if ex else "-",
        )
    console.print(table)


def _per_version(first: Sample, last: Sample) -> dict[str, list[float]]:
    """Each process's growth per version from ``first`` to ``last``: RSS (KB), descriptors,
    data dir files and KB, export dir files and KB."""
    n = max(1, last.version - first.version)
    out = {}
    for name, b in last.procs.items():
        a = first.procs[name]
        ea, eb = a.export or (0, 0), b.export or (0, 0)
        pairs = [
            (a.rss / 1e3, b.rss / 1e3),
            (a.fds, b.fds),
            (a.data[0], b.data[0]),
            (a.data[1] / 1e3, b.data[1] / 1e3),
            (ea[0], eb[0]),
            (ea[1] / 1e3, eb[1] / 1e3),
        ]
        out[name] = [(y - x) / n for x, y in pairs]
    return out


def print_growth(console: Console, first: Sample, mid: Sample, last: Sample) -> None:
    """Growth per version over the whole run and over its second half."""
    for since, what in ((first, "whole run"), (mid, "second half")):
        console.print(f"[bold]growth per version, {what}[/] (v{since.version} -> v{last.version})")
        table = Table(
            "process", "RSS KB", "fds", "data files", "data KB", "export files", "export KB"
        )
        for name, row in _per_version(since, last).items():
            table.add_row(name, *(f"{x:+.3f}" if abs(x) < 10 else f"{x:+.1f}" for x in row))
        console.print(table)


def run(args: argparse.Namespace, root: Path, console: Console) -> bool:
    """The soak; True when every rollout ends on the trainer's state hash."""
    swarm = Swarm(root, chunk_size=64 * 1024)
    drift = Drift(args.mb, args.changed)
    extra = ("--no-p2p",) if args.no_p2p else ()
    marks = {0, args.versions // 2, args.versions - 1}
    marks |= set(range(args.every - 1, args.versions, args.every))
    try:
        trainer = swarm.start_trainer(anchor_every=args.anchor_every, extra=extra)
        rollouts = [
            swarm.start_rollout(f"rollout-{i}", [trainer.url], extra=extra)
            for i in range(args.rollouts)
        ]
        procs, samples, took = [trainer, *rollouts], {}, []
        t_start = time.monotonic()
        for v in range(args.versions):
            weights = drift.weights if v == 0 else drift.step()
            t0 = swarm.publish(weights)
            swarm.wait_version(rollouts, v, timeout=120)
            if v:  # v0 is the join (a snapshot), not a version's cost
                took.append(time.time() - t0)
            (swarm.watch / f"v{v:04d}.safetensors").unlink()  # published: the job's to clean
            if v in marks:
                samples[v] = Sample(v, {p.name: Look.of(p) for p in procs}, took)
                took = []
                print_sample(console, samples[v])
        elapsed = time.monotonic() - t_start
        heads = {p.name: (p.status() or {}).get("state_hash") for p in procs}
    finally:
        swarm.stop()
    last = samples[args.versions - 1]
    print_growth(console, samples[0], samples[args.versions // 2], last)
    ok = len(set(heads.values())) == 1 and None not in heads.values()
    console.print(
        f"{args.versions} versions in {elapsed:.1f} s ({elapsed / args.versions:.2f} s each); "
        f"every rollout on the trainer's state hash: {ok}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=200)
    parser.add_argument("--mb", type=float, default=4.0, help="model size (MB of bf16)")
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--changed", type=float, default=0.01, help="share of elements moved")
    parser.add_argument("--every", type=int, default=50, help="print a look every N versions")
    parser.add_argument("--anchor-every", type=int, default=10, help="the node's default: 10")
    parser.add_argument("--no-p2p", action="store_true", help="HTTP only (no libp2p)")
    parser.add_argument("--dir", type=Path, help="keep the run here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.versions < 2 or args.rollouts < 1 or args.every < 1:
        parser.error("--versions must be >= 2, --rollouts and --every >= 1")
    console = Console(width=120)
    console.print(
        f"[bold]p2psync soak[/]: {args.versions} versions of {args.mb:g} MB (bf16, "
        f"{TENSORS} tensors, {args.changed:.1%} of elements moved per version), "
        f"{args.rollouts} rollout(s), anchors every {args.anchor_every}"
    )
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
        ok = run(args, args.dir, console)
    else:
        with tempfile.TemporaryDirectory(prefix="p2psync-soak-") as tmp:
            ok = run(args, Path(tmp), console)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
