"""What a private swarm's TLS costs per byte: CPU seconds per GB at each end of one aiohttp
transfer on loopback, clear text against mutual TLS 1.3 with the contexts a private node uses
(``p2p_sync.transport.tls``: admissions under a swarm CA, revocation list checked).

    python benchmarks/tls_cost.py [--size-mb 256]

The server is a separate process streaming one body in 256 KiB pieces (as the data plane
writes a chunk); each side reports the CPU its process spent on the transfer. The ``openssl``
row is the floor under the ``tls`` one: the same contexts encrypting and decrypting the same
pieces through memory BIOs in one process, with no event loop and no socket.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from p2p_sync.transport.tls import PrivateSwarmFiles, SwarmTls  # noqa: E402
from p2p_sync.trust import admissions  # noqa: E402

PIECE = 256 * 1024


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_member(where: Path, admin: Ed25519PrivateKey, ca: bytes, crl: bytes) -> None:
    """A member's files (and its key, for this benchmark's server process) under ``where``."""
    key = Ed25519PrivateKey.generate()
    raw = key.public_key().public_bytes_raw()
    where.mkdir(parents=True)
    (where / "ca.pem").write_bytes(ca)
    (where / "crl.pem").write_bytes(crl)
    (where / "admission.pem").write_bytes(admissions.admit(admin, ca, raw, time.time(), 1))
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (where / "key.pem").write_bytes(pem)


def load_member(where: Path) -> SwarmTls:
    key = serialization.load_pem_private_key((where / "key.pem").read_bytes(), None)
    assert isinstance(key, Ed25519PrivateKey)
    files = PrivateSwarmFiles(where / "ca.pem", where / "admission.pem", where / "crl.pem")
    return SwarmTls.load(files, key, time.time())


async def serve(size: int, tls: SwarmTls | None) -> None:
    """Stream ``size`` bytes per GET; print the port, then the CPU spent once told to stop."""
    piece = os.urandom(PIECE)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(size)})
        await resp.prepare(request)
        for _ in range(size // PIECE):
            await resp.write(piece)
        return resp

    app = web.Application()
    app.router.add_get("/x", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.server if tls else None)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    cpu0 = _cpu()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print(json.dumps({"cpu": _cpu() - cpu0}), flush=True)
    await runner.cleanup()


async def fetch(port: int, tls: SwarmTls | None) -> tuple[int, float, float]:
    """(bytes, client CPU s, wall s) of one GET."""
    connector = aiohttp.TCPConnector(ssl=tls.client if tls else False)
    scheme = "https" if tls else "http"
    async with aiohttp.ClientSession(connector=connector) as session:
        cpu0, t0, got = _cpu(), time.monotonic(), 0
        async with session.get(f"{scheme}://127.0.0.1:{port}/x") as resp:
            async for piece in resp.content.iter_any():
                got += len(piece)
        return got, _cpu() - cpu0, time.monotonic() - t0


def measure(size: int, root: Path | None) -> dict[str, float]:
    argv = [sys.executable, __file__, "--serve", str(size)]
    if root is not None:
        argv += ["--member", str(root / "server")]
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    port = int(server.stdout.readline())
    tls = load_member(root / "client") if root is not None else None
    got, client_cpu, wall = asyncio.run(fetch(port, tls))
    server.stdin.write("stop\n")
    server.stdin.flush()
    server_cpu = json.loads(server.stdout.readline())["cpu"]
    server.wait()
    gb = got / 1e9
    return {
        "wall_s": wall,
        "client_cpu_s_per_gb": client_cpu / gb,
        "server_cpu_s_per_gb": server_cpu / gb,
    }


def _bio_pair(root: Path) -> tuple[ssl.SSLObject, ssl.SSLObject, list[ssl.MemoryBIO]]:
    """A member client and server over memory BIOs, handshaken (mutual TLS 1.3)."""
    bios = [ssl.MemoryBIO() for _ in range(4)]  # into server, out of server, in/out client
    server = load_member(root / "server").server.wrap_bio(bios[0], bios[1], server_side=True)
    client = load_member(root / "client").client.wrap_bio(bios[2], bios[3])
    for _ in range(8):
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        bios[0].write(bios[3].read())
        bios[2].write(bios[1].read())
    return client, server, bios


def openssl_floor(size: int, root: Path) -> dict[str, float]:
    """CPU s/GB of OpenSSL alone: the server's encryption, the client's decryption."""
    client, server, bios = _bio_pair(root)
    piece, enc, dec, moved = os.urandom(PIECE), 0.0, 0.0, 0
    t0 = time.monotonic()
    while moved < size:
        cpu0 = _cpu()
        server.write(piece)
        bios[2].write(bios[1].read())
        cpu1 = _cpu()
        while bios[2].pending:
            moved += len(client.read(PIECE))
        enc, dec = enc + cpu1 - cpu0, dec + _cpu() - cpu1
    gb = moved / 1e9
    wall = time.monotonic() - t0
    return {"wall_s": wall, "client_cpu_s_per_gb": dec / gb, "server_cpu_s_per_gb": enc / gb}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--member", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, load_member(args.member) if args.member else None))
        return 0
    size = args.size_mb * (1 << 20) // PIECE * PIECE
    admin = Ed25519PrivateKey.generate()
    ca = admissions.create_swarm_ca(admin, "ab" * 32, time.time())
    crl = admissions.revocations(admin, ca, [], 1, time.time())
    rows = {}
    with tempfile.TemporaryDirectory(prefix="p2psync-tls-") as tmp:
        for side in ("server", "client"):
            write_member(Path(tmp) / side, admin, ca, crl)
        rows["clear"] = measure(size, None)
        rows["tls"] = measure(size, Path(tmp))
        rows["openssl"] = openssl_floor(size, Path(tmp))
    for name, row in rows.items():
        print(
            f"{name:>7}: {size >> 20} MiB in {row['wall_s']:.2f} s; CPU s/GB:"
            f" client {row['client_cpu_s_per_gb']:.2f}, server {row['server_cpu_s_per_gb']:.2f}"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
