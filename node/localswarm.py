"""Alias of ``simulations.localswarm``, where the harness now lives (issue 13: node/ and
simulations/ imported each other). The dependency runs one way only, node -> simulations, so
the demo, the tests and the benchmarks may keep importing this path; ``simulations`` itself
must use ``simulations.localswarm``.
"""

from simulations.localswarm import (  # noqa: F401 (re-exported)
    ROOT,
    START_TIMEOUT_S,
    Placement,
    Proc,
    Swarm,
    get_json,
    wait_for,
)
