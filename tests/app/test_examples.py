"""The shipped examples run: the in-process one end to end (a trainer and an engine model)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_in_process_example_keeps_the_engine_bit_identical(capsys) -> None:
    from examples.in_process import main

    assert main(steps=3) == 0
    out = capsys.readouterr().out
    assert out.count("bit-identical to trainer: True; same generation: True") == 3
