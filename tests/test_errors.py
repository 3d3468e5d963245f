"""Every exception p2psync raises derives from P2PSyncError and lives in p2p_sync.errors, so a
caller catches one base and reads one module; the old import paths keep working."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from p2p_sync import errors

ROOT = Path(__file__).resolve().parents[1]
ELSEWHERE: dict[str, set[str]] = {}  # none: every exception class is in p2p_sync.errors

MOVED = [
    ("p2p_sync.trust.announce", "MalformedAnnouncementError"),
    ("p2p_sync.trust.announce", "SmuggledManifestError"),
    ("p2p_sync.transport.http", "PeerError"),
    ("p2p_sync.transport.http", "PeerBusyError"),
    ("p2p_sync.transport.p2p", "P2PError"),
    ("p2p_sync.store", "StoreError"),
    ("p2p_sync.trust.keys", "KeyFileError"),
    ("p2p_sync.runtime.config", "ConfigError"),
    ("node.patch_cmd", "CommandError"),
    ("simulations.scenario", "ScenarioError"),
    ("simulations.netns", "NetnsError"),
    ("p2p_sync.store.restore", "TornApplyError"),
    ("p2p_sync.weights.weights_io", "WeightsFileError"),
]


def _exception_classes(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.name
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name.endswith(("Error", "Exception"))
    }


def test_exceptions_are_defined_only_in_errors() -> None:
    stray = {}
    for pkg in ("p2p_sync", "node", "simulations"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            found = _exception_classes(path) - ELSEWHERE.get(rel, set())
            if found and rel != "p2p_sync/errors.py":
                stray[rel] = sorted(found)
    assert not stray


def test_every_error_derives_from_the_base() -> None:
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(classes) > 30
    assert all(issubclass(c, errors.P2PSyncError) for c in classes)


@pytest.mark.parametrize(("module", "name"), MOVED)
def test_old_import_paths_still_work(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_netns_error_is_still_a_runtime_error() -> None:
    assert issubclass(errors.NetnsError, RuntimeError)
