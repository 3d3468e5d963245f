"""`make demo`: a trainer and rollout processes on loopback syncing the built-in model.

A trainer publishes successive versions of the built-in transformer as the workload trains it;
three rollouts follow from the start and a fourth joins late and catches up from an anchor
snapshot. Per version it prints how long after the file appeared in the trainer's watch dir
every running rollout had applied it (verified, in memory, logged) and had exported it
(``--export``: the whole model written for an engine that reloads from disk), how many bytes
the trainer vs the rollouts uploaded (a line as each version lands, the table at the end, a
legend for its columns), what the late rollout fetched and from whom, then checks that every
rollout's exported weights are bit-identical to the trainer's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file

from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.workloads import Workload, parameter_count
from simulations.localswarm import Proc, Swarm, get_json


def uploaded(procs: list[Proc]) -> int:
    return sum((p.status() or {}).get("bytes_uploaded", 0) for p in procs)


LEGEND = (
    "artifacts: what the trainer published for the version: a patch (the changed elements "
    "of one step), an anchor (the whole model, every 4th version, for newcomers)",
    "applied at all: seconds from the file landing in the trainer's watch dir until the last "
    "rollout held the version in memory, verified bit for bit",
    "exported at all: until the last rollout had also written model.safetensors for an engine "
    "that reloads from disk (--export)",
    "trainer sent / rollouts sent: chunk bytes uploaded during the version by the trainer and "
    "by all rollouts together (rollouts relay what they hold to each other)",
)


def run(
    root: Path,
    size: str,
    n_versions: int,
    late_at: int,
    console: Console,
    patch_format: int = 1,
    followers: int = 3,
) -> bool:
    """Publish ``n_versions`` versions to ``followers`` rollouts, one more joining at ``late_at``;
    print a line per version as it lands, then the table. True when every rollout ends
    bit-identical to the trainer."""
    swarm = Swarm(root, chunk_size=64 * 1024)
    try:
        console.print(
            f"starting a trainer and {followers} rollouts (each loads torch and the codec) ..."
        )
        trainer = swarm.start_trainer(anchor_every=4, extra=("--patch-format", str(patch_format)))
        rollouts = swarm.start_rollouts([f"rollout-{i}" for i in range(followers)], [trainer.url])
        console.print(f"trainer {trainer.url}; rollouts " + ", ".join(r.url for r in rollouts))
        for line in LEGEND:
            console.print(f"  [dim]{line}[/]")
        last = _versions(swarm, trainer, rollouts, size, n_versions, late_at, console)
        if late_at < n_versions:
            console.print(_late_joiner(trainer, rollouts))
        return _check(swarm, rollouts, last, console)
    finally:
        swarm.stop()


def _versions(
    swarm: Swarm,
    trainer: Proc,
    rollouts: list[Proc],
    size: str,
    n_versions: int,
    late_at: int,
    console: Console,
) -> Any:
    """Publish the versions, a line per version as it lands (a rollout joins at ``late_at``),
    then the table; returns the last version's weights."""
    table, last = _version_table(), None
    for v, weights in enumerate(Workload(size, lr=1e-6).versions(n_versions)):
        if v == late_at:
            rollouts.append(swarm.start_rollout("rollout-late", [rollouts[0].url]))
            console.print(f"rollout-late joins at v{v} ({rollouts[-1].url})")
        row = _publish_version(swarm, trainer, rollouts, v, weights)
        table.add_row(*row)
        console.print(f"v{v} {row[1]}: applied by all in {row[2]}, exported in {row[3]}")
        last = weights
    console.print(table)
    return last


def _late_joiner(trainer: Proc, rollouts: list[Proc]) -> str:
    """What the late rollout fetched and from whom (its verified bytes by source)."""
    names = {p.url: p.name for p in [trainer, *rollouts]}
    status = rollouts[-1].status() or {}
    by = sorted((status.get("bytes_downloaded_from") or {}).items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{names.get(url, url)} {n / 1e6:.1f} MB" for url, n in by)
    total = status.get("bytes_downloaded", 0) / 1e6
    return (
        f"rollout-late fetched {total:.1f} MB (the newest anchor, then the patches after it; "
        f"the trainer's row at its version counts the anchor it sent): {parts or 'nothing'}"
    )


def _version_table() -> Table:
    """The demo's table, one row per version (:func:`_publish_version` fills them)."""
    return Table(
        "version",
        "artifacts",
        "applied at all",
        "exported at all",
        "trainer sent",
        "rollouts sent",
        "rollouts",
        title="p2psync swarm demo",
    )


def _publish_version(
    swarm: Swarm, trainer: Proc, rollouts: list[Proc], v: int, weights: dict[str, torch.Tensor]
) -> list[str]:
    """Publish version ``v`` and wait until every rollout has it. Its table row: the artifacts,
    how long until the last rollout applied and exported it, and who uploaded how much."""
    t_up, r_up = uploaded([trainer]), uploaded(rollouts)
    t0 = swarm.publish(weights)
    swarm.wait_version(rollouts, v, timeout=300)
    ups = [(r.status() or {}).get("last_update") or {} for r in rollouts]
    applied = max(u.get("applied_at", 0.0) for u in ups) - t0
    exported = max(u.get("at", 0.0) for u in ups) - t0
    kinds = sorted({m["kind"] for m in _manifests(trainer) if m["version"] == v})
    return [
        f"v{v}",
        "+".join(kinds),
        f"{applied:.2f} s",
        f"{exported:.2f} s",
        f"{uploaded([trainer]) - t_up:,} B",
        f"{uploaded(rollouts) - r_up:,} B",
        str(len(rollouts)),
    ]


def _manifests(proc: Proc) -> list[dict]:
    return get_json(f"{proc.url}/manifests") or []


def _check(swarm: Swarm, rollouts: list[Proc], last, console: Console) -> bool:
    want = state_hash(last).hex()
    console.print(f"trainer's last version hashes to {want}")
    ok = True
    for r in rollouts:
        assert r.export is not None
        got = state_hash(load_file(r.export / "model.safetensors")).hex()
        ok &= got == want
        mark = "[green]bit-identical[/]" if got == want else "[red]DIFFERENT[/]"
        console.print(f"  {r.name:<13} exported weights {got} {mark}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=["tiny", "medium"])
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--late-at", type=int, default=5, help="version at which one joins late")
    parser.add_argument("--dir", type=Path, help="keep the run here (default: a temp dir)")
    parser.add_argument(
        "--patch-format",
        type=int,
        default=1,
        choices=[1, 2, 3],
        help="1 (default here: on loopback bytes are free, and the exponent-class scans of"
        " formats 2 and 3 cost O(model) per version on a CPU), 2 (1.4x smaller) or 3 (as small,"
        " no zstd: the GPU's format)",
    )
    args = parser.parse_args(argv)
    console = Console(width=120)
    n = parameter_count(args.size)
    console.print(
        f"[bold]p2psync demo[/]: {args.size} model, {n / 1e6:.1f}M parameters "
        f"({2 * n / 1e6:.0f} MB bf16), {args.versions} versions, lr 1e-6, patch format "
        f"{args.patch_format}"
    )
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
        ok = run(args.dir, args.size, args.versions, args.late_at, console, args.patch_format)
    else:
        with tempfile.TemporaryDirectory(prefix="p2psync-demo-") as tmp:
            ok = run(Path(tmp), args.size, args.versions, args.late_at, console, args.patch_format)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
