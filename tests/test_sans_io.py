"""The protocol core stays I/O-free: importing it pulls in no event loop or network stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("asyncio", "aiohttp", "trio", "libp2p")
LIB = ROOT / "p2p_sync"
CORE = sorted(  # the I/O-free folders, and the library's top-level modules but the API
    ".".join(p.relative_to(LIB).with_suffix("").parts).removesuffix(".__init__")
    for p in [*LIB.glob("*.py"), *LIB.glob("*/*.py")]
    if p.parts[-2] in {"p2p_sync", "trust", "protocol", "codec", "weights", "store"}
    and p.stem not in {"api"}
    and p != LIB / "__init__.py"
)


def test_protocol_modules_import_no_event_loop_or_network_stack() -> None:
    code = (
        "import sys; import p2p_sync.trust.manifest, p2p_sync.protocol.versions,"
        " p2p_sync.trust.chunks;"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"imported {result.stdout.strip()} {result.stderr[-500:]}"


def test_every_core_module_imports_no_event_loop_or_network_stack() -> None:
    """All of p2p_sync outside transport/, swarm and seeding included. torch imports asyncio
    by itself, so what torch pulls in is the baseline; the core may add none of the rest."""
    modules = ", ".join(f"p2p_sync.{m}" for m in CORE)
    code = (
        "import sys, torch; base = set(sys.modules);"
        f"import {modules};"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules and m not in base];"
        "bad += [m for m in sys.modules if m.startswith(('p2p_sync.transport', 'node'))];"
        "print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"imported {result.stdout.strip()} {result.stderr[-500:]}"
    assert {"protocol.swarm", "protocol.seeding", "protocol.peers", "trust.trusted"} <= set(CORE)
    assert {"store", "codec", "weights.patch"} <= set(CORE)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _path(module: str) -> Path:
    base = ROOT / "p2p_sync" / module.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def test_no_core_module_names_an_io_framework_or_the_node() -> None:
    """The static half: even an import inside a function (run later) is caught."""
    bad = {
        f"{m}: {name}"
        for m in CORE
        for name in _imports(_path(m))
        if name.split(".")[0] in (*FORBIDDEN, "node")
        or name.startswith(("p2p_sync.transport", "simulations"))
    }
    assert not bad, sorted(bad)


def test_the_check_itself_can_fail() -> None:
    code = "import sys, asyncio; sys.exit(int('asyncio' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 1


def test_simulations_never_import_the_node_package() -> None:
    """node/ imports simulations/ (the simulate command, the demo's local swarm), so the
    reverse would be a cycle: simulations drive the library, and node processes as programs."""
    bad = {
        f"{path.name}: {name}"
        for path in (ROOT / "simulations").glob("*.py")
        for name in _imports(path)
        if name.split(".")[0] == "node"
    }
    assert not bad, sorted(bad)
