"""`make demo` on the tiny model: it says what it is doing as it goes, explains its columns,
tells what the late joiner fetched and from whom, and ends bit-identical."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from node.demo import LEGEND, run


@pytest.mark.slow  # started first by `make test`'s parallel pass
def test_the_demo_reports_as_it_goes_and_names_the_late_joiners_sources(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    assert run(tmp_path, "tiny", 2, 1, console, followers=1) is True
    text = console.export_text()
    assert all(line[:40] in text for line in LEGEND)
    assert text.index("starting a trainer") < text.index("v0 ") < text.index("p2psync swarm demo")
    assert len(re.findall(r"^v\d \S+: applied by all in [\d.]+ s", text, flags=re.M)) == 2
    late = re.search(r"rollout-late fetched ([\d.]+) MB .*?: (.*)", text)
    assert late is not None and float(late.group(1)) > 0, text
    sources = dict(re.findall(r"(trainer|rollout-\d) ([\d.]+) MB", late.group(2)))
    assert sources and sum(map(float, sources.values())) <= float(late.group(1)) + 0.1, text
    assert text.count("bit-identical") == 2
