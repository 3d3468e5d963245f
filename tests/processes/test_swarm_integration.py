"""End to end with real processes on loopback: a trainer and rollouts that relay to each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.workloads import Workload
from simulations.localswarm import Swarm
from tests.helpers import bit_equal


@pytest.fixture(scope="module")
def versions() -> list[dict[str, torch.Tensor]]:
    return list(Workload("tiny", lr=3e-4, seed=7).versions(10))


@pytest.fixture()
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    yield s
    s.stop()


@pytest.mark.slow  # started first by `make test`'s parallel pass
def test_six_rollouts_converge_bit_exact_and_relay(swarm: Swarm, versions) -> None:
    trainer = swarm.start_trainer()
    rollouts = swarm.start_rollouts([f"r{i}" for i in range(6)], [trainer.url])
    per_version = []
    for v, weights in enumerate(versions):
        before = (trainer.status() or {})["bytes_uploaded"]
        down_before = sum((r.status() or {})["bytes_downloaded"] for r in rollouts)
        swarm.publish(weights)
        swarm.wait_version(rollouts, v)
        per_version.append(
            (
                (trainer.status() or {})["bytes_uploaded"] - before,
                sum((r.status() or {})["bytes_downloaded"] for r in rollouts) - down_before,
            )
        )
    for r in rollouts:
        assert r.export is not None
        exported = load_file(r.export / "model.safetensors")
        assert bit_equal(exported, versions[-1])
        assert (r.status() or {})["state_hash"] == state_hash(versions[-1]).hex()
    trainer_up = sum(u for u, _ in per_version)
    rollout_down = sum(d for _, d in per_version)
    payload = rollout_down / 6  # what each rollout needed
    assert rollout_down >= 5.9 * payload
    assert trainer_up <= 2 * payload, (trainer_up, payload, per_version)


def test_killed_rollout_resumes_from_its_store(swarm: Swarm, versions) -> None:
    trainer = swarm.start_trainer()
    r0 = swarm.start_rollout("r0", [trainer.url])
    for v in range(3):
        swarm.publish(versions[v])
    swarm.wait_version([r0], 2)
    swarm.kill(r0)
    swarm.publish(versions[3])
    r0b = swarm.start_rollout("r0", [trainer.url], data_dir=r0.data_dir)
    assert (r0b.status() or {})["version"] in (2, 3)  # it restarts from what it had
    swarm.wait_version([r0b], 3)
    down = (r0b.status() or {})["bytes_downloaded"]
    snapshot_size = len(Path(swarm.watch / "v0000.safetensors").read_bytes())
    assert down < snapshot_size / 2  # only the new patch, not the weights again
    assert bit_equal(load_file(r0b.export / "model.safetensors"), versions[3])
