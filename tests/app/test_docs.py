"""Every Python block in README.md and docs/ runs as shown, in a fresh interpreter in an empty
directory: the docs cannot drift from the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    pytest.param(code, id=f"{doc.name}:{text[: m.start()].count(chr(10)) + 1}")
    for doc in DOCS
    for text in [doc.read_text()]
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S)
    for code in [m.group(1)]
]


def test_the_docs_have_python_blocks() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS)
def test_a_python_block_of_the_docs_runs_as_shown(code: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
