"""What one version costs at real model sizes: a trainer and N rollouts as real processes.

Builds a LLaMA-shaped bf16 model of the chosen size (fp32 master weights; each version is one
AdamW-like step on them, so ~1-3% of the bf16 elements change bits), then:

1. **Processes on loopback** (``p2psync node``): a trainer with ``--watch`` and N rollouts with
   ``--export``. Each version is written aside and renamed into the watch dir; the clock runs
   from that rename until the last rollout has exported it (``--export`` + ``version.json``).
   Per version it prints the trainer's publish split (diff, encode, hash+sign, store), each
   rollout's fetch / apply / persist / export time, and the bytes each process wrote to disk.
   At the end: peak RSS per process against the model size.
2. **In-process API** (``p2p_sync.Trainer`` / ``p2p_sync.Rollout(model=...)``): the engine's
   process applies each version into a live state dict; the trainer's side runs in a process of
   its own, as a training loop does (``--api-same-process``: both in one process, sharing one
   GIL). The clock runs from ``publish()`` to the end of ``apply_updates()``.

Dense baselines: the time to push the whole bf16 model over 1 and 10 Gbit/s links.

**The disk between versions.** With ``--export`` every rollout writes the whole model per
version (the engine reloads it from disk), and one local disk takes them all: 2 rollouts write
3.8 GB per version of a 1B model, which a disk at ~420 MB/s takes ~9 s to write back. A run
whose next file appears the instant the last export finished measures that disk, not the
sync. By default the driver therefore lets the disk finish the previous version first
(``sync``, timed and printed as "writeback") and reads the next file once, as a trainer that
has just saved it has it in its page cache; a training step between versions gives the disk
that time. A version's file is deleted once published (a trainer keeping only its newest
checkpoint). ``--back-to-back`` drops the sync and the read: each file appears as soon as the
last rollout handed off the previous version, and the hand-off then includes the disk's
backlog. The API tier syncs the same way (timed, printed) before each version's step and
``publish()``: v0's snapshot leaves ~4 GB to write back, which otherwise lands on v1-v2.

    python benchmarks/scale.py --size 1b --rollouts 2 --versions 4
    python benchmarks/scale.py --size 7b --device cuda     # on a GPU machine
    python benchmarks/scale.py --size 7b --device cuda --trainer-device cuda --skip-processes

v0 is the full snapshot every newcomer starts from (a join, not a per-version cost); it is
printed but kept out of the per-version summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.models import SIZES, Model, llama_shapes  # noqa: E402
from p2p_sync.protocol.versions import PublishPolicy, to_publish  # noqa: E402
from p2p_sync.trust.keys import SigningKey, write_keypair  # noqa: E402
from p2p_sync.weights.statehash import state_hash  # noqa: E402
from p2p_sync.weights.weights_io import save_weights  # noqa: E402
from simulations.localswarm import Proc, Swarm, wait_for  # noqa: E402

POLICY = PublishPolicy()  # the trainer's catch-up spans: the node's default


def rss_peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def reset_rss_peak(pid: int) -> bool:
    """Start ``pid``'s peak RSS again from its current RSS (``clear_refs`` 5), so the peak
    after the join (v0) is told apart from the join's own; False where Linux refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def written(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


@dataclass
class Row:
    version: int
    latency_s: float  # file appeared -> last rollout handed off (exported)
    writeback_s: float  # before the file appeared: the disk writing the previous version back
    applied_s: float  # file appeared -> last rollout applied it in place
    patch_bytes: int
    publish: dict
    updates: list[dict]
    written: dict[str, int]


def write_versions(args: argparse.Namespace, root: Path) -> tuple[list[Path], int]:
    """Every version's file, written before the swarm starts: the driver then holds no model
    while the nodes run (its fp32 master weights would take 3x the model from the machine)."""
    model = Model(args.size, args.lr, "cpu")
    files = []
    for v in range(args.versions):
        if v:
            model.step()
        files.append(root / f".v{v}.safetensors")
        save_weights(files[-1], model.bf16)  # flushed now, not while the nodes write theirs
    os.sync()
    return files, model.params


def run_processes(args: argparse.Namespace, root: Path, console: Console) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    files, params = write_versions(args, root)
    gc.collect()
    swarm = Swarm(root, chunk_size=args.chunk_kb * 1024)
    procs: list[Proc] = []
    rows: list[Row] = []
    try:
        trainer = swarm.start_trainer(
            anchor_every=1000, extra=("--no-p2p", "--patch-format", str(args.patch_format))
        )
        extra = ("--no-p2p", "--device", args.device, *_download_config(args, root))
        rollouts = [
            swarm.start_rollout(f"rollout-{i}", [trainer.url], extra=extra)
            for i in range(args.rollouts)
        ]
        procs = [trainer, *rollouts]
        join: dict[str, int] = {}
        for v, path in enumerate(files):
            writeback = 0.0 if args.back_to_back else settle(path)
            before = {p.name: written(p.popen.pid) for p in procs}
            os.replace(path, swarm.watch / f"v{v:04d}.safetensors")
            t_file = time.time()
            timeout = 900 if v == 0 else 300
            wait_for(
                lambda v=v: all(
                    ((p.status() or {}).get("last_update") or {}).get("version") == v
                    for p in rollouts
                ),
                timeout,
                f"v{v} at every rollout",
                step=0.02,
            )
            ups = [(r.status() or {})["last_update"] for r in rollouts]
            pub = catchups_built(trainer, v)
            after = {p.name: written(p.popen.pid) for p in procs}
            row = Row(
                v,
                max(u["at"] for u in ups) - t_file,
                writeback,
                max(u["applied_at"] for u in ups) - t_file,
                pub.get("patch_bytes", 0),
                pub,
                ups,
                {k: after[k] - before[k] for k in after},
            )
            rows.append(row)
            # published: gone, as a trainer keeping only its newest checkpoint would have it
            # (every version's file in the page cache would starve the exports of memory)
            (swarm.watch / f"v{v:04d}.safetensors").unlink()
            if v == 0:  # the join's peak, then the versions' own from here on
                join = {p.name: rss_peak_kb(p.popen.pid) * 1024 for p in procs}
                if not all(reset_rss_peak(p.popen.pid) for p in procs):
                    join = {}
            console.print(
                f"v{v}: every rollout applied it {row.applied_s:.2f} s and exported it "
                f"{row.latency_s:.2f} s after the file appeared; patch "
                f"{row.patch_bytes / 1e6:.1f} MB"
            )
        after = {p.name: rss_peak_kb(p.popen.pid) * 1024 for p in procs}
    finally:
        swarm.stop()
    peaks = {k: max(v, join.get(k, 0)) for k, v in after.items()}
    split = {k: (join[k], after[k]) for k in after if join and len(files) > 1}
    return {"rows": rows, "peaks": peaks, "split": split, "params": params}


def _sync() -> float:
    """Let the disk write back what is dirty (the last version's exports and stores, the
    snapshot v0 wrote, the process tier's leftovers); returns the seconds it took."""
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def settle(path: Path) -> float:
    """Let the disk write back what the last version left dirty (timed), then read ``path``
    once: a checkpoint a trainer has just saved sits in its page cache."""
    took = _sync()
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    return took


def catchups_built(trainer: Proc, v: int) -> dict:
    """The trainer's figures for ``v`` once the catch-up patches due then are built (they
    follow the head's announcement; the next version's publish would wait for them)."""
    due = any(k == "patch" and b is not None and b < v - 1 for k, b in to_publish(v, POLICY))

    def figures() -> dict:
        return (trainer.status() or {}).get("last_publish") or {}

    if due:
        wait_for(
            lambda: (f := figures()).get("version") == v and f.get("catchup_s", 0) > 0,
            300,
            f"v{v} catch-up",
            step=0.05,
        )
    return figures()


class _SameProcess:
    """The trainer's side in this very process: it shares the engine's GIL and cores, as no
    deployment does (the figures of earlier sessions; ``--api-same-process``)."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        from p2p_sync import Trainer

        self.model = Model(args.size, args.lr, args.trainer_device)
        self.trainer = Trainer(
            key=root / "api.key", data_dir=root / "api-t", publish=_publish(args)
        ).open()
        self.url = self.trainer.url
        self.times: tuple[float, float, dict] = (0.0, 0.0, {})

    def start(self, v: int) -> str:
        if v:
            self.model.step()
        want = state_hash(self.model.bf16).hex()
        t0 = time.monotonic()
        self.trainer.publish(self.model.bf16)
        self.times = (t0, time.monotonic(), dict(self.trainer.last_publish or {}))
        return want

    def published(self) -> tuple[float, float, dict]:
        return self.times

    def close(self) -> None:
        self.trainer.close()

    def __enter__(self) -> _SameProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _OwnProcess:
    """The trainer's side in a process of its own, as a training loop is deployed: it steps
    and hashes the model (untimed), then publishes while the engine waits. Both clocks are
    ``time.monotonic`` (CLOCK_MONOTONIC: one clock for every process on the machine)."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_trainer_side, args=(args, root, theirs), daemon=True)
        self.proc.start()
        self.url = self._recv(600)

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the trainer's process sent nothing for {timeout:g} s")
        return self.conn.recv()

    def start(self, v: int) -> str:
        self.conn.send(v)
        return self._recv(600)  # the hash of the version it is now publishing

    def published(self) -> tuple[float, float, dict]:
        return self._recv(600)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:  # it died: its error went to stderr; the caller's own error matters
            pass
        self.proc.join(600)


def _trainer_side(args: argparse.Namespace, root: Path, conn: Connection) -> None:
    with _SameProcess(args, root) as side:
        conn.send(side.url)
        while (v := conn.recv()) is not None:
            conn.send(side.start(v))
            conn.send(side.published())


def _download(args: argparse.Namespace) -> dict:
    """The rollouts' ``[download]`` settings the command line changes."""
    return {} if args.request_kb is None else {"request_bytes": args.request_kb * 1024}


def _download_config(args: argparse.Namespace, root: Path) -> tuple[str, ...]:
    """``--config`` for rollout processes with ``_download``'s settings (none: no flag)."""
    table = _download(args)
    if not table:
        return ()
    path = root / "rollout.toml"
    path.write_text("[download]\n" + "".join(f"{k} = {v}\n" for k, v in table.items()))
    return ("--config", str(path))


def _publish(args: argparse.Namespace) -> dict:
    return {
        "anchor_every": 1000,
        "patch_format": args.patch_format,
        "chunk_size": args.chunk_kb * 1024,
    }


def _steps(pub: dict, timeline: dict[str, float]) -> dict[str, float]:
    """The engine's steps, in seconds after the trainer announced (both wall clocks: one
    machine): heard, first chunk, fetched, applied."""
    at = pub.get("finished_at", 0.0)
    keys = ("heard", "first_chunk", "fetched", "applied")
    return {k: timeline[k] - at for k in keys if k in timeline and at}


def run_api(args: argparse.Namespace, root: Path) -> list[dict]:
    """Publish ``args.versions`` versions through ``p2p_sync.Trainer`` and apply each into a
    live state dict through ``p2p_sync.Rollout(model=...)`` in this process; the clock runs
    from ``publish()`` to the end of ``apply_updates()``."""
    from p2p_sync import Rollout

    key = SigningKey.generate()
    pub = write_keypair(key, root / "api.key")
    shapes = llama_shapes(args.size).items()
    engine = {k: torch.empty(s, dtype=torch.bfloat16, device=args.device) for k, s in shapes}
    side = (_SameProcess if args.api_same_process else _OwnProcess)(args, root)
    out = []
    try:
        with Rollout(
            trust=[str(pub)],
            peers=[side.url],
            data_dir=root / "api-r",
            model=engine,
            download={"have_poll_s": 0.05, **_download(args)},
        ) as rollout:
            for v in range(args.versions):
                writeback = 0.0 if args.back_to_back else _sync()
                want = side.start(v)
                while rollout.version != v:
                    rollout.wait_for_update(timeout=600)
                    hand = rollout.apply_updates()
                t2 = time.monotonic()
                t0, t1, pub = side.published()
                assert state_hash(engine).hex() == want, f"v{v}: the engine differs"
                out.append(
                    {
                        "version": v,
                        "writeback_s": writeback,
                        "publish_s": t1 - t0,
                        "total_s": t2 - t0,
                        "pause_s": hand.pause_s,
                        "publish": pub,
                        "steps": _steps(pub, hand.updates[-1].timeline if hand.updates else {}),
                        "apply_s": sum(u.apply_s for u in hand.updates),
                        "persist_s": sum(u.persist_s for u in hand.updates),
                    }
                )
    finally:
        side.close()
    return out


def report(args, params: int | None, res: dict, api: list[dict], console: Console) -> None:
    if params is None:
        for a in api:
            p = a["publish"]
            split = " / ".join(
                f"{p.get(k, 0):.2f}" for k in ("diff_s", "encode_s", "hash_sign_s", "store_s")
            )
            steps = ", ".join(f"{k} +{t:.2f}" for k, t in a["steps"].items())
            console.print(
                f"API v{a['version']}: publish() {a['publish_s']:.2f} s (diff / encode / "
                f"hash+sign / store {split}), publish -> applied in the engine "
                f"{a['total_s']:.2f} s, engine pause {a['pause_s']:.3f} s (apply "
                f"{a['apply_s']:.3f}, persist {a['persist_s']:.3f}); after the "
                f"announcement: {steps}; writeback before {a['writeback_s']:.2f} s"
            )
        return
    dense = params * 2
    table = Table(
        "v",
        "patch MB",
        "last applied s",
        "last hand-off s",
        "writeback before s",
        "trainer: diff / encode / hash+sign / store s",
        "rollouts: fetch / apply / persist / export s",
        "written MB: trainer | rollouts",
        title=f"{args.size}: {params / 1e9:.2f}B "
        f"params, {dense / 1e9:.2f} GB bf16, {args.rollouts} rollouts, "
        + ("files back to back" if args.back_to_back else "disk settled before each file"),
    )
    for r in res["rows"]:
        p = r.publish
        split = " / ".join(
            f"{p.get(k, 0):.2f}" for k in ("diff_s", "encode_s", "hash_sign_s", "store_s")
        )
        ups = "; ".join(
            f"{u['fetch_s']:.2f}/{u['apply_s']:.2f}/{u['persist_s']:.3f}/{u['export_s']:.2f}"
            for u in r.updates
        )
        w = list(r.written.values())
        table.add_row(
            f"v{r.version}",
            f"{r.patch_bytes / 1e6:.1f}",
            f"{r.applied_s:.2f}",
            f"{r.latency_s:.2f}",
            f"{r.writeback_s:.2f}",
            split,
            ups,
            f"{w[0] / 1e6:.0f} | " + ", ".join(f"{x / 1e6:.0f}" for x in w[1:]),
        )
    console.print(table)
    steady = [r for r in res["rows"] if r.version > 0]
    if steady:
        lat = [r.latency_s for r in steady]
        applied = [r.applied_s for r in steady]
        console.print(
            f"per version (v1+): last applied {statistics.mean(applied):.2f} s mean, "
            f"{max(applied):.2f} s max"
        )
        patch = statistics.mean(r.patch_bytes for r in steady)
        rw = max(max(list(r.written.values())[1:]) for r in steady)
        console.print(
            f"per version (v1+): last hand-off {statistics.mean(lat):.2f} s mean, {max(lat):.2f} s "
            f"max; patch {patch / 1e6:.1f} MB ({dense / patch:.0f}x smaller than dense); "
            f"dense push {dense * 8 / 1e9:.1f} s at 1 Gbit/s, {dense * 8 / 1e10:.2f} s at 10 Gbit/s"
        )
        export = dense  # each rollout's --export file
        console.print(
            f"bytes written per version per rollout: max {rw / 1e6:.0f} MB = export "
            f"{export / 1e6:.0f} MB + {(rw - export) / patch:.2f}x the patch"
        )
    for r in res["rows"]:
        if r.publish.get("catchup_s"):
            console.print(
                f"v{r.version}: catch-up patches built {r.publish['catchup_s']:.2f} s after the "
                f"head's announcement, {r.publish['catchup_bytes'] / 1e6:.1f} MB"
            )
    for name, peak in res["peaks"].items():
        join, later = res.get("split", {}).get(name, (0, 0))
        split = f" (joining, v0: {join / dense:.2f}x; v1 on: {later / dense:.2f}x)" if join else ""
        console.print(
            f"peak RSS {name}: {peak / 1e9:.2f} GB = {peak / dense:.2f}x the model{split}"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    console.print(
        f"driver peak RSS {peak / 1e6:.2f} GB"
        " (it writes every version's file before the nodes start)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b", choices=sorted(SIZES))
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument(
        "--versions", type=int, default=5, help="5 (v0-v4) reaches the first catch-up patch"
    )
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument(
        "--device", default="cpu", help="where rollouts and the API's engine keep weights"
    )
    parser.add_argument(
        "--trainer-device",
        default="cpu",
        help="where the API's trainer keeps its model (the process tier's trainer reads files)",
    )
    parser.add_argument(
        "--patch-format",
        type=int,
        default=PublishPolicy().patch_format,
        choices=[1, 2, 3],
        help="the trainer's patch format (default: the node's, %(default)s)",
    )
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="each file as soon as the last version is handed off: no writeback, no warm file",
    )
    parser.add_argument(
        "--chunk-kb",
        type=int,
        default=0,
        help="the trainer's chunk size, KiB (0, the default: picked from each payload's size)",
    )
    parser.add_argument(
        "--request-kb",
        type=int,
        help="the rollouts' [download] request_bytes, KiB (default: the shipped one; 0: one "
        "chunk a request)",
    )
    parser.add_argument("--skip-api", action="store_true")
    parser.add_argument(
        "--api-same-process",
        action="store_true",
        help="the API path's trainer in the engine's process (sharing its GIL and cores)",
    )
    parser.add_argument("--skip-processes", action="store_true")
    parser.add_argument("--dir", type=Path, help="work dir (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    console = Console(width=160)
    res: dict = {"rows": [], "peaks": {}}
    api: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="p2psync-scale-") as tmp:
        work = args.dir or Path(tmp)  # --dir keeps the nodes' logs and data
        work.mkdir(parents=True, exist_ok=True)
        if not args.skip_processes:
            res = run_processes(args, work / "processes", console)
            report(args, res["params"], res, [], console)
        gc.collect()
        if not args.skip_api:
            api = run_api(args, work)
            report(args, None, res, api, console)
    if args.json:
        doc = {"rows": [r.__dict__ for r in res["rows"]], "peaks": res["peaks"], "api": api}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
