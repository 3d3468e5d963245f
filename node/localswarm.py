"""Moved to ``simulations.localswarm`` (issue 13: node/ and simulations/ imported each other).

Kept as an alias so code written against the old path still imports; new code imports
``simulations.localswarm``. The dependency runs one way only: node -> simulations.
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
