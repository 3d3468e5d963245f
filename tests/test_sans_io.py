"""The protocol core stays I/O-free: importing it pulls in no event loop or network stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("asyncio", "aiohttp", "trio", "libp2p")


def test_protocol_modules_import_no_event_loop_or_network_stack() -> None:
    code = (
        "import sys; import p2p_sync.manifest, p2p_sync.versions, p2p_sync.chunks;"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"imported {result.stdout.strip()} {result.stderr[-500:]}"


def test_the_check_itself_can_fail() -> None:
    code = "import sys, asyncio; sys.exit(int('asyncio' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 1
