"""The layers hold: the import contracts of pyproject.toml (``lint-imports``) pass, and they
would catch a broken one. They say what the library may import: node/ (the application) over
simulations/ over the embedding API over the node runtime over the transports and the store
over the I/O-free protocol core (trust, protocol, weights, codec), which imports no event loop
or network stack; no module of a folder imports another in a circle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _lint(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(LINT), "--no-cache", *args]
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True)


def test_the_import_contracts_are_kept() -> None:
    result = _lint()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
    assert "0 broken" in result.stdout
    for contract in ("layers", "import circles", "I/O-free", "neither the application"):
        assert contract in result.stdout.replace("Layers", "layers")


def test_a_broken_contract_fails_the_check(tmp_path: Path) -> None:
    """The embedding API imports the node runtime: a contract forbidding it must fail."""
    config = tmp_path / "broken.toml"
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["p2p_sync"]\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "the API without the runtime"\n'
        'type = "forbidden"\n'
        'source_modules = ["p2p_sync.api"]\n'
        'forbidden_modules = ["p2p_sync.runtime"]\n'
    )
    result = _lint("--config", str(config))
    assert result.returncode != 0
    assert "the API without the runtime BROKEN" in result.stdout


def test_importing_the_embedding_api_loads_no_application_or_terminal_code() -> None:
    """A trainer's ``from p2p_sync import Trainer`` pulls in neither node/ nor rich, nor
    ``torch.distributed.tensor`` (half a second or more: only sharded models load it)."""
    code = (
        "import sys; from p2p_sync import Trainer, Rollout;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('node', 'simulations', 'rich')"
        " or m == 'torch.distributed.tensor'];"
        "print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert result.returncode == 0, f"imported {result.stdout.strip()} {result.stderr[-500:]}"


def test_the_protocol_core_loads_no_event_loop_or_network_stack() -> None:
    """What the contracts state statically, at run time: the trust gate and the version
    planner load no asyncio, aiohttp, trio or libp2p."""
    code = (
        "import sys; import p2p_sync.trust.manifest, p2p_sync.trust.announce,"
        " p2p_sync.protocol.versions, p2p_sync.trust.chunks;"
        "bad = [m for m in ('asyncio', 'aiohttp', 'trio', 'libp2p') if m in sys.modules];"
        "print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert result.returncode == 0, f"imported {result.stdout.strip()} {result.stderr[-500:]}"
