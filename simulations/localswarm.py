"""A local swarm of real node processes on loopback: used by the demo, the integration tests
and the loopback benchmark. A ``Placement`` runs a node elsewhere (the emulated tier puts each
in its own network namespace).

Every wait is a bounded poll of a condition with a deadline, never a bare sleep.

It lives here, not in ``node/``, so the dependency runs one way: ``node`` (the demo, the
``simulate`` command) imports ``simulations``, and nothing in ``simulations`` imports ``node``
(the nodes it starts are separate processes, ``python -m node``).
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from p2p_sync.trust.keys import SigningKey, write_keypair
from simulations.private import PrivateSwarm, get_json_tls

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0  # a node process prints its URL within seconds; a hang must not block


def get_json(url: str, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def wait_for(condition: Callable[[], bool], timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass(frozen=True)
class Placement:
    """Where a node process runs and how this process reaches it; the default is loopback.

    The emulated tier (``simulations/emulated.py``) puts each node in its own network namespace:
    ``prefix=("ip", "netns", "exec", ns)``, ``listen="10.x.y.z:0"``, and a ``get`` that makes
    its HTTP requests from inside that namespace.
    """

    prefix: tuple[str, ...] = ()
    listen: str = "127.0.0.1:0"
    get: Callable[[str], dict | None] = get_json


LOOPBACK = Placement()


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    data_dir: Path
    export: Path | None = None
    get: Callable[[str], dict | None] = get_json

    def status(self) -> dict | None:
        return self.get(f"{self.url}/status")

    def multiaddr(self) -> str | None:
        """The node's dialable libp2p address (None with --no-p2p)."""
        return (self.status() or {}).get("multiaddr")


@dataclass
class Swarm:
    root: Path
    chunk_size: int = 16 * 1024
    procs: list[Proc] = field(default_factory=list)
    # py-libp2p's own logging for every node (its ``LIBP2P_DEBUG`` syntax, e.g.
    # ``"relay.circuit_v2.dcutr:DEBUG"``), each node's into ``<root>/<name>.libp2p.log``
    libp2p_debug: str | None = None
    private: bool = False  # a private swarm: every node admitted (``simulations.private``)

    def __post_init__(self) -> None:
        self.key_path = self.root / "trainer.key"
        key = SigningKey.generate()
        self.pub = write_keypair(key, self.key_path)
        self.members = PrivateSwarm(self.root, key) if self.private else None
        self.watch = self.root / "watch"
        self.watch.mkdir(parents=True, exist_ok=True)
        self.trainer: Proc | None = None
        self._published = 0

    def _spawn(
        self,
        name: str,
        args: list[str],
        data_dir: Path,
        export: Path | None,
        at: Placement = LOOPBACK,
    ) -> Proc:
        return self._ready(name, self._launch(name, args, data_dir, at), data_dir, export, at)

    def _launch(
        self, name: str, args: list[str], data_dir: Path, at: Placement
    ) -> subprocess.Popen[str]:
        """Start a ``p2psync node`` process; :meth:`_ready` waits for it (several processes
        launched first and waited for after start in parallel: imports are most of a start)."""
        # ROOT first, then whatever the caller's path held (a machine's packages may live there)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        if self.libp2p_debug:
            env["LIBP2P_DEBUG"] = self.libp2p_debug
            env["LIBP2P_DEBUG_FILE"] = str(self.root / f"{name}.libp2p.log")
        log = open(self.root / f"{name}.log", "ab")
        if self.members is not None:
            args = [*args, *self.members.flags(name, data_dir)]
        return subprocess.Popen(
            [
                *at.prefix,
                sys.executable,
                "-m",
                "node",  # the p2psync command (node.entry: its imports made faster)
                "node",
                "--data-dir",
                str(data_dir),
                "--listen",
                at.listen,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=ROOT,
            text=True,
        )

    def _ready(
        self,
        name: str,
        popen: subprocess.Popen[str],
        data_dir: Path,
        export: Path | None,
        at: Placement,
    ) -> Proc:
        assert popen.stdout is not None
        # "p2psync <role> listening on http://...", printed once up: wait a bounded time for it
        ready, _, _ = select.select([popen.stdout], [], [], START_TIMEOUT_S)
        if not ready:
            popen.kill()
            raise AssertionError(
                f"{name} did not start in {START_TIMEOUT_S:.0f} s; see {self.root / name}.log"
            )
        line = popen.stdout.readline()
        if "listening on " not in line:
            raise AssertionError(f"{name} did not start: {line!r}; see {self.root / name}.log")
        url = line.split("listening on ")[1].split()[0]
        get = at.get
        if self.members is not None and at.get is get_json:  # on loopback, as a member
            get = functools.partial(get_json_tls, tls=self.members.tls)
        proc = Proc(name, popen, url, data_dir, export, get)
        self.procs.append(proc)
        return proc

    def start_trainer(
        self, anchor_every: int = 100, at: Placement = LOOPBACK, extra: tuple[str, ...] = ()
    ) -> Proc:
        cfg = self.root / "trainer.toml"
        publish = f"anchor_every = {anchor_every}\nchunk_size = {self.chunk_size}\n"
        cfg.write_text(f"[publish]\n{publish}")
        self.trainer = self._spawn(
            "trainer",
            [
                "--role",
                "trainer",
                "--key",
                str(self.key_path),
                "--watch",
                str(self.watch),
                "--config",
                str(cfg),
                *extra,
            ],
            self.root / "trainer",
            None,
            at,
        )
        return self.trainer

    def start_rollout(
        self,
        name: str,
        peers: list[str],
        data_dir: Path | None = None,
        at: Placement = LOOPBACK,
        extra: tuple[str, ...] = (),
    ) -> Proc:
        return self.start_rollouts([name], peers, at, extra, data_dir)[0]

    def start_rollouts(
        self,
        names: list[str],
        peers: list[str],
        at: Placement = LOOPBACK,
        extra: tuple[str, ...] = (),
        data_dir: Path | None = None,
    ) -> list[Proc]:
        """Rollouts ``names``, all started before any is waited for (a start is mostly
        imports: on two cores, six take about half the time one after another would)."""
        launched = []
        for name in names:
            export = self.root / f"{name}-export"
            args = ["--role", "rollout", "--trust", str(self.pub), "--peers", ",".join(peers)]
            args += ["--export", str(export), *extra]
            where = data_dir or self.root / name
            launched.append((name, self._launch(name, args, where, at), where, export))
        try:
            return [self._ready(n, popen, d, e, at) for n, popen, d, e in launched]
        except BaseException:
            for _, popen, _, _ in launched:
                if popen.poll() is None and all(p.popen is not popen for p in self.procs):
                    popen.kill()
            raise

    def start_bootstrap(
        self, name: str = "bootstrap", at: Placement = LOOPBACK, extra: tuple[str, ...] = ()
    ) -> Proc:
        """A libp2p bootstrap node (DHT server, gossip relay, no weights) for this swarm."""
        args = ["--role", "bootstrap", "--trust", str(self.pub), *extra]
        return self._spawn(name, args, self.root / name, None, at)

    def publish(self, weights: dict[str, torch.Tensor]) -> float:
        """Drop the next version into the trainer's watch dir (written aside, then renamed);
        returns the wall-clock time at which it appeared there."""
        tmp = self.root / f".v{self._published}.tmp"
        save_file(weights, tmp)
        os.replace(tmp, self.watch / f"v{self._published:04d}.safetensors")
        self._published += 1
        return time.time()

    def wait_version(self, procs: list[Proc], version: int, timeout: float = 60) -> None:
        def reached() -> bool:
            return all((p.status() or {}).get("version") == version for p in procs)

        wait_for(reached, timeout, f"{[p.name for p in procs]} to reach v{version}")

    def kill(self, proc: Proc) -> None:
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(timeout=10)
        self.procs.remove(proc)

    def stop(self) -> None:
        for p in self.procs:
            p.popen.terminate()
        for p in self.procs:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.popen.kill()
        self.procs.clear()
