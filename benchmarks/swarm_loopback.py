"""Swarm data-plane benchmark on loopback: one seeding trainer, N fetching rollout processes.

Each rollout is a real node process (HTTP server + scheduler + verification + store) that
fetches one signed payload from the trainer and from the other rollouts at the same time, and
keeps serving until the run ends. Reported per N: time until the last rollout holds the whole
payload, aggregate throughput (N x payload / that time), the trainer's upload as a multiple of
the payload, and the ratio of time(N) to time(1).

    python benchmarks/swarm_loopback.py [--size-mb 100] [--rollouts 1,8] [--chunk-kb 256]
                                        [--upload-mbps 100] [--modes open,private]

``--modes open,private`` runs each N twice in one run: an open swarm (clear-text HTTP) and a
private one (every node admitted, the data plane over mutual TLS 1.3); the table then shows
the time and the CPU seconds of the trainer and the rollouts for both.

``--warm`` times a second version, as a swarm that keeps running does: the trainer seeds two
payloads, each rollout fetches the first before the clock starts (its connections then stay
open: a private swarm's ``[http] tls_keepalive_s``) and the second is timed; without it every
connection of the timed version is new (a swarm's first version).

Without a cap the run is CPU-bound on small machines (every process shares the same cores); with
``--upload-mbps`` every node's upload is capped like a home link, which is the regime the swarm
is for: then one rollout is limited by the trainer's uplink and more rollouts add their own.

Targets: aggregate >= 200 MB/s on 2 cores; 100 MB to 8 rollouts <= 3x the time to 1.
Without caps the second cannot hold on 2 cores: each of 8 rollouts must do the CPU work that one
rollout does alone on its own core, so 8 take at least 4x as long whatever the swarm does. With
caps (``--upload-mbps 100``) the links bound the time, and the ratio measures the swarm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2p_sync.protocol.peers import PeerLimits  # noqa: E402
from p2p_sync.protocol.swarmconfig import SwarmConfig  # noqa: E402
from p2p_sync.runtime.config import NodeConfig  # noqa: E402
from p2p_sync.runtime.fetch import fetch_payload  # noqa: E402
from p2p_sync.runtime.node import Node  # noqa: E402
from p2p_sync.runtime.trainer import TrainerNode  # noqa: E402
from p2p_sync.store import Store  # noqa: E402
from p2p_sync.transport.identity import IDENTITY_FILE  # noqa: E402
from p2p_sync.transport.limits import HttpLimits  # noqa: E402
from p2p_sync.transport.tls import identity_key  # noqa: E402
from p2p_sync.trust import admissions  # noqa: E402
from p2p_sync.trust.chunks import manifest_for  # noqa: E402
from p2p_sync.trust.keys import PublicKey, SigningKey  # noqa: E402
from p2p_sync.trust.manifest import SNAPSHOT, SwarmPolicy, sign  # noqa: E402

SWARM = "bench"


async def worker(args: argparse.Namespace) -> None:
    """One rollout: learn the manifest, wait for 'go', fetch, report, keep serving."""
    policy = SwarmPolicy(SWARM, (PublicKey.from_text(args.pubkey),))
    cfg = NodeConfig(
        role="rollout",
        data_dir=Path(args.data_dir),
        trust=(args.pubkey,),
        peers=(args.trainer,),
        directory=PeerLimits(poll_interval_s=0.5),
        download=SwarmConfig(have_poll_s=0.2, **_requests(args)),
        http=HttpLimits(max_upload_mbps=float(args.upload_mbps)),
        **_membership(Path(args.data_dir), args.private == "1"),
    )
    node = Node(cfg, policy, Store.open(cfg.data_dir))
    url = await node.start()
    *warm_up, digest = args.digest.split(",")
    await node.learner.learn(args.trainer, [*warm_up, digest])
    for earlier in warm_up:  # the swarm's earlier version: untimed
        await fetch_payload(node, node.store.manifest(earlier))
    manifest = node.store.manifest(digest)
    assert manifest is not None, "could not learn the manifest"
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    print(json.dumps({"ready": url}), flush=True)
    await reader.readline()  # "go"
    start = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = (start.ru_utime, start.ru_stime)
    t0, up0 = time.monotonic(), node.metrics.bytes_uploaded
    await fetch_payload(node, manifest)
    elapsed = time.monotonic() - t0
    print(json.dumps({"done": elapsed, "down": node.metrics.bytes_downloaded}), flush=True)
    await reader.readline()  # EOF or "stop": keep serving peers until then
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = [usage.ru_utime - cpu0[0], usage.ru_stime - cpu0[1], usage.ru_nvcsw + usage.ru_nivcsw]
    print(json.dumps({"up": node.metrics.bytes_uploaded - up0, "cpu": cpu}), flush=True)
    await node.stop()


def _membership(data_dir: Path, private: bool) -> dict[str, object]:
    """A private node's settings: the files ``admit_all`` wrote beside its data dir."""
    if not private:
        return {}
    where = data_dir.parent / f"{data_dir.name}-membership"
    return {
        "private": True,
        "swarm_ca": where / "ca.pem",
        "admission": where / "admission.pem",
        "revocations": where / "crl.pem",
    }


def admit(key: SigningKey, swarm_id: str, data_dirs: list[Path]) -> None:
    """A private swarm with ``key`` as its admin, each data dir's identity admitted."""
    now = time.time()
    ca = admissions.create_swarm_ca(key.private, swarm_id, now)
    crl = admissions.revocations(key.private, ca, [], 1, now)
    for data_dir in data_dirs:
        public = identity_key(data_dir / IDENTITY_FILE).public_key().public_bytes_raw()
        where = data_dir.parent / f"{data_dir.name}-membership"
        where.mkdir(parents=True, exist_ok=True)
        (where / "ca.pem").write_bytes(ca)
        (where / "crl.pem").write_bytes(crl)
        (where / "admission.pem").write_bytes(admissions.admit(key.private, ca, public, now, 1))


def _requests(args: argparse.Namespace) -> dict[str, float]:
    """The ``[download]`` settings given on the command line (else the shipped ones)."""
    out: dict[str, float] = {}
    if args.request_kb is not None:
        out["request_bytes"] = int(args.request_kb) * 1024
    if args.request_ms is not None:
        out["request_s"] = float(args.request_ms) / 1e3
    if args.forward_seed_chunks is not None:
        out["forward_seed_chunks"] = int(args.forward_seed_chunks)
    return out


def _request_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ("request_kb", "request_ms", "forward_seed_chunks"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


async def start_trainer(
    root: Path,
    size: int,
    chunk: int,
    upload_mbps: float = 0.0,
    rollouts: int = 0,
    versions: int = 1,
) -> tuple[TrainerNode, str, str]:
    """The seeding trainer; with ``rollouts``, of a private swarm admitting it and them;
    ``versions`` payloads, their digests joined by commas (the last one is timed)."""
    key = SigningKey.generate()
    policy = SwarmPolicy(SWARM, (key.public,))
    if rollouts:
        admit(key, policy.swarm_id, [root / "trainer", *(root / f"r{i}" for i in range(rollouts))])
    cfg = NodeConfig(
        role="trainer",
        data_dir=root / "trainer",
        key=root / "k",
        directory=PeerLimits(poll_interval_s=5.0),
        http=HttpLimits(max_upload_mbps=upload_mbps),
        **_membership(root / "trainer", rollouts > 0),
    )
    store = Store.open(cfg.data_dir)
    digests = []
    for version in range(versions):
        payload = os.urandom(size)
        m = manifest_for(
            payload,
            swarm=policy.swarm_id,
            version=version,
            kind=SNAPSHOT,
            target_state=f"{version:032x}",
            layout="00" * 16,
            now=int(time.time()),
            chunk_size=chunk,
        )
        store.put_payload(m, payload)
        store.put_manifest(m, sign(m, [key]))
        digests.append(m.digest)
    node = TrainerNode(cfg, policy, store)
    url = await node.start()
    return node, url, ",".join(digests)


async def run(
    n: int,
    size: int,
    chunk: int,
    root: Path,
    upload_mbps: float = 0.0,
    flags: tuple = (),
    private: bool = False,
    warm: bool = False,
) -> dict:
    admitted = n if private else 0
    trainer, url, digest = await start_trainer(
        root, size, chunk, upload_mbps, admitted, 2 if warm else 1
    )
    pub = trainer.policy.keys[0].text()
    procs = []
    for i in range(n):
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--worker",
                "--trainer",
                url,
                "--digest",
                digest,
                "--pubkey",
                pub,
                "--data-dir",
                str(root / f"r{i}"),
                "--upload-mbps",
                str(upload_mbps),
                "--private",
                "1" if private else "0",
                *flags,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        )
    for p in procs:
        assert p.stdout is not None
        json.loads(await asyncio.wait_for(p.stdout.readline(), 600))  # ready (warmed up)
    trainer_before = trainer.metrics.bytes_uploaded
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        await p.stdin.drain()
    done = [json.loads(await asyncio.wait_for(p.stdout.readline(), 600)) for p in procs]
    wall = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)  # the trainer's (this process's) share
    for p in procs:
        p.stdin.close()
    ups = [json.loads(await p.stdout.readline()) for p in procs]
    for p in procs:
        await p.wait()
    await trainer.stop()
    return {
        "mode": ("private" if private else "open") + (" warm" if warm else ""),
        "rollouts": n,
        "payload_mb": size / 1e6,
        "last_s": wall,
        "slowest_fetch_s": max(d["done"] for d in done),
        "aggregate_mbs": n * size / 1e6 / wall,
        "trainer_upload_x": (trainer.metrics.bytes_uploaded - trainer_before) / size,
        "rollouts_upload_x": sum(u["up"] for u in ups) / size,
        "rollout_cpu_user_s": sum(u["cpu"][0] for u in ups),
        "rollout_cpu_sys_s": sum(u["cpu"][1] for u in ups),
        "rollout_context_switches": sum(u["cpu"][2] for u in ups),
        "trainer_cpu_s": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=100)
    parser.add_argument("--rollouts", default="1,8")
    parser.add_argument("--chunk-kb", type=int, default=256)
    parser.add_argument(
        "--upload-mbps", type=float, default=0.0, help="per-node upload cap, Mbit/s (0: none)"
    )
    parser.add_argument(
        "--request-kb", type=int, help="rollouts' [download] request_bytes, KiB (0: a chunk each)"
    )
    parser.add_argument("--request-ms", type=float, help="rollouts' [download] request_s, ms")
    parser.add_argument(
        "--forward-seed-chunks", type=int, help="rollouts' [download] forward_seed_chunks (0: off)"
    )
    parser.add_argument(
        "--modes", default="open", help="open, private or both (open,private): each N per mode"
    )
    parser.add_argument(
        "--warm", action="store_true", help="time a second version (connections kept open)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--trainer", "--digest", "--pubkey", "--data-dir", "--private"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args))
        return 0
    console = Console(width=120)
    rows = []
    runs = [(int(x), m) for x in args.rollouts.split(",") for m in args.modes.split(",")]
    for n, mode in runs:
        with tempfile.TemporaryDirectory(prefix="p2psync-bench-") as tmp:
            with console.status(f"{args.size_mb:g} MB to {n} rollout(s), {mode}"):
                rows.append(
                    asyncio.run(
                        run(
                            n,
                            int(args.size_mb * 1e6),
                            args.chunk_kb * 1024,
                            Path(tmp),
                            args.upload_mbps,
                            tuple(_request_flags(args)),
                            mode == "private",
                            args.warm,
                        )
                    )
                )
    table = Table(
        "swarm",
        "rollouts",
        "payload",
        "last rollout done",
        "aggregate",
        "trainer upload",
        "rollouts upload",
        f"time / time({rows[0]['rollouts']})",
        "CPU s trainer / rollouts",
        title="p2psync swarm on loopback",
    )
    for r in rows:
        rollout_cpu = r["rollout_cpu_user_s"] + r["rollout_cpu_sys_s"]
        table.add_row(
            r["mode"],
            str(r["rollouts"]),
            f"{r['payload_mb']:.0f} MB",
            f"{r['last_s']:.2f} s",
            f"{r['aggregate_mbs']:.0f} MB/s",
            f"{r['trainer_upload_x']:.2f}x",
            f"{r['rollouts_upload_x']:.2f}x",
            f"{r['last_s'] / rows[0]['last_s']:.2f}",
            f"{r['trainer_cpu_s']:.1f} / {rollout_cpu:.1f}",
        )
    console.print(table)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
