"""What the tests that build network namespaces share (the emulated tier, NAT routers); their
fixtures (``netns_ready``, ``nat_ready``, ``own_prefix``, ``nat_prefix``) live in conftest."""

from __future__ import annotations

import subprocess

from simulations.netns import list_namespaces


def leftovers(prefix: str) -> list[str]:
    """Our namespaces still listed, and any interface in the root namespace named after them."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return [ns for ns in list_namespaces() if ns.startswith(prefix)] + [
        line for line in links.stdout.splitlines() if prefix in line
    ]
