"""The application's errors: a command that cannot run as asked, a node that cannot start.

They derive from the library's :class:`~p2p_sync.errors.P2PSyncError`, so the CLI prints every
failure the same way; the exit status tells them apart (2 for a node that could not start).
"""

from __future__ import annotations

from pathlib import Path

from p2p_sync.errors import P2PSyncError


class StartupError(P2PSyncError):
    """The node could not start: a port in use, a key it cannot read, a data dir it may not
    write, a watch dir that is not there. The CLI prints one line and exits 2, as for a bad
    flag: nothing ran, so nothing is lost."""


class CommandError(P2PSyncError):
    """A command cannot run as asked (bad file, bad argument)."""


class UsageError(CommandError):
    """Bad input to a command that writes trust material (a key, a certificate, a peer id it
    cannot read): nothing was written; the CLI exits 2, as for a bad flag."""


def read_input(path: Path, what: str) -> bytes:
    """A command's input file, whole; one it cannot read is a :class:`CommandError` naming
    ``what`` it should have been (one line, not a traceback)."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CommandError(f"{path}: cannot read {what} ({exc.strerror})") from None
