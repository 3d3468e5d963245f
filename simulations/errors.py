"""The simulator's errors: a scenario it cannot run, a network namespace it cannot build.

They derive from the library's :class:`~p2p_sync.errors.P2PSyncError`, so ``p2psync sim``
reports them as one line like every other failure.
"""

from __future__ import annotations

from p2p_sync.errors import P2PSyncError


class ScenarioError(P2PSyncError):
    """A scenario file or value is invalid (the message names the field)."""


class NetnsError(P2PSyncError, RuntimeError):
    """An ``ip``/``tc`` command failed, or the machine cannot build namespaces (still a
    RuntimeError, as before, for callers that catch that)."""
