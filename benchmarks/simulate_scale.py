"""Swarm simulation at scale: simulated time against the Kumar-Ross lower bound, and what a
simulated peer costs in wall-clock time.

    python benchmarks/simulate_scale.py                       # 1,000 and 10,000 peers
    python benchmarks/simulate_scale.py --only 1000 --hostile # + 10% corrupt, 20% churn
    python benchmarks/simulate_scale.py --only 10000 --nat-churn  # + half NATed, 10% churn

Scenarios come from configs/simulations/scale-1k*.toml (1 Gbit/s symmetric links, a 100 MB
patch; 5 ms one way, and 20 ms for the 10,000-peer run, `scale-1k-internet.toml`). That run
uses a smaller patch by default (--payload-10k, 10 MB) so it fits in minutes on 2 cores
(--payload-10k 100 is the full one, ~45 min alone): per-peer cost is per simulated chunk
transfer, reported as such. The NAT + churn row is `scale-10k-nat-churn.toml` (10,000
volunteers on 100 Mbit/s, half behind NAT, 10% churning, 10 MB: the bound of 100 MB at
1 Gbit/s); its worst peer is also reported against its own bound, time offline added.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from simulations.run import simulate
from simulations.scenario import load

ROOT = Path(__file__).resolve().parents[1]


def one(path: Path, label: str, **overrides: object) -> dict:
    sc = load(path, **overrides)
    started = time.perf_counter()
    _, rep = simulate(sc)
    wall = time.perf_counter() - started
    chunks = -(-sc.payload_bytes // sc.chunk_bytes)
    row = {
        "label": label,
        "peers": sc.peers,
        "payload_mb": sc.payload_mb,
        "chunks": chunks,
        "completion_s": rep["completion_time_s"]["worst"],
        "p50_s": rep["completion_p50_s"][0],
        "lower_bound_s": rep["lower_bound_s"][0],
        "ratio": rep["ratio_to_bound"]["worst"],
        "ratio_stayed_online": rep["stayed_online_completion_s"][0] / rep["lower_bound_s"][0],
        "ratio_own_bound": rep["ratio_to_own_bound"]["worst"],
        "trainer_upload_x": rep["trainer_upload_ratio"],
        "converged": rep["honest_converged_fraction"],
        "false_bans": rep["false_bans"],
        "bans": rep["bans"],
        "wall_s": wall,
        "wall_ms_per_peer": 1000 * wall / sc.peers,
        "wall_us_per_peer_chunk": 1e6 * wall / (sc.peers * chunks),
        "events": rep["events"],
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_mb_per_1000_peers": rep["simulator"]["rss_bytes_per_1000_peers"] / 1e6,
        "us_per_event": rep["simulator"]["us_per_event"],
    }
    print(
        f"{label:<28} {sc.peers:>6} peers {sc.payload_mb:>5g} MB:"
        f" last {row['completion_s']:.3f} s"
        f" (p50 {row['p50_s']:.3f}) / bound {row['lower_bound_s']:.3f} s = x{row['ratio']:.2f}"
        f" (peers that stayed online: x{row['ratio_stayed_online']:.2f}; worst peer against its"
        f" own bound, time offline added: x{row['ratio_own_bound']:.2f});"
        f" trainer {row['trainer_upload_x']:.2f}x; converged {row['converged']:.1%};"
        f" bans {row['bans']} (false {row['false_bans']}); wall {wall:.0f} s ="
        f" {row['wall_ms_per_peer']:.0f} ms/peer, {row['wall_us_per_peer_chunk']:.0f} us per"
        f" peer-chunk, {row['us_per_event']:.0f} us per event; peak RSS"
        f" {row['max_rss_mb']:.0f} MB ({row['rss_mb_per_1000_peers']:.0f} MB per 1,000 peers)",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", type=int, choices=[1000, 10000])
    ap.add_argument("--hostile", action="store_true", help="also the 10%% corrupt / 20%% churn run")
    ap.add_argument("--nat-churn", action="store_true", help="also the 10k NAT + churn run")
    ap.add_argument("--payload-10k", type=float, default=10.0)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    cfg = ROOT / "configs/simulations"
    rows = []
    if args.only in (None, 1000):
        rows.append(one(cfg / "scale-1k.toml", "1k, 1 Gbit/s"))
        if args.hostile:
            rows.append(one(cfg / "scale-1k-hostile.toml", "1k, 10% corrupt, 20% churn"))
    if args.only in (None, 10000):
        rows.append(
            one(
                cfg / "scale-1k-internet.toml",
                "10k, 1 Gbit/s, 20 ms",
                peers=10_000,
                payload_mb=args.payload_10k,
            )
        )
        if args.nat_churn:
            rows.append(one(cfg / "scale-10k-nat-churn.toml", "10k, half NATed, 10% churn"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
