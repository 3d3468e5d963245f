"""Every exception p2psync raises derives from P2PSyncError and lives in its layer's errors
module (the library's in p2p_sync.errors, the application's in node.errors, the simulator's in
simulations.errors), so a caller catches one base and reads one module per layer; the old
import paths keep working."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from node import errors as node_errors
from p2p_sync import errors
from simulations import errors as sim_errors

ROOT = Path(__file__).resolve().parents[2]
ELSEWHERE: dict[str, set[str]] = {}  # none: every exception class is in its layer's errors
LAYERS = {"p2p_sync": errors, "node": node_errors, "simulations": sim_errors}
HOME = {
    "p2p_sync": "p2p_sync/errors.py",
    "node": "node/errors.py",
    "simulations": "simulations/errors.py",
}

MOVED = [
    ("p2p_sync.trust.announce", "MalformedAnnouncementError"),
    ("p2p_sync.trust.announce", "SmuggledManifestError"),
    ("p2p_sync.transport.http", "PeerError"),
    ("p2p_sync.transport.http", "PeerBusyError"),
    ("p2p_sync.transport.p2p", "P2PError"),
    ("p2p_sync.store", "StoreError"),
    ("p2p_sync.trust.keys", "KeyFileError"),
    ("p2p_sync.runtime.config", "ConfigError"),
    ("p2p_sync.store.restore", "TornApplyError"),
    ("p2p_sync.weights.weights_io", "WeightsFileError"),
]
MOVED_OUT = [  # raised by the application or the simulator: defined in their layer
    ("node.patching", "CommandError", node_errors),
    ("node.node_cmd", "StartupError", node_errors),
    ("simulations.scenario", "ScenarioError", sim_errors),
    ("simulations.netns", "NetnsError", sim_errors),
]


def _exception_classes(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.name
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name.endswith(("Error", "Exception"))
    }


def test_exceptions_are_defined_only_in_their_layers_errors() -> None:
    stray = {}
    for pkg, home in HOME.items():
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            found = _exception_classes(path) - ELSEWHERE.get(rel, set())
            if found and rel != home:
                stray[rel] = sorted(found)
    assert not stray


def _classes(module: object) -> list[type]:
    return [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Exception)]


def test_every_error_derives_from_the_base() -> None:
    assert len(_classes(errors)) > 30
    for module in LAYERS.values():
        assert all(issubclass(c, errors.P2PSyncError) for c in _classes(module))


def test_the_library_defines_no_application_or_simulator_error() -> None:
    names = {c.__name__ for c in _classes(errors)}
    assert not names & {c.__name__ for m in (node_errors, sim_errors) for c in _classes(m)} - {
        "P2PSyncError"
    }


@pytest.mark.parametrize(("module", "name"), MOVED)
def test_old_import_paths_still_work(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


@pytest.mark.parametrize(("module", "name", "home"), MOVED_OUT)
def test_application_and_simulator_errors_keep_their_import_paths(
    module: str, name: str, home: object
) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(home, name)


def test_netns_error_is_still_a_runtime_error() -> None:
    assert issubclass(sim_errors.NetnsError, RuntimeError)
