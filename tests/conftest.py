import os

import pytest
import torch
from hypothesis import settings

from p2p_sync.workloads import Workload

# CI replays a fixed set of examples (no flaky reds from a lucky draw); developers get fresh
# random examples on every run, which is where new counterexamples are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)


@pytest.fixture(scope="session")
def tiny_versions() -> list[dict[str, torch.Tensor]]:
    """Eleven successive versions of the tiny built-in model (lr high enough to change ~5-10%)."""
    return list(Workload("tiny", lr=1e-4, seed=1).versions(11))
