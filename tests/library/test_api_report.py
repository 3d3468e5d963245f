"""The Python API talks: one line per version on stderr by default, as the CLI prints, none
with ``report=False``, the root logger untouched; ``status()`` says where a rollout stands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, logging, sys
from pathlib import Path
import torch
from p2p_sync import Rollout, Trainer
from p2p_sync.trust.keys import SigningKey, write_keypair

root = Path(sys.argv[1])
pub = write_keypair(SigningKey.generate(), root / "trainer.key")
weights = {"a.weight": torch.randn(64, 32).bfloat16()}
fast = {"download": {"have_poll_s": 0.05}, "directory": {"poll_interval_s": 0.1}}


def run(tag, report):
    with Trainer(key=root / "trainer.key", data_dir=root / f"t{tag}", report=report) as t:
        with Rollout(trust=[str(pub)], peers=[t.url], data_dir=root / f"r{tag}",
                     report=report, **fast) as r:
            before = r.status()
            for v in range(2):
                weights["a.weight"][v] += 1
                t.publish(weights)
                r.wait_for_version(v, timeout=60)
            return before, r.status(), r.version


quiet = run("q", False)
print("--- reported from here", file=sys.stderr, flush=True)
before, after, version = run("r", True)
assert not logging.getLogger().handlers and logging.getLogger().level == logging.WARNING
print(json.dumps({"before": before, "after": after, "version": version}))
"""


@pytest.mark.slow  # started first by `make test`'s parallel pass
def test_the_api_reports_a_line_per_version_unless_asked_not_to(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    quiet, _, loud = done.stderr.partition("--- reported from here")
    assert "p2psync" not in quiet, quiet
    for line in ("trainer listening on", "rollout listening on", "published v0", "published v1"):
        assert loud.count(line) == 1, loud
    assert loud.count("v0 applied") == 1 and loud.count("v1 applied") == 1, loud
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    assert doc["version"] == 1 and doc["after"]["version"] == 1
    assert doc["after"]["role"] == "rollout" and len(doc["after"]["peers"]) >= 1
    assert doc["before"]["version"] is None and "banned" in doc["after"]
