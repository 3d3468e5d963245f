import pytest
import torch

from p2p_sync.workloads import Workload


@pytest.fixture(scope="session")
def tiny_versions() -> list[dict[str, torch.Tensor]]:
    """Eleven successive versions of the tiny built-in model (lr high enough to change ~5-10%)."""
    return list(Workload("tiny", lr=1e-4, seed=1).versions(11))
