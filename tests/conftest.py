import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

from p2p_sync.weights.workloads import Workload
from simulations.netns import PREFIX_ROOT, cleanup_stale, probe, probe_nat

# Torch's intra-op pool takes a thread per core, and `make test` runs two workers on two cores,
# with the node processes their tests start beside them: a pool in every process oversubscribes
# the machine, and OpenMP's threads spin at each barrier while another process holds the core
# (the codec and weights tests took 38 s, and 26 s with a thread each). Children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# CI replays a fixed set of examples (no flaky reds from a lucky draw); developers get fresh
# random examples on every run, which is where new counterexamples are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run two at a time (``-n 2``), the tests marked ``slow`` start first, so that the pass
    ends on short tests instead of one worker finishing a long one while the other idles."""
    if hasattr(config, "workerinput") or config.getoption("numprocesses", None):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


@pytest.fixture(scope="session")
def tiny_versions() -> list[dict[str, torch.Tensor]]:
    """Eleven successive versions of the tiny built-in model (lr high enough to change ~5-10%)."""
    return list(Workload("tiny", lr=1e-4, seed=1).versions(11))


# ---------------------------------------------------------------- network namespaces
# The tests that build namespaces (the emulated tier, NAT routers) run where the machine has
# what a topology needs and skip, naming what is missing, elsewhere. Every namespace a test
# creates is deleted by ``Topology``'s exit, and again by ``own_prefix``'s finalizer.


@pytest.fixture(scope="module")
def netns_ready() -> None:
    # None here and in CI (root, iproute2, tbf); a reason only when the machine lacks one of
    # them (probe() raises on any other failure, so a bug fails the test instead of skipping)
    reason = probe()
    if reason is not None:
        pytest.skip(f"needs root, iproute2 and netns/veth/tbf, which this machine lacks: {reason}")
    cleanup_stale()  # leftovers of an earlier run that was killed


@pytest.fixture(scope="module")
def nat_ready(netns_ready: None) -> None:
    # None here and in CI (which installs nftables); a reason only when a part is missing
    reason = probe_nat()
    if reason is not None:
        pytest.skip(f"needs nftables' nft and nf_tables nat, which this machine lacks: {reason}")


@pytest.fixture()
def own_prefix(netns_ready: None) -> Iterator[str]:
    """Prefix of every namespace this test process creates; the finalizer deletes them all."""
    prefix = f"{PREFIX_ROOT}{os.getpid()}-"
    yield prefix
    cleanup_stale(prefix, include_live=True)


@pytest.fixture()
def nat_prefix(nat_ready: None, own_prefix: str) -> str:
    """``own_prefix`` for a test that builds NAT routers."""
    return own_prefix
